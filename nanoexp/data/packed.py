"""Fixed-length training samples cut from one token stream (in memory or memory-mapped)."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from .corpus import load_builtin_documents, split_train_val
from .tokenizer import Tokenizer


class TokenWindows:
    """Sample ``i`` of a token stream is ``tokens[i*L : i*L + L + 1]`` with ``L = sequence_length``.

    The model reads the first ``L`` tokens and predicts the last ``L``. Consecutive samples share
    one token, so every token after the first is a prediction target exactly once. The tail that
    does not fill a whole sample is dropped. ``tokens`` may be any 1-D array, including a
    ``np.memmap`` (only the touched pages are read). ``source`` names the data in error messages.
    """

    def __init__(self, tokens: np.ndarray, sequence_length: int, source: str = "dataset"):
        if sequence_length < 1:
            raise ValueError(f"sequence_length={sequence_length}: must be >= 1")
        self.tokens = tokens
        self.sequence_length = sequence_length
        self.source = source
        self.num_samples = max(0, (len(tokens) - 1) // sequence_length)
        if self.num_samples == 0:
            raise ValueError(
                f"{source}: {len(tokens)} tokens are too few for one sample of sequence length "
                f"{sequence_length} (needs {sequence_length + 1}): use a shorter sequence or more text"
            )

    @property
    def num_tokens(self) -> int:
        """Number of tokens in the stream (including end-of-document tokens)."""
        return len(self.tokens)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        """Return sample ``i`` as a LongTensor of ``sequence_length + 1`` tokens."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        start = i * self.sequence_length
        return torch.from_numpy(self.tokens[start:start + self.sequence_length + 1].astype(np.int64))


def pack_documents(documents: Sequence[str], tokenizer: Tokenizer) -> np.ndarray:
    """Every document tokenized and followed by ``tokenizer.eod_id``, concatenated (int32)."""
    eod = np.array([tokenizer.eod_id], dtype=np.int32)
    pieces = []
    for doc in documents:
        pieces += [tokenizer.encode_array(doc), eod]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


class PackedDataset(TokenWindows):
    """All documents tokenized, each followed by ``eod_id``, concatenated in memory; samples as
    in :class:`TokenWindows`."""

    def __init__(self, documents: Sequence[str], tokenizer: Tokenizer, sequence_length: int,
                 source: str = "documents"):
        self.eod_id = tokenizer.eod_id
        super().__init__(pack_documents(documents, tokenizer), sequence_length, source)


def build_builtin_datasets(
    tokenizer: Tokenizer,
    sequence_length: int,
    val_fraction: float,
    documents: Optional[Sequence[str]] = None,
) -> tuple[PackedDataset, PackedDataset]:
    """Build ``(train, validation)`` packed with ``tokenizer``.

    ``documents`` defaults to the built-in corpus; the validation set is the held-out tail of
    every document (see :func:`split_train_val`). Deterministic: same inputs, same datasets.
    """
    docs = load_builtin_documents() if documents is None else list(documents)
    train_docs, val_docs = split_train_val(docs, val_fraction)
    train = PackedDataset(train_docs, tokenizer, sequence_length, "built-in corpus (train)")
    val = PackedDataset(val_docs, tokenizer, sequence_length, "built-in corpus (validation)")
    return train, val
