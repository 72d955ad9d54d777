"""Hugging Face datasets as training data: loaded from local files, a ``save_to_disk`` folder or the
Hub, streamed or not, tokenized and packed on the fly.

Validation: document ``i`` of the split (in stored order) is held out when ``i % M == M - 1`` with
``M = round(1 / data.validation_fraction)``; a rule that needs no length, so a stream can apply it. A dataset of
fewer than M documents (one .txt file is one document) would hold out nothing by that rule: the last
``validation_fraction`` of each document is held out instead, as the built-in corpus does (``few_documents``).
"""

from __future__ import annotations

import glob
import itertools
import os
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from .corpus import split_train_val
from .packed import TokenWindows
from .sampler import SequentialOrder
from .tokenizer import Tokenizer

# File suffix -> `datasets` builder; plain text files are one document each.
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text",
            ".jsonl.gz": "json", ".json.gz": "json", ".txt.gz": "text"}
READ_BATCH = 256   # documents tokenized per call


def _builder_of(file: str) -> Optional[str]:
    name = file.lower()
    return next((b for suffix, b in sorted(BUILDERS.items(), key=lambda kv: -len(kv[0]))
                 if name.endswith(suffix)), None)


def local_data_files(sources: Sequence[str]) -> list[str]:
    """The data files named by local paths: files, folders (searched recursively) and glob patterns."""
    files: list[str] = []
    for source in sources:
        matches = sorted(glob.glob(os.path.expanduser(source))) or [source]
        for match in matches:
            if os.path.isdir(match):
                files += sorted(str(p) for p in Path(match).rglob("*") if p.is_file() and _builder_of(str(p)))
            elif os.path.isfile(match):
                files.append(match)
            else:
                raise FileNotFoundError(f"{source}: no such file or folder")
    return files


