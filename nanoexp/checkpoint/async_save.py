"""Checkpoints written in the background (checkpoint.async_save=true).

At a save the training thread copies this rank's part of the checkpoint into host memory (HostCopies) and starts a
thread that writes it (BackgroundWrite); training goes on. Publication (meta.json, the rename, latest.txt: save.py's
`publish`, a collective) happens in the training thread at a point every rank reaches together, once every rank's
write has ended: the step whose agreed flags say no rank is still writing (the trainer folds this rank's
`writing` into the step's stop-signal all-reduce), the next save (at most one save is in flight), the end of
training, a stop signal, or a failure every rank raises together. The writer thread runs no collective, so the
collectives of training and of publication keep one order on every rank (as NCCL needs). A process killed while a
write is in flight leaves a `.tmp-<step>/` folder and the previous checkpoint as latest.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from nanoexp.checkpoint.save import Shard, prepare_folder, publish, take_shard, write_shard


class HostCopies:
    """The host copies of the tensors a rank saves, taken in the training thread right after the optimizer step.
    On the CPU a clone. On CUDA a pinned buffer per tensor, reused from save to save (a save starts only once the
    previous write has ended, so no buffer is refilled while it is read), filled by copies queued on the current
    stream after the step's kernels, so the training thread does not wait for them; the writer does (a CUDA
    event) before it reads them. What later writes these tensors is ordered after the copies: kernels of the same
    stream, and collectives, whose NCCL stream waits for the current stream's work when they are issued."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}
        self.devices: set[torch.device] = set()

    def __call__(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.device.type != "cuda":
            return tensor.clone(memory_format=torch.contiguous_format)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self.buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        buffer.copy_(tensor, non_blocking=True)
        self.devices.add(tensor.device)
        return buffer

    def arrival(self):
        """A function that returns once every copy queued so far has arrived in host memory."""
        events = [torch.cuda.current_stream(device).record_event() for device in self.devices]
        self.devices = set()
        return lambda: [event.synchronize() for event in events]


_writer = threading.local()


def in_background_writer() -> bool:
    """Whether this thread is a background checkpoint writer (not the training thread)."""
    return getattr(_writer, "active", False)


class BackgroundWrite:
    """One rank's write of checkpoint `step` in a thread; `report` (save.py's write_shard) once `done`."""

    def __init__(self, root: str, step: int, shard: Shard, rank: int, before_write=None, prepared=None):
        self.step, self.report, self.done = step, None, threading.Event()
        self.thread = threading.Thread(target=self.run, args=(root, step, shard, rank, before_write, prepared),
                                       name=f"checkpoint-{step}-writer", daemon=True)   # never holds up an exit
        self.thread.start()

    def run(self, *args) -> None:
        _writer.active = True
        try:
            self.report = write_shard(*args)
        finally:
            self.done.set()

    def join(self) -> dict:
        self.thread.join()
        return self.report


@dataclass
class InFlight:
    """A checkpoint being written: what its publication needs, and the training thread's time spent on it."""
    step: int
    write: BackgroundWrite
    meta: dict
    abandon_after: int | None
    stall_s: float


def start_save(root: str, step: int, model, optimizer, ctx, meta: dict, abandon_after: int | None,
               copies: HostCopies, before_write=None) -> InFlight:
    """A collective (the folder's preparation): snapshot this rank's state into host memory and start writing it
    in the background."""
    start = time.perf_counter()
    prepared = prepare_folder(root, step, ctx)
    shard = take_shard(model, optimizer, ctx, copies)
    shard.copied = copies.arrival()
    write = BackgroundWrite(root, step, shard, ctx.rank, before_write, prepared)
    return InFlight(step, write, meta, abandon_after, time.perf_counter() - start)


def finish_save(in_flight: InFlight, root: str, ctx, keep_last_n: int | None) -> dict:
    """A collective: wait for this rank's write, publish the checkpoint (CheckpointError on every rank if a rank's
    write failed) and return its record: the training thread's stall (snapshot, waiting, publication), the longest
    rank's write."""
    start = time.perf_counter()
    report = in_flight.write.join()
    waited = time.perf_counter() - start
    write_s = publish(root, in_flight.step, report, ctx, in_flight.meta, keep_last_n, in_flight.abandon_after)
    stall = in_flight.stall_s + time.perf_counter() - start
    return {"step": in_flight.step, "checkpoint/stall_sec": stall, "checkpoint/write_sec": write_s,
            "checkpoint/wait_sec": waited, "checkpoint/background": True}
