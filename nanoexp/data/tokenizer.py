"""Tokenizers: a built-in UTF-8 byte tokenizer and a wrapper around a local Hugging Face tokenizer.

Both expose the same small interface used by the data pipeline and the trainer:
``name``, ``vocab_size``, ``eod_id``, ``encode(text) -> list[int]``,
``encode_array(text) -> np.ndarray`` (fast path for packing), ``encode_batch(texts) -> list[np.ndarray]``
and ``decode(ids) -> str``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterable, Union

import numpy as np

Tokenizer = Union["ByteTokenizer", "HFTokenizer"]


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text; id 256 marks the end of a document."""

    name = "byte"
    eod_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as ids; no special tokens are added."""
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Same ids as :meth:`encode`, as an int32 array, without a Python-level loop."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """:meth:`encode_array` of each text."""
        return [self.encode_array(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Turn ids back into text; ids >= 256 (special tokens) are skipped, bad UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=257, eod_id=256)"


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local folder (from the Hub only with ``local_files_only=False``,
    which the preprocessing script allows; training never downloads).

    The end-of-document id is the tokenizer's ``eos_token_id``; a tokenizer without one is rejected.
    """

    def __init__(self, path: Union[str, Path], local_files_only: bool = True):
        from transformers import AutoTokenizer  # lazy: transformers is an optional dependency

        self.name = str(path)
        self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=local_files_only)
        # Packing encodes whole documents; silence the "longer than model_max_length" warning.
        self._tok.model_max_length = sys.maxsize
        if self._tok.eos_token_id is None:
            raise ValueError(
                f"tokenizer.tokenizer_name_or_path={self.name}: the tokenizer has no eos_token, "
                "which nanoexp needs to mark document ends; add one to its config"
            )
        self.eod_id = int(self._tok.eos_token_id)
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        """Return the token ids of ``text`` without any special tokens (no BOS/EOS)."""
        return self._tok.encode(text, add_special_tokens=False)

    def encode_array(self, text: str) -> np.ndarray:
        """Same ids as :meth:`encode`, as an int32 array."""
        return np.asarray(self.encode(text), dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """:meth:`encode_array` of each text, in one call to the batched (Rust) tokenizer."""
        ids = self._tok(list(texts), add_special_tokens=False)["input_ids"]
        return [np.asarray(x, dtype=np.int32) for x in ids]

    def decode(self, ids: Iterable[int]) -> str:
        """Turn ids back into text with the wrapped tokenizer's own decoding rules."""
        return self._tok.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id})"


def build_tokenizer(name_or_path: str, allow_download: bool = False) -> Tokenizer:
    """Return the tokenizer named by the config value ``tokenizer.tokenizer_name_or_path``.

    ``"byte"`` gives :class:`ByteTokenizer`; anything else must be a local Hugging Face tokenizer folder,
    otherwise :class:`FileNotFoundError` is raised. Training never downloads; ``allow_download`` (the
    preprocessing script) also accepts a Hub tokenizer name.
    """
    if name_or_path == "byte":
        return ByteTokenizer()
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return HFTokenizer(path)
    if allow_download:
        return HFTokenizer(name_or_path, local_files_only=False)
    raise FileNotFoundError(
        f"tokenizer.tokenizer_name_or_path={name_or_path}: not 'byte' and no such local folder. "
        "Use 'byte' for the built-in byte tokenizer, or the path of a folder holding a "
        "Hugging Face tokenizer (tokenizer.json / tokenizer_config.json)."
    )
