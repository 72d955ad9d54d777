"""Turning sample indices into micro-batch tensors, with background prefetch."""

from __future__ import annotations

import queue
import threading
import time
from typing import Optional

import torch

from .sampler import sample_order_for, shard_for_dp, split_micro_batches

Batch = dict[str, torch.Tensor]
IGNORE_INDEX = -100   # a target the loss skips: padding, and (later) masked tokens


def document_positions(input_ids: torch.Tensor, eod_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position_ids, document_ids)`` of packed samples [b, s]: a document starts at the start of the sample
    and after every ``eod_id`` (which ends the document it closes); positions count from 0 in each document."""
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == eod_id
    index = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    first = torch.where(starts, index, 0).cummax(dim=1).values   # where each token's document starts
    return index - first, starts.long().cumsum(dim=1)


def with_documents(batch: Batch, eod_id: Optional[int]) -> Batch:
    """Add ``position_ids`` and ``document_ids`` (model.attention_mask=document; None: the batch unchanged)."""
    if eod_id is not None:
        batch["position_ids"], batch["document_ids"] = document_positions(batch["input_ids"], eod_id)
    return batch


def collate(dataset, indices: list[int], eod_id: Optional[int] = None) -> Batch:
    """Stack samples into ``{"input_ids", "labels"}``, each LongTensor[len(indices), sequence_length]; with
    ``eod_id`` also their documents (:func:`document_positions`)."""
    samples = torch.stack([dataset[i] for i in indices])
    return with_documents({"input_ids": samples[:, :-1].contiguous(), "labels": samples[:, 1:].contiguous()}, eod_id)


def collate_padded(dataset, indices: list[int], sequence_length: int, eod_id: Optional[int] = None) -> Batch:
    """As :func:`collate`, with indices past the end of ``dataset`` as padding rows: input id 0 and
    every label ``IGNORE_INDEX``, so they count in no loss."""
    real = [i for i in indices if i < len(dataset)]
    pad = len(indices) - len(real)
    ids = torch.zeros(pad, sequence_length, dtype=torch.long)
    batch = {"input_ids": ids, "labels": torch.full_like(ids, IGNORE_INDEX)}
    if real:
        samples = collate(dataset, real)
        batch = {key: torch.cat([samples[key], batch[key]]) for key in batch}
    return with_documents(batch, eod_id)


def _build_step(dataset, order, start: int, global_batch_size: int, dp_rank: int, dp_size: int,
                micro_batch_size: int, eod_id: Optional[int] = None, pin: bool = False) -> list[Batch]:
    """One step's micro-batches; with `pin`, in page-locked memory, so that their copies to the GPU run
    asynchronously (StepRunner.prepare copies with non_blocking=True)."""
    global_indices = order.indices(start, global_batch_size)
    mine = shard_for_dp(global_indices, dp_rank, dp_size)
    batches = [collate(dataset, mb, eod_id) for mb in split_micro_batches(mine, micro_batch_size)]
    return [{key: value.pin_memory() for key, value in b.items()} for b in batches] if pin else batches


def _produce(out: queue.Queue, stop: threading.Event, dataset, order, start: int, global_batch_size: int,
             dp_rank: int, dp_size: int, micro_batch_size: int, eod_id: Optional[int], pin: bool) -> None:
    """Prefetch loop: put ("ok", step batches) for successive steps until ``stop`` is set."""
    while not stop.is_set():
        try:
            item = ("ok", _build_step(dataset, order, start, global_batch_size, dp_rank, dp_size, micro_batch_size,
                                      eod_id, pin))
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
    then the only reader of ``dataset`` (a stream is read by one thread). With ``eod_id`` the
    micro-batches also carry their documents (model.attention_mask=document).
    """

    _QUEUE_SIZE = 2

    def __init__(self, dataset, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, seed: int, consumed_samples: int = 0, prefetch: bool = True,
                 eod_id: Optional[int] = None, pin_memory: bool = False):
        if global_batch_size % (micro_batch_size * dp_size) != 0:
            raise ValueError(f"a global batch of {global_batch_size} is not divisible by "
                             f"micro-batch x dp = {micro_batch_size} x {dp_size}")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.eod_id, self.pin_memory = eod_id, pin_memory
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
                    dp_rank, dp_size, micro_batch_size, eod_id, pin_memory)
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
                                  self.dp_rank, self.dp_size, self.micro_batch_size, self.eod_id, self.pin_memory)
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
                 dp_rank: int, dp_size: int, sequence_length: int, eod_id: Optional[int] = None) -> list[Batch]:
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
        batches += [collate_padded(dataset, indices, sequence_length, eod_id)
                    for indices in split_micro_batches(mine, micro_batch_size)]
    return batches
