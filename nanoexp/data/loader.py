"""Turning sample indices into micro-batch tensors, with background prefetch."""

from __future__ import annotations

import queue
import threading
import time
from typing import Iterator, Optional

import torch

from .packed import PackedDataset
from .sampler import GlobalBatchSampler, shard_for_dp, split_micro_batches

Batch = dict[str, torch.Tensor]


def collate(dataset: PackedDataset, indices: list[int]) -> Batch:
    """Stack samples into ``{"input_ids", "labels"}``, each LongTensor[len(indices), sequence_length]."""
    samples = torch.stack([dataset[i] for i in indices])
    return {"input_ids": samples[:, :-1].contiguous(), "labels": samples[:, 1:].contiguous()}


def _build_step(dataset: PackedDataset, sampler: GlobalBatchSampler, start: int,
                dp_rank: int, dp_size: int, micro_batch_size: int) -> list[Batch]:
    global_indices = sampler.indices(start, sampler.global_batch_size)
    mine = shard_for_dp(global_indices, dp_rank, dp_size)
    return [collate(dataset, mb) for mb in split_micro_batches(mine, micro_batch_size)]


def _produce(out: queue.Queue, stop: threading.Event, dataset: PackedDataset, sampler: GlobalBatchSampler,
             start: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> None:
    """Prefetch loop: put ("ok", step batches) for successive steps until ``stop`` is set."""
    while not stop.is_set():
        try:
            item = ("ok", _build_step(dataset, sampler, start, dp_rank, dp_size, micro_batch_size))
        except Exception as exc:  # hand the error to the training thread instead of dying silently
            item = ("error", exc)
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                break
            except queue.Full:
                continue
        if item[0] == "error":
            return
        start += sampler.global_batch_size


class TrainBatches:
    """The training micro-batches of one data-parallel rank, one optimizer step at a time.

    Every rank builds the same global batch from :class:`GlobalBatchSampler` and keeps its own
    contiguous share, so the data seen by a step does not depend on the dp/micro-batch layout.
    With ``prefetch`` a daemon thread prepares upcoming steps while the current one trains.
    """

    _QUEUE_SIZE = 2

    def __init__(self, dataset: PackedDataset, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int, consumed_samples: int = 0, prefetch: bool = True):
        if global_batch_size % (micro_batch_size * dp_size) != 0:
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by "
                             f"micro_batch_size * dp = {micro_batch_size} * {dp_size}")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.sampler = GlobalBatchSampler(len(dataset), global_batch_size, seed)
        self.consumed_samples = consumed_samples
        self.last_wait_sec = 0.0  # seconds the last next_step() spent waiting for data
        self._queue: Optional[queue.Queue] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if prefetch:
            self._queue = queue.Queue(maxsize=self._QUEUE_SIZE)
            # The thread gets no reference to self, so an unclosed loader can still be collected
            # (__del__ then stops the thread). It also gets its own sampler: no shared cache.
            sampler = GlobalBatchSampler(len(dataset), global_batch_size, seed)
            args = (self._queue, self._stop, dataset, sampler, consumed_samples, dp_rank, dp_size, micro_batch_size)
            self._thread = threading.Thread(target=_produce, args=args, name="nanoexp-prefetch", daemon=True)
            self._thread.start()

    def next_step(self) -> list[Batch]:
        """Return this rank's micro-batches for the next optimizer step and advance
        ``consumed_samples`` by ``global_batch_size`` (the samples of all ranks together)."""
        if self._stop.is_set():
            raise RuntimeError("TrainBatches is closed")
        t0 = time.perf_counter()
        if self._queue is None:
            batches = _build_step(self.dataset, self.sampler, self.consumed_samples,
                                  self.dp_rank, self.dp_size, self.micro_batch_size)
        else:
            kind, payload = self._queue.get()
            if kind == "error":
                raise RuntimeError("data prefetch thread failed") from payload
            batches = payload
        self.last_wait_sec = time.perf_counter() - t0
        self.consumed_samples += self.global_batch_size
        return batches

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint needs to resume the exact sample order: ``{"consumed_samples": n}``."""
        return {"consumed_samples": self.consumed_samples}

    def close(self) -> None:
        """Stop the prefetch thread (if any); safe to call more than once."""
        self._stop.set()
        if self._thread is not None:
            while True:  # drain so a producer blocked on put() can see the stop flag
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "TrainBatches":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def eval_batches(dataset: PackedDataset, micro_batch_size: int, limit_batches: Optional[int],
                 dp_rank: int, dp_size: int) -> Iterator[Batch]:
    """Yield this rank's validation micro-batches, in a fixed order (no shuffling).

    Together, all ranks cover the first ``limit_batches * micro_batch_size * dp_size`` samples
    (or every full round of ``micro_batch_size * dp_size`` samples if ``limit_batches`` is
    None or 0); round ``b`` gives rank ``r`` samples ``(b*dp + r)*mbs ..``. Every rank yields
    the same number of batches, which may be zero for a tiny validation set.
    """
    per_round = micro_batch_size * dp_size
    rounds = len(dataset) // per_round
    if limit_batches:
        rounds = min(rounds, limit_batches)
    for b in range(rounds):
        start = (b * dp_size + dp_rank) * micro_batch_size
        yield collate(dataset, list(range(start, start + micro_batch_size)))
