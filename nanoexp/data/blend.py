"""Several datasets read as one: concatenation, and a weighted, seed-driven blended sample order."""

from __future__ import annotations

import bisect
from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np
import torch

from nanoexp.data.sampler import read_periodic


class ConcatDataset:
    """Samples of several datasets one after another: index ``offsets[d] + i`` is ``datasets[d][i]``.

    With ``weights`` it also defines its training order (:meth:`sample_order`), a
    :class:`BlendedOrder` that reads dataset ``d`` for a fraction ``weights[d]`` of the samples.
    """

    def __init__(self, datasets: Sequence, weights: Optional[Sequence[float]] = None):
        if not datasets:
            raise ValueError("ConcatDataset needs at least one dataset")
        self.datasets = list(datasets)
        self.sizes = [len(d) for d in self.datasets]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).tolist()
        self.weights = None if weights is None else list(weights)

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        d = bisect.bisect_right(self.offsets, i) - 1
        return self.datasets[d][i - self.offsets[d]]

    def sample_order(self, seed: int) -> "BlendedOrder":
        """The training order over this concatenation (equal weights when none were given)."""
        return BlendedOrder(self.sizes, self.weights or [1.0] * len(self.sizes), seed)


def block_counts(weights: Sequence[float], block_size: int) -> np.ndarray:
    """Samples per dataset in one block: ``weights * block_size`` (normalised), rounded by largest
    remainder so they sum to ``block_size``."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * block_size
    counts = np.floor(exact).astype(np.int64)
    short = block_size - counts.sum()
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


class BlendedOrder:
    """Global position -> index into a :class:`ConcatDataset`, blending datasets by weight.

    Positions are cut into blocks of ``block_size``. Every block gives dataset ``d`` exactly
    ``block_counts(weights)[d]`` positions, in a seeded random arrangement, so after ``b`` blocks
    each dataset's share equals its weight up to the rounding of one block (< 1/block_size).
    The ``j``-th sample drawn from dataset ``d`` is ``perm(d, j // N_d)[j % N_d]``: every dataset
    is shuffled per epoch and starts a new epoch when exhausted, independently of the others.
    Everything depends only on (sizes, weights, seed, position), so any window of positions can
    be produced directly: resuming needs only the number of consumed samples.
    """

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], seed: int, block_size: int = 4096):
        if len(sizes) != len(weights) or not sizes:
            raise ValueError(f"{len(sizes)} datasets but {len(weights)} weights")
        if any(n < 1 for n in sizes) or any(w <= 0 for w in weights):
            raise ValueError(f"sizes {list(sizes)} and weights {list(weights)} must all be positive")
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        self.seed, self.block_size = seed, block_size
        self.counts = block_counts(weights, block_size)
        if np.any(self.counts == 0):
            raise ValueError(f"weights {list(weights)}: a weight below 1/{block_size} of the total would never be read")
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._perms: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def _permutation(self, d: int, epoch: int) -> np.ndarray:
        key = (d, epoch)
        if key not in self._perms:
            self._perms[key] = np.random.default_rng([self.seed, d, epoch]).permutation(self.sizes[d])
            if len(self._perms) > 2 * len(self.sizes):   # a window touches at most two epochs per dataset
                self._perms.popitem(last=False)
        return self._perms[key]

    def _block(self, b: int) -> np.ndarray:
        """Concatenation indices of the ``block_size`` positions of block ``b``."""
        if b in self._blocks:
            return self._blocks[b]
        owners = np.repeat(np.arange(len(self.sizes)), self.counts)
        owners = np.random.default_rng([self.seed, len(self.sizes), b]).permutation(owners)
        out = np.empty(self.block_size, dtype=np.int64)
        for d in range(len(self.sizes)):
            where = np.flatnonzero(owners == d)
            draws = b * self.counts[d] + np.arange(len(where))   # how many samples d gave before
            epochs, within = np.divmod(draws, self.sizes[d])
            for epoch in np.unique(epochs):
                sel = epochs == epoch
                out[where[sel]] = self.offsets[d] + self._permutation(d, int(epoch))[within[sel]]
        self._blocks[b] = out
        if len(self._blocks) > 2:
            self._blocks.popitem(last=False)
        return out

    def indices(self, start: int, count: int) -> list[int]:
        """Concatenation indices at global positions ``start .. start + count - 1``."""
        return read_periodic(start, count, self.block_size, self._block)
