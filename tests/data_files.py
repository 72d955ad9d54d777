"""Tiny data files for the data tests, written into a test's tmp_path (nothing is downloaded)."""
from __future__ import annotations

import json

import numpy as np

WORDS = ["to", "be", "or", "not", "café", "naïve", "—", "🙂", "king", "queen\n", "the", "question"]


def random_documents(n: int, seed: int = 0, max_words: int = 40) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, max_words)))) for _ in range(n)]


def write_jsonl(path, documents: list[str], key: str = "text") -> str:
    with open(path, "w", encoding="utf-8") as f:
        for i, doc in enumerate(documents):
            f.write(json.dumps({key: doc, "id": i}, ensure_ascii=False) + "\n")
    return str(path)


def byte_stream(documents: list[str]) -> list[int]:
    """The reference token stream of the byte tokenizer: UTF-8 bytes, 256 after each document."""
    out: list[int] = []
    for doc in documents:
        out += list(doc.encode("utf-8")) + [256]
    return out