def is_saved_dataset(path: Union[str, Path]) -> bool:
    """True for a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    path = Path(path)
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def load_hf_dataset(name_or_paths: Union[str, Sequence[str]], split: str = "train",
                    config_name: Optional[str] = None, streaming: bool = False):
    """A ``datasets.Dataset`` (or ``IterableDataset`` when streaming) of documents.

    Accepts a ``save_to_disk`` folder, local files/folders/globs (json/jsonl, parquet, csv, txt:
    one document per .txt file), or a Hub name (needs the network). A name that looks local
    (:func:`looks_local`) but does not exist raises :class:`FileNotFoundError` at once.
    """
    import datasets   # lazy: only the hf source and the preprocessing script need it

    sources = [name_or_paths] if isinstance(name_or_paths, (str, Path)) else list(name_or_paths)
    sources = [str(s) for s in sources]
    if len(sources) == 1 and is_saved_dataset(sources[0]):
        ds = datasets.load_from_disk(sources[0])
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise KeyError(f"{sources[0]}: no split {split!r} (has {', '.join(ds)})")
            ds = ds[split]
        return ds.to_iterable_dataset() if streaming else ds
    if all(os.path.exists(s) or glob.glob(os.path.expanduser(s)) for s in sources):
        files = local_data_files(sources)
        if files and all(os.path.getsize(f) == 0 for f in files):
            raise ValueError(f"{', '.join(sources)}: no data: {'the file is' if len(files) == 1 else 'every file is'} "
                             "empty (0 bytes)")
        files = [f for f in files if os.path.getsize(f) > 0]   # an empty file holds no document (and the json
        # and csv readers of datasets fail on one)
        builders = {_builder_of(f) for f in files}
        if not files or None in builders or len(builders) != 1:
            raise ValueError(f"{', '.join(sources)}: expected data files of one kind among "
                             f"{', '.join(sorted(BUILDERS))}, found {files[:5]}")
        builder = builders.pop()
        extra = {"sample_by": "document"} if builder == "text" else {}
        return datasets.load_dataset(builder, data_files=files, split="train", streaming=streaming, **extra)
    local = [s for s in sources if looks_local(s) and not os.path.exists(s)]
    if local or len(sources) > 1:
        raise FileNotFoundError(f"{', '.join(local or sources)}: no such file or folder")
    return datasets.load_dataset(sources[0], config_name, split=split, streaming=streaming)


def looks_local(name: str) -> bool:
    """Whether `name` is meant as a local path rather than a Hub dataset id (`name` or `org/name`):
    it starts with `.`, `/` or `~`, ends with a data-file extension, has an existing parent folder,
    or has more path separators than a Hub id. Such a name is never sent to the Hub."""
    parent = os.path.dirname(name)
    return (name.startswith((".", "/", "~")) or _builder_of(name) is not None
            or (parent != "" and os.path.isdir(parent)) or name.count("/") > 1 or "\\" in name)


def read_texts(dataset, text_column: str, source: str) -> Iterator[list[str]]:
    """Batches of documents (their ``text_column``) in stored order; a missing column is named."""
    for batch in dataset.iter(batch_size=READ_BATCH):
        if text_column not in batch:
            raise KeyError(f"{source}: no column {text_column!r} (columns: {', '.join(batch)})")
        yield [t or "" for t in batch[text_column]]


def validation_period(validation_fraction: float) -> int:
    """``M`` of the held-out rule: every M-th document is validation."""
    return max(2, round(1 / validation_fraction))


def few_documents(dataset, text_column: str, source: str, period: int) -> Optional[list[str]]:
    """Every document of `dataset` when it has fewer than `period` (the every-M-th rule would hold out none), else
    None; reads at most `period` documents."""
    documents = list(itertools.islice((t for batch in read_texts(dataset, text_column, source) for t in batch),
                                      period))
    return documents if len(documents) < period else None


def split_few_documents(documents: list[str], tokenizer: Tokenizer, validation_fraction: float,
                        max_validation_tokens: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) token streams of a dataset of few documents: the last `validation_fraction` of each
    document (from a line start) is held out. Not split at blank lines: a text file is one document as written (a
    book, a log), and end-of-document ids between its paragraphs would cut what the model may attend to."""
    heads, tails = split_train_val(documents, validation_fraction)
    return pack_batches(iter([heads]), tokenizer), pack_batches(iter([tails]), tokenizer, max_validation_tokens)


def split_documents(batches: Iterator[list[str]], period: int, want_validation: bool) -> Iterator[list[str]]:
    """The training (or validation) documents of a stream of batches, by the every-M-th rule."""
    index = 0
    for batch in batches:
        keep = [t for i, t in enumerate(batch, start=index) if (i % period == period - 1) == want_validation]
        index += len(batch)
        if keep:
            yield keep


def pack_batches(batches: Iterator[list[str]], tokenizer: Tokenizer,
                 max_tokens: Optional[int] = None) -> np.ndarray:
    """Tokenize documents, each followed by the end-of-document id, into one int32 stream
    (stopping once ``max_tokens`` are reached, when given)."""
    eod = np.array([tokenizer.eod_id], dtype=np.int32)
    pieces, total = [], 0
    for texts in batches:
        for ids in tokenizer.encode_batch(texts):
            pieces += [ids.astype(np.int32, copy=False), eod]
            total += len(ids) + 1
            if max_tokens is not None and total >= max_tokens:
                return np.concatenate(pieces)
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


