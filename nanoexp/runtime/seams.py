"""The trainer's seams. What watches or disturbs the training loop wraps the phase methods it needs on the trainer
(the instance, not the class), once at start-up and only when it is on, so that the loop itself holds nothing of
it: the stall watchdog's heartbeat marks (here), the robustness tests' faults (nanoexp/launch/fault_injection.py)
and the health checks (nanoexp/health/). The stop signals reach the loop as `StopSignals`, handed in by the entry
point (nanoexp/run.py gives nanoexp/launch/signals.py's), so that the runtime imports nothing of launch/.

The pipeline engine and its mailbox mark their own actions in the heartbeat (nanoexp/parallel/pipeline/): those
marks say which micro-batch a pipeline rank runs or waits for, which no phase of the trainer can.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanoexp.instruments.heartbeat import HEARTBEAT

# A phase and the mark that says a rank has begun it: where the stall diagnosis places a collective it posted.
MARKS = {"forward_backward": "forward and backward", "sync_gradients": "gradient sync",
         "all_reduce_loss": "loss all-reduce", "clip_gradients": "gradient norm", "read_scalars": "stop-signal check",
         "optimizer_step": "optimizer step", "evaluate": "evaluation",
         "memory_of_every_rank": "end of training"}
# Phases that may run long without a mark (the disk, the harness preparing its tasks): the watchdog waits for them.
LONG_PHASES = {"save_checkpoint": "checkpoint save", "finish_checkpoint_write": "checkpoint write",
               "run_downstream": "downstream evaluation"}


@dataclass(frozen=True)
class StopSignals:
    """How the loop hears of a stop signal (SIGTERM, SIGUSR2, Ctrl-C); the default hears none (a trainer built
    outside a run: tests, benchmarks)."""
    training_started: Callable[[], None] = lambda: None   # from here on a signal ends the run after a step
    requested: Callable[[], bool] = lambda: False         # whether this process received one
    received_name: Callable[[], str | None] = lambda: None   # which ("SIGUSR2"), None when none came


def agreed_flags(ctx, flags: list[bool], maxima: torch.Tensor) -> torch.Tensor:
    """[1 if flag i is true on any rank, else 0, for each of `flags`, then `maxima` (on the device), maximum over
    the ranks], on the device: one all-reduce (a collective: call it on all ranks)."""
    agreed = torch.zeros(len(flags), device=ctx.device)
    for i, raised in enumerate(flags):
        if raised:
            agreed[i] = 1.0   # a fill on the device: no copy from the host, no wait for it
    if maxima.numel():
        agreed = torch.cat([agreed, maxima.float()])
    if ctx.world_size > 1:
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return agreed


def wrap_method(obj, name: str, around: Callable) -> None:
    """Replace method `name` of `obj`, on the instance, by one that returns `around(original, *args, **kwargs)`."""
    original = getattr(obj, name)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        return around(original, *args, **kwargs)
    setattr(obj, name, wrapped)


def marked(where: str) -> Callable:
    def around(original, *args, **kwargs):
        HEARTBEAT.at(where)
        return original(*args, **kwargs)
    return around


def long_phase(name: str) -> Callable:
    def around(original, *args, **kwargs):
        with HEARTBEAT.long_phase(name):
            return original(*args, **kwargs)
    return around


def mark_phases(trainer) -> None:
    """Mark each phase of `trainer` in the heartbeat as it begins. A step starts by reading its batch; the first
    one is a long phase (warm-up: allocations, compilation), and each later one's time feeds the watchdog's
    automatic limit."""
    first_step = trainer.resume.step + 1

    def run_step(original, step: int) -> bool:
        HEARTBEAT.at("reading the batch", step=step)
        stopped = original(step)
        if step > first_step:
            HEARTBEAT.step_took(trainer.reporter.step_times[-1])
        return stopped

    def train_step(original, micro_batches: list[dict], lr: float):
        with HEARTBEAT.long_phase("first step") if trainer.step == first_step else nullcontext():
            return original(micro_batches, lr)

    wrap_method(trainer, "run_step", run_step)
    wrap_method(trainer, "train_step", train_step)
    for name, where in MARKS.items():
        wrap_method(trainer, name, marked(where))
    for name, what in LONG_PHASES.items():
        wrap_method(trainer, name, long_phase(what))
