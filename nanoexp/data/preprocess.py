"""Text -> Nanoset, tokenized in parallel worker processes (the body of ``scripts/preprocess_data.py``).

Documents are read in stored order, cut into batches, tokenized by a pool of workers and written
back in the same order, so the output does not depend on the number of workers.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Optional, Sequence

import numpy as np

from .hf_dataset import load_hf_dataset, read_texts
from .nanoset import NanosetWriter
from .tokenizer import Tokenizer, build_tokenizer


_worker_tokenizer: Optional[Tokenizer] = None


def _init_worker(tokenizer_name: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = build_tokenizer(tokenizer_name, allow_download=True)


def _encode(texts: list[str]) -> list[np.ndarray]:
    return _worker_tokenizer.encode_batch(texts)


def preprocess(inputs: Sequence[str], output_folder: str, tokenizer_name: str = "byte", text_key: str = "text",
               workers: int = 1, overwrite: bool = False, split: str = "train", progress: bool = True) -> dict:
    """Tokenize every document of ``inputs`` into a new Nanoset at ``output_folder``; return its
    metadata plus ``seconds`` and ``tokens_per_sec``. ``inputs``: local files/folders/globs
    (json/jsonl, parquet, csv, txt) or one Hub dataset name."""
    from tqdm import tqdm

    tokenizer = build_tokenizer(tokenizer_name, allow_download=True)
    extra = {"sources": [str(i) for i in inputs], "text_key": text_key}
    source = ", ".join(map(str, inputs))
    batches = read_texts(load_hf_dataset(list(inputs), split, streaming=True), text_key, source)   # refuses a
    # missing or empty input before anything is written
    writer = NanosetWriter(output_folder, tokenizer.name, tokenizer.vocab_size, tokenizer.eod_id,
                           overwrite=overwrite, extra_metadata=extra)   # refuses an existing Nanoset
    start = time.perf_counter()
    bar = tqdm(unit="doc", desc="tokenizing", disable=not progress)
    pool = None
    if workers > 1:
        # fork is cheap and inherits nothing the workers share; a fresh tokenizer per worker.
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_name,))
        encoded = pool.imap(_encode, batches, chunksize=1)   # imap keeps the input order
    else:
        encoded = (tokenizer.encode_batch(texts) for texts in batches)
    try:
        for docs in encoded:
            writer.add(docs)
            bar.update(len(docs))
        if writer.num_tokens == len(writer.ends):   # only end-of-document ids
            raise ValueError(f"{source}: no text to tokenize ({len(writer.ends)} documents, all empty)")
        writer.close()
    except BaseException:
        writer.discard()
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    seconds = time.perf_counter() - start
    meta = dict(writer.metadata, seconds=seconds, tokens_per_sec=writer.num_tokens / max(seconds, 1e-9))
    return meta
