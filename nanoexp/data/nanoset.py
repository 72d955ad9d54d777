"""The Nanoset format: a folder of pre-tokenized documents, read by memory-mapping.

A Nanoset folder holds three files (written by ``scripts/preprocess_data.py``):

- ``tokens.bin``: every document's tokens followed by the end-of-document id, concatenated, as raw
  ``uint16`` (when every id fits, vocab_size <= 65536) or ``uint32``;
- ``documents.npy``: int64 end offset of each document in ``tokens.bin`` (eod included), so document
  ``d`` is ``tokens[ends[d-1]:ends[d]]``;
- ``metadata.json``: ``format``, ``format_version``, ``tokenizer``, ``vocab_size``, ``eod_id``, ``dtype``,
  ``num_tokens``, ``num_documents`` (and the sources it was made from).

``metadata.json`` is written last, so a folder without it is unfinished or not a Nanoset.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from .packed import TokenWindows

FORMAT = "nanoset"
FORMAT_VERSION = 1
TOKENS_FILE, INDEX_FILE, METADATA_FILE = "tokens.bin", "documents.npy", "metadata.json"
METADATA_KEYS = ("tokenizer", "vocab_size", "eod_id", "dtype", "num_tokens", "num_documents")   # what readers use


class NanosetError(ValueError):
    """A Nanoset folder that cannot be read as promised; the message names the file."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a vocabulary: uint16 or uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2 ** 16 else np.dtype(np.uint32)


