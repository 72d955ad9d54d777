"""From the ``data`` config group to datasets: one builder and one start-up check per ``data.name``.

This is the config layer of the data: the modules it calls raise plain errors about files and
sizes, and the checks here add the ``data.*`` / ``tokens.*`` keys a user sets to fix them.

``build_datasets(cfg)`` is what every rank calls; ``check_data(cfg, tokenizer)`` runs once before
any process group and turns every bad-data case it can see from the files into one clear error.
"""

from __future__ import annotations

import logging
from typing import Any

from .blend import ConcatDataset
from .hf_dataset import (build_hf_datasets, few_documents, load_hf_dataset, read_texts, split_few_documents,
                         validation_period)
from .nanoset import Nanoset, NanosetError, open_nanoset
from .packed import build_builtin_datasets
from .tokenizer import Tokenizer, build_tokenizer

log = logging.getLogger("nanoexp")


class DataError(ValueError):
    """Training data that cannot be used with this config; the message names the file or key."""


def _validation_samples(cfg: Any):
    """Validation samples evaluation reads (None: all), so a stream is read no further than needed."""
    t = cfg.tokens
    return t.limit_val_batches * t.global_batch_size if t.limit_val_batches else None


# -- builtin ---------------------------------------------------------------------------------------
def _build_builtin(cfg: Any, tokenizer: Tokenizer):
    return build_builtin_datasets(tokenizer, cfg.tokens.sequence_length, cfg.data.validation_fraction)


# -- nanoset ---------------------------------------------------------------------------------------
def _build_nanoset(cfg: Any, tokenizer: Tokenizer):
    d, seq = cfg.data, cfg.tokens.sequence_length
    train = [Nanoset(f, seq, "train", d.validation_fraction) for f in d.dataset_folder]
    val = [Nanoset(f, seq, "validation", d.validation_fraction) for f in d.dataset_folder]
    return ConcatDataset(train, d.dataset_weights), ConcatDataset(val)


def _check_nanoset(cfg: Any, tokenizer: Tokenizer) -> None:
    vocab = cfg.model.model_config.vocab_size
    for folder in cfg.data.dataset_folder:
        try:
            _, _, meta = open_nanoset(folder)
        except NanosetError as error:
            raise DataError(f"data.dataset_folder: {error}") from None
        where = f"{folder}/metadata.json"
        if meta["vocab_size"] > vocab:
            raise DataError(f"{where}: vocab_size {meta['vocab_size']} exceeds model.model_config.vocab_size={vocab}")
        if (meta["vocab_size"], meta["eod_id"]) != (tokenizer.vocab_size, tokenizer.eod_id):
            raise DataError(f"{where}: made with tokenizer {meta['tokenizer']!r} (vocab {meta['vocab_size']}, "
                            f"eod {meta['eod_id']}) but tokenizer.tokenizer_name_or_path="
                            f"{cfg.tokenizer.tokenizer_name_or_path} has vocab {tokenizer.vocab_size}, "
                            f"eod {tokenizer.eod_id}")
        if meta["tokenizer"] != tokenizer.name:
            log.warning("%s: made with tokenizer %r, training with %r (same vocabulary and eod id)",
                        where, meta["tokenizer"], tokenizer.name)
    try:
        train, val = _build_nanoset(cfg, tokenizer)
    except ValueError as error:   # a folder too small for one sample, a weight too small to be read
        raise DataError(f"data.dataset_folder={list(cfg.data.dataset_folder)}, data.dataset_weights="
                        f"{cfg.data.dataset_weights}, tokens.sequence_length={cfg.tokens.sequence_length}: "
                        f"{error}") from None
    if len(train) < cfg.tokens.global_batch_size:
        raise DataError(f"data.dataset_folder={list(cfg.data.dataset_folder)}: {len(train)} training samples of "
                        f"{cfg.tokens.sequence_length + 1} tokens, fewer than one global batch "
                        f"({cfg.tokens.global_batch_size}); use more data or a shorter tokens.sequence_length")


# -- hf --------------------------------------------------------------------------------------------
def _build_hf(cfg: Any, tokenizer: Tokenizer):
    d = cfg.data
    train, val = build_hf_datasets(d.hf_dataset_or_datasets, d.hf_dataset_splits, d.hf_dataset_config_name,
                                   d.text_column_name, d.streaming, tokenizer, cfg.tokens.sequence_length,
                                   d.validation_fraction, _validation_samples(cfg))
    if not d.streaming and len(train) < cfg.tokens.global_batch_size:
        raise DataError(f"data.hf_dataset_or_datasets={d.hf_dataset_or_datasets}: {len(train)} training samples, "
                        f"fewer than one global batch ({cfg.tokens.global_batch_size})")
    return train, val


def _check_hf(cfg: Any, tokenizer: Tokenizer) -> None:
    """Open the dataset as a stream (cheap) and read its first documents: the path, split and
    text column must be right and the text non-empty."""
    d = cfg.data
    try:
        ds = load_hf_dataset(d.hf_dataset_or_datasets, d.hf_dataset_splits, d.hf_dataset_config_name, streaming=True)
        first = next(read_texts(ds, d.text_column_name, d.hf_dataset_or_datasets), [])
    except (FileNotFoundError, ValueError) as error:
        raise DataError(f"data.hf_dataset_or_datasets={d.hf_dataset_or_datasets}: {error}") from None
    except KeyError as error:   # a split or a column that is not there
        raise DataError(f"data.hf_dataset_or_datasets={d.hf_dataset_or_datasets}: {error.args[0]} "
                        f"(data.hf_dataset_splits={d.hf_dataset_splits}, data.text_column_name="
                        f"{d.text_column_name})") from None
    if not any(first):
        raise DataError(f"data.hf_dataset_or_datasets={d.hf_dataset_or_datasets}: the dataset is empty "
                        f"(no text in column {d.text_column_name!r})")
    _check_few_documents(cfg, tokenizer)


def _check_few_documents(cfg: Any, tokenizer: Tokenizer) -> None:
    """A dataset of fewer documents than the held-out rule's period (one text file) is split by each document's tail
    (hf_dataset.split_few_documents): both parts are counted here, since they are small, so that text too short
    for a global batch, or a held-out tail too short for one sample, stops the run before its folder is made."""
    d, t = cfg.data, cfg.tokens
    ds = load_hf_dataset(d.hf_dataset_or_datasets, d.hf_dataset_splits, d.hf_dataset_config_name, streaming=True)
    documents = few_documents(ds, d.text_column_name, d.hf_dataset_or_datasets,
                              validation_period(d.validation_fraction))
    if documents is None:
        return
    train, val = split_few_documents(documents, tokenizer, d.validation_fraction)
    train_samples, val_samples = (len(train) - 1) // t.sequence_length, (len(val) - 1) // t.sequence_length
    if train_samples < t.global_batch_size or val_samples < 1:
        raise DataError(f"data.hf_dataset_or_datasets={d.hf_dataset_or_datasets}: {len(documents)} document(s) of "
                        f"{len(train) + len(val):,} tokens give {train_samples} training samples (one global batch "
                        f"needs {t.global_batch_size}) and {val_samples} held-out (the last "
                        f"data.validation_fraction={d.validation_fraction} of each document; one needed) of "
                        f"tokens.sequence_length={t.sequence_length} + 1 tokens: use more text, a shorter "
                        "tokens.sequence_length or a smaller tokens.global_batch_size")


# data.name -> (builder, start-up check); the shipped built-in corpus needs no check.
SOURCES = {"builtin": (_build_builtin, None),
           "nanoset": (_build_nanoset, _check_nanoset),
           "hf": (_build_hf, _check_hf)}


def build_datasets(cfg: Any):
    """``(train, validation, tokenizer)`` for ``cfg.data.name``. The train set's sample order
    comes from :func:`nanoexp.data.sampler.sample_order_for`; the validation set has a length."""
    tokenizer = build_tokenizer(cfg.tokenizer.tokenizer_name_or_path)
    train, val = SOURCES[cfg.data.name][0](cfg, tokenizer)
    return train, val, tokenizer


def check_data(cfg: Any, tokenizer: Tokenizer) -> None:
    """Every check of the data files against the config, before training; raises :class:`DataError`
    (or :class:`nanoexp.data.nanoset.NanosetError`) naming the file."""
    check = SOURCES[cfg.data.name][1]
    if check is not None:
        check(cfg, tokenizer)
