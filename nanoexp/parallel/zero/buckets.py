"""Gradient buckets: consecutive parameters grouped up to a size, what one collective moves (the units of engine.py)."""
from __future__ import annotations

from torch import nn


def bucket_full(params: list[nn.Parameter], p: nn.Parameter, cap_mb: float) -> bool:
    """Whether adding `p` takes a bucket of float32 `params` past cap_mb."""
    return sum(q.numel() for q in params) + p.numel() > max(1, int(cap_mb * 2**20) // 4)


def size_buckets(params: list[nn.Parameter], cap_mb: float) -> list[list[nn.Parameter]]:
    """Consecutive parameters in buckets of about `cap_mb` (a parameter larger than that alone)."""
    buckets = [[]]
    for p in params:
        if buckets[-1] and bucket_full(buckets[-1], p, cap_mb):
            buckets.append([])
        buckets[-1].append(p)
    return [bucket for bucket in buckets if bucket]
