"""The built-in corpus and the train/validation split of documents.

Note: ``nanoexp/data/corpus/`` (a data folder, not a package) holds the shipped file;
this module is what ``import nanoexp.data.corpus`` finds.
"""

from __future__ import annotations

import functools
import json
import lzma
from pathlib import Path

BUILTIN_CORPUS = Path(__file__).resolve().parent / "corpus" / "shakespeare.jsonl.xz"


@functools.lru_cache(maxsize=1)
def _load_records() -> tuple[tuple[str, str, str], ...]:
    with lzma.open(BUILTIN_CORPUS, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return tuple((r["id"], r["title"], r["text"]) for r in rows)


def load_builtin_titles() -> list[str]:
    """Titles of the built-in works, in the same order as :func:`load_builtin_documents`."""
    return [title for _, title, _ in _load_records()]


def load_builtin_documents() -> list[str]:
    """Return the built-in Shakespeare corpus: one string per work (42 works), in a fixed order."""
    return [text for _, _, text in _load_records()]


def split_train_val(documents: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Split every document into a train head and a held-out validation tail.

    The last ``val_fraction`` of each document's characters (moved forward to the next
    line start, so no line is cut in two) becomes one validation document; the rest is
    one train document. Train and validation text therefore never overlap, every work
    is represented in both, and the result is deterministic (no randomness needed).
    Documents whose tail would be empty contribute to train only.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction}: must be in [0, 1)")
    train, val = [], []
    for doc in documents:
        cut = len(doc) - int(len(doc) * val_fraction)
        if cut < len(doc):
            newline = doc.find("\n", cut)
            # Start the tail at a line boundary when there is one.
            cut = newline + 1 if newline != -1 and newline + 1 < len(doc) else cut
        head, tail = doc[:cut], doc[cut:]
        if head:
            train.append(head)
        if tail:
            val.append(tail)
    return train, val
