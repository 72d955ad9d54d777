"""Deliberate faults for the robustness tests (`fault_injection.*`, all off by default), entering through the
trainer's hooks (TrainerHooks), so that the trainer reads as the training loop alone."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time

import torch

from nanoexp.checkpoint.async_save import in_background_writer
from nanoexp.runtime.trainer import TrainerHooks

log = logging.getLogger("nanoexp")

FAULT_STEP = 3   # the step at which the one-off desync faults strike (after two good steps)
HOLD_LIMIT_S = 120.0   # the longest hold_checkpoint_write keeps a write back


class FaultInjection(TrainerHooks):
    """`slow_step_s`: every step starts that much later, as on a slow host (a signal sent after a step then arrives
    well before the end of training, however fast the machine). `slow_start_up_s`: every rank's start-up ends that
    much later (a signal sent a few seconds in then lands in the start-up, however fast the machine). `hang_at_step`: rank `hang_rank` stops answering
    before that step, as a stuck GPU or host would. `nonfinite_loss_at_step`: the training loss of that step
    becomes NaN on the loss stage. The desync faults of the stall watchdog's tests, each on one rank:
    `stall_rank` sleeps `stall_s` in its compute at `stall_at_step` (with `stall_holds_interpreter`, holding Python's
    interpreter lock, so that none of its threads runs either); `sigstop_rank` stops itself there (SIGSTOP: the whole
    process, the store that rank 0 hosts included, as a debugger or `kill -STOP` would); at step 3,
    `skip_collective_rank` skips the loss all-reduce, `wrong_shape_rank` posts it with two elements instead of one,
    `short_pipeline_rank` runs one micro-batch too few, `raise_rank` raises. `slow_checkpoint_s`: rank 0 sleeps
    inside each checkpoint write (in the background writer under checkpoint.async_save). `hold_checkpoint_write`:
    rank 0's background write of step S's checkpoint waits until step S + that many has begun, so that it is in
    flight while those steps train however fast the machine (at most HOLD_LIMIT_S: a run that ends sooner
    waits that long)."""

    def __init__(self, faults, rank: int):
        self.faults, self.rank = faults, rank
        self.step_begun, self.current_step = threading.Condition(), 0

    def end_of_start_up(self) -> None:
        if self.faults.slow_start_up_s > 0:
            time.sleep(self.faults.slow_start_up_s)

    def before_step(self, step: int) -> None:
        with self.step_begun:
            self.current_step = step
            self.step_begun.notify_all()
        if self.faults.hang_at_step == step and self.rank == self.faults.hang_rank:
            log.warning("fault injection: rank %d hangs at step %d", self.rank, step)
            time.sleep(3600)
        if self.faults.slow_step_s > 0:
            time.sleep(self.faults.slow_step_s)

    def before_compute(self, step: int, micro_batches: list[dict]) -> list[dict]:
        f = self.faults
        if self.rank == f.stall_rank and step == f.stall_at_step:
            log.warning("fault injection: rank %d sleeps %g s in its compute at step %d", self.rank, f.stall_s, step)
            if f.stall_holds_interpreter:   # as a C call that never releases the lock: the rank's threads stop too
                ctypes.PyDLL(None).sleep(int(f.stall_s))
            else:
                time.sleep(f.stall_s)
        if self.rank == f.sigstop_rank and step == f.stall_at_step:
            log.warning("fault injection: rank %d stops itself (SIGSTOP) in its compute at step %d", self.rank, step)
            os.kill(os.getpid(), signal.SIGSTOP)
        if step != FAULT_STEP:
            return micro_batches
        if self.rank == f.raise_rank:
            raise RuntimeError(f"fault injection: rank {self.rank} raises at step {step}")
        if self.rank == f.short_pipeline_rank:
            log.warning("fault injection: rank %d runs step %d with one micro-batch too few", self.rank, step)
            return micro_batches[:-1]
        return micro_batches

    def loss_to_reduce(self, step: int, loss: torch.Tensor) -> torch.Tensor | None:
        if step == FAULT_STEP and self.rank == self.faults.skip_collective_rank:
            log.warning("fault injection: rank %d skips the loss all-reduce of step %d", self.rank, step)
            return None
        if step == FAULT_STEP and self.rank == self.faults.wrong_shape_rank:
            log.warning("fault injection: rank %d posts the loss all-reduce of step %d with shape [2]", self.rank, step)
            return torch.stack([loss, torch.zeros_like(loss)])
        return loss

    def during_checkpoint(self, step: int) -> None:
        if self.rank == 0 and self.faults.slow_checkpoint_s > 0:
            time.sleep(self.faults.slow_checkpoint_s)
        hold = self.faults.hold_checkpoint_write
        if self.rank == 0 and hold and in_background_writer():   # in the training thread it would wait for itself
            with self.step_begun:
                if not self.step_begun.wait_for(lambda: self.current_step >= step + hold, timeout=HOLD_LIMIT_S):
                    log.warning("fault injection: step %d never began; checkpoint %d is written", step + hold, step)

    def training_loss(self, step: int, loss):
        return loss * float("nan") if step == self.faults.nonfinite_loss_at_step else loss
