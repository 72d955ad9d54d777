"""Data pipeline: tokenizers, the built-in corpus, Nanosets, Hugging Face datasets, blending,
the global sample order and loaders.

Typical use from a config::

    train_ds, val_ds, tok = build_datasets(cfg)        # cfg.data.name: builtin | nanoset | hf
    batches = TrainBatches(train_ds, global_batch_size, micro_batch_size, dp_rank, dp_size,
                           seed=cfg.general.seed, consumed_samples=0, prefetch=cfg.data.prefetch)
"""

from .blend import BlendedOrder, ConcatDataset
from .corpus import load_builtin_documents, load_builtin_titles, split_train_val
from .hf_dataset import TokenStream, build_hf_datasets, load_hf_dataset
from .loader import TrainBatches, collate, eval_batches
from .nanoset import Nanoset, NanosetError, NanosetWriter, open_nanoset
from .packed import PackedDataset, TokenWindows, build_builtin_datasets
from .sampler import GlobalBatchSampler, SequentialOrder, sample_order_for, shard_for_dp, split_micro_batches
from .sources import DataError, build_datasets, check_data
from .tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer
