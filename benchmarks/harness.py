"""What several benchmarks share: the checked config of a set of overrides, the matmul peak MFU is measured
against, and rounds of peer cases taken in turns."""
from __future__ import annotations

import os
from typing import Iterator, Sequence, TypeVar

import torch
from omegaconf import OmegaConf

from nanoexp.config import compose as compose_config, normalize
from nanoexp.observe.peak import Peak, gpu_table_peak, measure_cpu_peak
from nanoexp.parallel.layout import Layout
from nanoexp.validation import validate

Case = TypeVar("Case")


def compose(overrides: Sequence[str], world_size: int | None = None, plain: bool = False):
    """The config `python train.py <overrides>` runs with (nanoexp.config.compose), normalized and validated for
    `world_size` processes (default: its layout's); with `plain`, resolved into a plain copy that pickles, for
    the workers a benchmark starts."""
    cfg = compose_config(overrides)
    normalize(cfg)
    validate(cfg, world_size=Layout.from_config(cfg).world_size if world_size is None else world_size)
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)) if plain else cfg


def matmul_peak(dtype: str = "float32", threads: int | None = None, device: str | None = None) -> Peak:
    """One device's matmul peak as nanoexp.observe.peak knows it (`device` default: CUDA when there is one): on
    CUDA one GPU's datasheet figure; on CPU this node's 2048² matmuls now on `threads` threads (default: every
    core), best of a few. A busy machine reads low, so a benchmark that measures several times keeps the highest."""
    if (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda":
        return Peak(*gpu_table_peak(torch.device("cuda"), dtype))
    return measure_cpu_peak(dtype, threads or os.cpu_count() or 1, max_size=2048, min_seconds=float("inf"),
                            budget_s=float("inf"))


def in_turns(cases: Sequence[Case], rounds: int, alternate: bool = True) -> Iterator[tuple[int, Case]]:
    """(round, case) for `rounds` rounds of every case, so that background load hits all cases alike; with
    `alternate` every other round runs them in reverse order, so that none always runs first."""
    for i in range(rounds):
        yield from ((i, case) for case in (cases[::-1] if alternate and i % 2 else cases))