class NanosetWriter:
    """Appends tokenized documents to a new Nanoset folder; :meth:`close` writes the index and metadata.

    Refuses a folder that already holds a Nanoset file unless ``overwrite`` is true.
    """

    def __init__(self, folder: Union[str, Path], tokenizer_name: str, vocab_size: int, eod_id: int,
                 overwrite: bool = False, extra_metadata: Optional[dict[str, Any]] = None):
        self.folder = Path(folder)
        existing = [f for f in (TOKENS_FILE, INDEX_FILE, METADATA_FILE) if (self.folder / f).exists()]
        if existing and not overwrite:
            raise FileExistsError(f"{self.folder} already holds a Nanoset ({', '.join(existing)}); "
                                  "pass --overwrite to replace it")
        self.made_folder = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        if (self.folder / METADATA_FILE).exists():   # an overwrite: unfinished until the new metadata lands
            (self.folder / METADATA_FILE).unlink()
        self.dtype = token_dtype(vocab_size)
        self.metadata = {"format": FORMAT, "format_version": FORMAT_VERSION, "tokenizer": tokenizer_name,
                         "vocab_size": int(vocab_size), "eod_id": int(eod_id), "dtype": self.dtype.name,
                         **(extra_metadata or {})}
        self._eod = np.array([eod_id], dtype=self.dtype)
        self._file = open(self.folder / TOKENS_FILE, "wb")
        self.ends: list[int] = []
        self.num_tokens = 0

    def add(self, documents: list[np.ndarray]) -> None:
        """Append documents (their ids, without the end-of-document id, which is added here)."""
        if not documents:
            return
        pieces = [p for doc in documents for p in (np.asarray(doc).astype(self.dtype, copy=False), self._eod)]
        self._file.write(np.concatenate(pieces).tobytes())
        ends = self.num_tokens + np.cumsum([len(doc) + 1 for doc in documents])
        self.ends += ends.tolist()
        self.num_tokens = int(ends[-1])

    def close(self) -> dict[str, Any]:
        """Finish the folder and return its metadata."""
        if self._file.closed:
            return self.metadata
        self._file.close()
        np.save(self.folder / INDEX_FILE, np.asarray(self.ends, dtype=np.int64))
        self.metadata.update(num_tokens=self.num_tokens, num_documents=len(self.ends))
        tmp = self.folder / (METADATA_FILE + ".tmp")
        tmp.write_text(json.dumps(self.metadata, indent=2) + "\n")
        os.replace(tmp, self.folder / METADATA_FILE)
        return self.metadata

    def discard(self) -> None:
        """Remove what this writer wrote (and its folder, if it made it): a failed run leaves no half Nanoset."""
        self._file.close()
        for name in (TOKENS_FILE, INDEX_FILE, METADATA_FILE, METADATA_FILE + ".tmp"):
            (self.folder / name).unlink(missing_ok=True)
        if self.made_folder and not any(self.folder.iterdir()):
            self.folder.rmdir()

    def __enter__(self) -> "NanosetWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_nanoset(folder: Union[str, Path]) -> tuple[np.memmap, np.ndarray, dict[str, Any]]:
    """Check a Nanoset folder and return ``(tokens memmap, document ends, metadata)``.

    Raises :class:`NanosetError` naming the file for a missing folder or file, an unknown format
    version, an empty dataset, a token file whose size does not match the index, or a dtype that
    cannot hold the vocabulary.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise NanosetError(f"{folder} does not exist or is not a folder")
    meta_path = folder / METADATA_FILE
    if not meta_path.is_file():
        raise NanosetError(f"{meta_path} is missing: {folder} is not a finished Nanoset "
                           "(make one with scripts/preprocess_data.py)")
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise NanosetError(f"{meta_path}: not valid JSON ({error}); re-run scripts/preprocess_data.py") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        found = meta if isinstance(meta, dict) else {}
        raise NanosetError(f"{meta_path}: format {found.get('format')!r} version {found.get('format_version')!r}, "
                           f"this reader needs {FORMAT!r} version {FORMAT_VERSION}")
    missing = [key for key in METADATA_KEYS if key not in meta]
    if missing:
        raise NanosetError(f"{meta_path}: it lacks {', '.join(missing)}; re-run scripts/preprocess_data.py")
    if meta["dtype"] not in ("uint16", "uint32"):
        raise NanosetError(f"{meta_path}: dtype {meta['dtype']!r}, a Nanoset's tokens are uint16 or uint32")
    dtype = np.dtype(meta["dtype"])
    if meta["vocab_size"] - 1 > np.iinfo(dtype).max:
        raise NanosetError(f"{meta_path}: dtype {dtype.name} cannot hold ids of a {meta['vocab_size']}-token "
                           "vocabulary; re-run scripts/preprocess_data.py")
    for name in (TOKENS_FILE, INDEX_FILE):
        if not (folder / name).is_file():
            raise NanosetError(f"{folder / name} is missing")
    ends = np.load(folder / INDEX_FILE)
    n_tokens = meta["num_tokens"]
    if meta["num_documents"] == 0 or n_tokens == 0:
        raise NanosetError(f"{folder}: the dataset is empty (0 documents)")
    if len(ends) != meta["num_documents"] or ends[-1] != n_tokens or np.any(np.diff(ends) <= 0) or ends[0] <= 0:
        raise NanosetError(f"{folder / INDEX_FILE} does not match {meta_path} ({len(ends)} documents ending "
                           f"at token {int(ends[-1]) if len(ends) else 0}, metadata: {meta['num_documents']} "
                           f"documents, {n_tokens} tokens)")
    size = (folder / TOKENS_FILE).stat().st_size
    if size != n_tokens * dtype.itemsize:
        raise NanosetError(f"{folder / TOKENS_FILE} has {size} bytes but its index needs {n_tokens} tokens x "
                           f"{dtype.itemsize} bytes = {n_tokens * dtype.itemsize}: the file is truncated or "
                           "does not belong to this index")
    tokens = np.memmap(folder / TOKENS_FILE, dtype=dtype, mode="r", shape=(n_tokens,))
    return tokens, ends, meta


def validation_cut(ends: np.ndarray, validation_fraction: float) -> int:
    """Token offset where the held-out tail starts: the first document boundary at or after
    ``(1 - validation_fraction)`` of the tokens, or exactly there if no document ends in the tail."""
    n = int(ends[-1])
    target = n - int(n * validation_fraction)
    later = ends[(ends >= target) & (ends < n)]
    return int(later[0]) if len(later) else target


class Nanoset(TokenWindows):
    """The training or validation samples of one Nanoset folder, memory-mapped (nothing is loaded
    up front; each sample reads ``sequence_length + 1`` tokens).

    ``split="train"`` is the head of the token stream, ``"validation"`` the held-out tail from
    :func:`validation_cut` (whole documents when the folder has more than one).
    """

    def __init__(self, folder: Union[str, Path], sequence_length: int, split: str = "train",
                 validation_fraction: float = 0.0):
        if split not in ("train", "validation"):
            raise ValueError(f"split={split!r}: allowed values are train, validation")
        self.folder = Path(folder)
        tokens, ends, self.metadata = open_nanoset(self.folder)
        self.eod_id = self.metadata["eod_id"]
        cut = validation_cut(ends, validation_fraction)
        part = tokens[:cut] if split == "train" else tokens[cut:]
        super().__init__(part, sequence_length, f"{self.folder} ({split})")
