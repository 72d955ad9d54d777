"""Turning sample indices into micro-batch tensors, with background prefetch."""

from __future__ import annotations

import queue
import threading
import time
from typing import Iterator, Optional

import torch

from .sampler import sample_order_for, shard_for_dp, split_micro_batches

Batch = dict[str, torch.Tensor]
IGNORE_INDEX = -100   # a target the loss skips: padding, and (later) masked tokens


def collate(dataset, indices: list[int]) -> Batch:
    """Stack samples into ``{"input_ids", "labels"}``, each LongTensor[len(indices), sequence_length]."""
    samples = torch.stack([dataset[i] for i in indices])
    return {"input_ids": samples[:, :-1].contiguous(), "labels": samples[:, 1:].contiguous()}


def collate_padded(dataset, indices: list[int], sequence_length: int) -> Batch:
    """As :func:`collate`, with indices past the end of ``dataset`` as padding rows: input id 0 and
    every label ``IGNORE_INDEX``, so they count in no loss."""
    real = [i for i in indices if i < len(dataset)]
    pad = len(indices) - len(real)
    ids = torch.zeros(pad, sequence_length, dtype=torch.long)
    padding = {"input_ids": ids, "labels": torch.full_like(ids, IGNORE_INDEX)}
    if not real:
        return padding
    batch = collate(dataset, real)
    return {key: torch.cat([batch[key], padding[key]]) for key in batch}


def _build_step(dataset, order, start: int, global_batch_size: int,
                dp_rank: int, dp_size: int, micro_batch_size: int) -> list[Batch]:
    global_indices = order.indices(start, global_batch_size)
    mine = shard_for_dp(global_indices, dp_rank, dp_size)
    return [collate(dataset, mb) for mb in split_micro_batches(mine, micro_batch_size)]


def _produce(out: queue.Queue, stop: threading.Event, dataset, order, start: int, global_batch_size: int,
             dp_rank: int, dp_size: int, micro_batch_size: int) -> None:
    """Prefetch loop: put ("ok", step batches) for successive steps until ``stop`` is set."""
    while not stop.is_set():
        try:
            item = ("ok", _build_step(dataset, order, start, global_batch_size, dp_rank, dp_size, micro_batch_size))
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
        start += global_batch_size


class TrainBatches:
    """The training micro-batches of one data-parallel rank, one optimizer step at a time.

    Every rank builds the same global batch from the dataset's sample order (see
    :func:`sample_order_for`) and keeps its own contiguous share, so the data seen by a step does
    not depend on the dp/micro-batch layout; tp/pp peers (same dp rank) get the same micro-batches.
    With ``prefetch`` a daemon thread prepares upcoming steps while the current one trains; it is
    then the only reader of ``dataset`` (a stream is read by one thread).
    """

    _QUEUE_SIZE = 2

    def __init__(self, dataset, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int, consumed_samples: int = 0, prefetch: bool = True):
        if global_batch_size % (micro_batch_size * dp_size) != 0:
            raise ValueError(f"a global batch of {global_batch_size} is not divisible by "
                             f"micro-batch x dp = {micro_batch_size} x {dp_size}")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.sampler = sample_order_for(dataset, global_batch_size, seed)
        self.consumed_samples = consumed_samples
        self.last_wait_sec = 0.0  # seconds the last next_step() spent waiting for data
        self._queue: Optional[queue.Queue] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if prefetch:
            self._queue = queue.Queue(maxsize=self._QUEUE_SIZE)
            # The thread gets no reference to self, so an unclosed loader can still be collected
            # (__del__ then stops the thread). It also gets its own order: no shared cache.
            order = sample_order_for(dataset, global_batch_size, seed)
            args = (self._queue, self._stop, dataset, order, consumed_samples, global_batch_size,
                    dp_rank, dp_size, micro_batch_size)
            self._thread = threading.Thread(target=_produce, args=args, name="nanoexp-prefetch", daemon=True)
            self._thread.start()

    def next_step(self) -> list[Batch]:
        """Return this rank's micro-batches for the next optimizer step and advance
        ``consumed_samples`` by ``global_batch_size`` (the samples of all ranks together)."""
        if self._stop.is_set():
            raise RuntimeError("TrainBatches is closed")
        t0 = time.perf_counter()
        if self._queue is None:
            batches = _build_step(self.dataset, self.sampler, self.consumed_samples, self.global_batch_size,
                                  self.dp_rank, self.dp_size, self.micro_batch_size)
        else:
            kind, payload = self._queue.get()
            if kind == "error":
                raise RuntimeError("data prefetch thread failed") from payload
            batches = payload
        self.last_wait_sec = time.perf_counter() - t0
        self.consumed_samples += self.global_batch_size
        return batches

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


def eval_rounds(num_samples: int, global_batch_size: int, limit_batches: Optional[int]) -> int:
    """Global batches one evaluation reads: every held-out sample (the last batch padded), or the
    first ``limit_batches`` batches of them."""
    rounds = -(-num_samples // global_batch_size)
    return min(rounds, limit_batches) if limit_batches else rounds


def eval_batches(dataset, global_batch_size: int, micro_batch_size: int, limit_batches: Optional[int],
                 dp_rank: int, dp_size: int, sequence_length: int) -> list[Batch]:
    """This rank's validation micro-batches, in a fixed order (no shuffling).

    The held-out set is read in global batches of the training size, so the samples evaluated do
    not depend on the layout: round ``b`` covers positions ``b*G .. (b+1)*G`` and rank ``r`` takes
    its contiguous ``G/dp`` share, as in training. Positions past the end of the set (the last
    round of a set that is not a multiple of G, or of one smaller than G) are padding rows whose
    labels are ``IGNORE_INDEX``: every held-out sample is evaluated and nothing else counts.
    """
    batches = []
    for b in range(eval_rounds(len(dataset), global_batch_size, limit_batches)):
        mine = shard_for_dp(list(range(b * global_batch_size, (b + 1) * global_batch_size)), dp_rank, dp_size)
        batches += [collate_padded(dataset, indices, sequence_length)
                    for indices in split_micro_batches(mine, micro_batch_size)]
    return batches
