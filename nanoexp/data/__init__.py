"""Data pipeline: built-in corpus, tokenizers, packing, the global sample order and loaders.

Typical use from config values::

    train_ds, val_ds, tok = build_datasets(cfg.tokenizer.tokenizer_name_or_path,
                                           cfg.tokens.sequence_length, cfg.data.validation_fraction)
    batches = TrainBatches(train_ds, global_batch_size, micro_batch_size, dp_rank, dp_size,
                           seed=cfg.general.seed, consumed_samples=0, prefetch=cfg.data.prefetch)
"""

from .corpus import load_builtin_documents, load_builtin_titles, split_train_val
from .loader import TrainBatches, collate, eval_batches
from .packed import PackedDataset, build_datasets
from .sampler import GlobalBatchSampler, shard_for_dp, split_micro_batches
from .tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

__all__ = [
    "ByteTokenizer", "HFTokenizer", "build_tokenizer",
    "load_builtin_documents", "load_builtin_titles", "split_train_val",
    "PackedDataset", "build_datasets",
    "GlobalBatchSampler", "shard_for_dp", "split_micro_batches",
    "TrainBatches", "collate", "eval_batches",
]