class TokenStream:
    """Training samples packed on the fly from documents read in order, epoch after epoch.

    Sample ``k`` is ``stream[k*L : k*L + L + 1]`` of the endless stream of tokenized documents
    (each followed by the end-of-document id; epoch ``e + 1`` follows epoch ``e``), exactly as
    :class:`TokenWindows` cuts a finite stream. Its order is sequential (:meth:`sample_order`).
    Reads only go forwards: a request behind the read position restarts from the beginning, and
    a resume at sample ``k`` re-reads and re-tokenizes the documents before it (exact, but it
    costs the time to tokenize them).
    """

    def __init__(self, open_epoch: Callable[[int], Iterator[list[str]]], tokenizer: Tokenizer,
                 sequence_length: int, source: str):
        self.open_epoch, self.tokenizer = open_epoch, tokenizer
        self.sequence_length, self.source = sequence_length, source
        self.eod_id = tokenizer.eod_id
        self._restart()

    def sample_order(self, seed: int) -> SequentialOrder:
        """Streams are read in stored order; ``seed`` plays no part (shuffle the data beforehand)."""
        return SequentialOrder()

    def _restart(self) -> None:
        self._epoch, self._epoch_tokens = 0, 0
        self._batches = self.open_epoch(0)
        self._buffer = np.zeros(0, dtype=np.int32)
        self._buffer_start = 0   # stream position of self._buffer[0]

    def _read_more(self) -> None:
        try:
            texts = next(self._batches)
        except StopIteration:
            if self._epoch_tokens == 0:
                raise ValueError(f"{self.source}: the dataset has no training documents") from None
            self._epoch, self._epoch_tokens = self._epoch + 1, 0
            self._batches = self.open_epoch(self._epoch)
            return
        tokens = pack_batches(iter([texts]), self.tokenizer)
        self._epoch_tokens += len(tokens)
        self._buffer = np.concatenate([self._buffer, tokens])

    def __getitem__(self, k: int) -> torch.Tensor:
        """Sample ``k`` as a LongTensor of ``sequence_length + 1`` tokens."""
        start = k * self.sequence_length
        end = start + self.sequence_length + 1
        if start < self._buffer_start:
            self._restart()
        while self._buffer_start + len(self._buffer) < end:
            self._read_more()
            drop = min(start - self._buffer_start, len(self._buffer))   # never needed again
            self._buffer, self._buffer_start = self._buffer[drop:], self._buffer_start + drop
        lo = start - self._buffer_start
        return torch.from_numpy(self._buffer[lo:lo + self.sequence_length + 1].astype(np.int64))


def build_hf_datasets(name_or_path: str, split: str, config_name: Optional[str], text_column: str,
                      streaming: bool, tokenizer: Tokenizer, sequence_length: int, validation_fraction: float,
                      validation_samples: Optional[int]):
    """``(train, validation)`` for ``data=hf``.

    Fewer than M documents: each one's tail is held out (``split_few_documents``), all in memory. Not streamed:
    every document is tokenized at start and packed in memory (random access,
    shuffled per epoch like the built-in corpus). Streamed: training samples come from a
    :class:`TokenStream`; the validation set is packed in memory from the held-out documents,
    reading only until ``validation_samples`` samples are filled (all when None).
    """
    period = validation_period(validation_fraction)
    max_tokens = None if validation_samples is None else validation_samples * sequence_length + 1
    documents = few_documents(load_hf_dataset(name_or_path, split, config_name, streaming=True), text_column,
                              name_or_path, period)
    if documents is not None:   # fewer than `period`: held in memory whether streamed or not
        train, val = split_few_documents(documents, tokenizer, validation_fraction, max_tokens)
        return (TokenWindows(train, sequence_length, f"{name_or_path} (train)"),
                TokenWindows(val, sequence_length, f"{name_or_path} (validation: the last "
                                                   f"{validation_fraction:.0%} of each document)"))

    def open_epoch(epoch: int) -> Iterator[list[str]]:
        ds = load_hf_dataset(name_or_path, split, config_name, streaming)
        return split_documents(read_texts(ds, text_column, name_or_path), period, want_validation=False)

    val_ds = load_hf_dataset(name_or_path, split, config_name, streaming)
    val_docs = split_documents(read_texts(val_ds, text_column, name_or_path), period, want_validation=True)
    val = TokenWindows(pack_batches(val_docs, tokenizer, max_tokens), sequence_length,
                       f"{name_or_path} (validation: every {period}th document)")
    if streaming:
        train = TokenStream(open_epoch, tokenizer, sequence_length, name_or_path)
    else:
        train = TokenWindows(pack_batches(open_epoch(0), tokenizer), sequence_length, f"{name_or_path} (train)")
    return train, val
