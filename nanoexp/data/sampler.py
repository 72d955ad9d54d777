"""The global order in which training samples are consumed.

Position ``k`` (the k-th sample consumed by the whole job, counting from 0) maps to sample
``perm(k // N)[k % N]`` where ``N`` is the dataset size and ``perm(epoch)`` is a seeded
permutation. The global batch of optimizer step ``s`` is positions ``s*G .. s*G + G - 1``.
It depends only on (seed, s, G): how that batch is split over data-parallel ranks and
micro-batches never changes which samples it holds, and resuming only needs the count of
consumed samples.
"""

from __future__ import annotations

import numpy as np


def read_periodic(start: int, count: int, period: int, chunk) -> list[int]:
    """Positions ``start .. start + count - 1`` of a sequence made of consecutive chunks of length
    ``period``, where ``chunk(i)`` returns chunk i (an epoch's permutation, a blending block)."""
    out: list[int] = []
    pos, end = start, start + count
    while pos < end:
        index, offset = divmod(pos, period)
        take = min(end - pos, period - offset)
        out += chunk(index)[offset:offset + take].tolist()
        pos += take
    return out


class GlobalBatchSampler:
    """Maps global sample positions to dataset indices, reshuffling every epoch."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int):
        if num_samples < 1 or global_batch_size < 1:
            raise ValueError(f"num_samples={num_samples} and global_batch_size={global_batch_size} must be >= 1")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._cached_epoch = -1
        self._cached_perm: np.ndarray = np.zeros(0, dtype=np.int64)

    def permutation(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch``: a permutation of ``range(num_samples)`` fixed by (seed, epoch)."""
        if epoch != self._cached_epoch:
            # Seeding with the pair (seed, epoch) keeps different seeds' epochs independent.
            rng = np.random.default_rng([self.seed, epoch])
            self._cached_perm = rng.permutation(self.num_samples)
            self._cached_epoch = epoch
        return self._cached_perm

    def indices(self, start: int, count: int) -> list[int]:
        """Dataset indices at global positions ``start .. start + count - 1``."""
        return read_periodic(start, count, self.num_samples, self.permutation)

    def global_batch(self, step_index: int) -> list[int]:
        """Dataset indices of the global batch of optimizer step ``step_index`` (0-based)."""
        return self.indices(step_index * self.global_batch_size, self.global_batch_size)


class SequentialOrder:
    """Position ``k`` is sample ``k``: the order of a stream, which can only be read forwards."""

    def indices(self, start: int, count: int) -> list[int]:
        return list(range(start, start + count))


def sample_order_for(dataset, global_batch_size: int, seed: int):
    """The training order of ``dataset``: its own ``sample_order(seed)`` when it defines one (a blend
    of Nanosets, a stream), else a :class:`GlobalBatchSampler` over its samples. Either way it has
    ``indices(start, count)`` and depends only on the seed and the global position."""
    own = getattr(dataset, "sample_order", None)
    return own(seed) if own is not None else GlobalBatchSampler(len(dataset), global_batch_size, seed)


def shard_for_dp(global_indices: list[int], dp_rank: int, dp_size: int) -> list[int]:
    """The contiguous chunk of a global batch that belongs to data-parallel rank ``dp_rank``."""
    if len(global_indices) % dp_size != 0 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"cannot give rank {dp_rank} of {dp_size} an equal share of {len(global_indices)} samples")
    chunk = len(global_indices) // dp_size
    return global_indices[dp_rank * chunk:(dp_rank + 1) * chunk]


def split_micro_batches(indices: list[int], micro_batch_size: int) -> list[list[int]]:
    """Cut a rank's indices into consecutive micro-batches of ``micro_batch_size``."""
    if micro_batch_size < 1 or len(indices) % micro_batch_size != 0:
        raise ValueError(f"{len(indices)} samples do not split into micro-batches of {micro_batch_size}")
    return [indices[i:i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]
