"""Data-pipeline throughput: preprocessing tokens/s with 1 vs several workers, and random-access
reads of training samples from a Nanoset (memory-mapped) vs the same samples in a `datasets` Arrow table.

    python benchmarks/bench_data.py --documents 20000 --workers 2 --tokenizer bpe

Everything is generated in a temporary folder (synthetic documents, a BPE tokenizer trained on
them when ``--tokenizer bpe``); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from nanoexp.data.nanoset import Nanoset
from nanoexp.data.preprocess import preprocess


def synthetic_documents(n: int, seed: int = 0) -> list[str]:
    """Zipf-distributed words from a 5000-word vocabulary, 50-800 words per document."""
    rng = np.random.default_rng(seed)
    vocab = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=int(rng.integers(2, 9))))
             for _ in range(5000)]
    docs = []
    for _ in range(n):
        ids = np.minimum(rng.zipf(1.3, size=int(rng.integers(50, 800))), len(vocab)) - 1
        docs.append(" ".join(vocab[i] for i in ids))
    return docs


def train_bpe(docs: list[str], folder: str) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(docs[:2000], trainers.BpeTrainer(vocab_size=4096, special_tokens=["<unk>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>").save_pretrained(folder)
    return folder


def read_rate(read, num_samples: int, reads: int, seed: int = 0) -> float:
    """Samples per second for ``reads`` uniformly random sample indices."""
    idx = np.random.default_rng(seed).integers(0, num_samples, size=reads)
    read(int(idx[0]))   # warm the first page / table
    t0 = time.perf_counter()
    for i in idx:
        read(int(i))
    return reads / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tokenizer", default="bpe", help="bpe (trained here) or byte")
    parser.add_argument("--sequence-length", type=int, default=1024)
    parser.add_argument("--reads", type=int, default=20000)
    args = parser.parse_args()
    import datasets

    results: dict = {"documents": args.documents, "cpu_count": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        docs = synthetic_documents(args.documents)
        src = os.path.join(tmp, "docs.jsonl")
        with open(src, "w") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        tok = train_bpe(docs, os.path.join(tmp, "tok")) if args.tokenizer == "bpe" else "byte"
        for workers in sorted({1, args.workers}):
            meta = preprocess([src], os.path.join(tmp, f"nanoset{workers}"), tok, workers=workers, progress=False)
            results[f"preprocess_tokens_per_sec_workers{workers}"] = round(meta["tokens_per_sec"])
            results["num_tokens"] = meta["num_tokens"]
        L = args.sequence_length
        nanoset = Nanoset(os.path.join(tmp, "nanoset1"), L)
        results["num_samples"] = len(nanoset)
        results["nanoset_random_samples_per_sec"] = round(read_rate(nanoset.__getitem__, len(nanoset), args.reads))
        # The same samples (L + 1 tokens each) as rows of a memory-mapped Arrow table.
        rows = np.stack([nanoset.tokens[i * L:i * L + L + 1].astype(np.int32) for i in range(len(nanoset))])
        datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(os.path.join(tmp, "arrow"))
        table = datasets.load_from_disk(os.path.join(tmp, "arrow")).with_format("numpy")
        results["arrow_random_samples_per_sec"] = round(
            read_rate(lambda i: table[i]["input_ids"], len(table), args.reads))
    for key, value in results.items():
        print(f"{key:40s} {value:,}" if isinstance(value, int) else f"{key:40s} {value}")


if __name__ == "__main__":
    main()
