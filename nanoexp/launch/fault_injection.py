"""Deliberate faults for the robustness tests (`fault_injection.*`, all off by default). Each wraps the trainer's
phase it strikes in (nanoexp/runtime/seams.py), installed at start-up only when it is set, so that the trainer reads
as the training loop alone."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time

import torch

from nanoexp.checkpoint.async_save import in_background_writer
from nanoexp.runtime.seams import wrap_method

log = logging.getLogger("nanoexp")

FAULT_STEP = 3   # the step at which the one-off desync faults strike (after two good steps)
HOLD_LIMIT_S = 120.0   # the longest hold_checkpoint_write keeps a write back


class FaultInjection:
    """`slow_step_s`: every step starts that much later, as on a slow host (a signal sent after a step then arrives
    well before the end of training, however fast the machine). `slow_start_up_s`: every rank's start-up ends that
    much later (a signal sent a few seconds in then lands in the start-up, however fast the machine).
    `hang_at_step`: rank `hang_rank` stops answering before that step, as a stuck GPU or host would.
    `nonfinite_loss_at_step`: the training loss of that step becomes NaN on the loss stage. The desync faults of the
    stall watchdog's tests, each on one rank: `stall_rank` sleeps `stall_s` in its compute at `stall_at_step` (with
    `stall_holds_interpreter`, holding Python's interpreter lock, so that none of its threads runs either);
    `sigstop_rank` stops itself there (SIGSTOP: the whole process, the store that rank 0 hosts included, as a
    debugger or `kill -STOP` would); at step 3, `skip_collective_rank` skips the loss all-reduce, `wrong_shape_rank`
    posts it with two elements instead of one, `short_pipeline_rank` runs one micro-batch too few, `raise_rank`
    raises. `kill_group`: that replica group's rank 0 is killed (SIGKILL, as a lost host) in its compute at
    `kill_at_step` (fault_tolerance), once per run folder.
    The checkpoint's and the health checks' faults: `install`."""

    def __init__(self, faults, rank: int):
        self.faults, self.rank = faults, rank
        self.step_begun, self.current_step = threading.Condition(), 0

    def install(self, trainer) -> None:
        """Wrap the phases of `trainer` that the faults set strike in; none when every fault is off. Besides the
        class docstring's: `slow_checkpoint_s`: rank 0 sleeps inside each checkpoint write (in the background writer
        under checkpoint.async_save). `hold_checkpoint_write`: rank 0's background write of step S's checkpoint waits
        until step S + that many has begun, so that it is in flight while those steps train however fast the machine
        (at most HOLD_LIMIT_S: a run that ends sooner waits that long). The health checks' faults (nanoexp/health/):
        `slow_rank` sleeps `slow_rank_s` in each micro-batch's forward; the batch step `spike_at_step` reads in a
        fresh run has its loss (and gradients) x 10, wherever a run reads it; `flip_gradient_rank` flips one bit of
        its first parameter's gradient once at `flip_gradient_step`."""
        f, self.trainer = self.faults, trainer
        wanted = {"train": f.slow_start_up_s > 0,
                  "run_step": f.hang_at_step is not None or f.slow_step_s > 0 or f.hold_checkpoint_write,
                  "forward_backward": any(rank is not None for rank in (f.stall_rank, f.sigstop_rank, f.raise_rank,
                                                                         f.short_pipeline_rank, f.kill_group)),
                  "all_reduce_loss": f.skip_collective_rank is not None or f.wrong_shape_rank is not None}
        for name in [name for name, on in wanted.items() if on]:
            wrap_method(trainer, name, getattr(self, name))
        if f.slow_checkpoint_s > 0 or f.hold_checkpoint_write:   # inside the write, in the writer's thread if any
            wrap_method(trainer.checkpoints, "save", self.save)
        if f.nonfinite_loss_at_step is not None or f.spike_at_step is not None:   # the loss stage's denominator:
            wrap_method(trainer.runner, "loss_denominator", self.loss_denominator)   # its losses and gradients
        if f.slow_rank == self.rank:
            wrap_method(trainer.runner, "forward", self.slow_forward)
        if f.flip_gradient_rank == self.rank:
            self.flip_a_gradient_bit(trainer)

    def train(self, original):
        time.sleep(self.faults.slow_start_up_s)   # before the run's first step, as a slow start-up
        return original()

    def run_step(self, original, step: int) -> bool:
        with self.step_begun:
            self.current_step = step
            self.step_begun.notify_all()
        if self.faults.hang_at_step == step and self.rank == self.faults.hang_rank:
            log.warning("fault injection: rank %d hangs at step %d", self.rank, step)
            time.sleep(3600)
        if self.faults.slow_step_s > 0:
            time.sleep(self.faults.slow_step_s)
        return original(step)

    def forward_backward(self, original, micro_batches: list[dict]) -> list[torch.Tensor]:
        f, step = self.faults, self.trainer.step
        if self.rank == f.stall_rank and step == f.stall_at_step:
            log.warning("fault injection: rank %d sleeps %g s in its compute at step %d", self.rank, f.stall_s, step)
            if f.stall_holds_interpreter:   # as a C call that never releases the lock: the rank's threads stop too
                ctypes.PyDLL(None).sleep(int(f.stall_s))
            else:
                time.sleep(f.stall_s)
        if self.rank == f.sigstop_rank and step == f.stall_at_step:
            log.warning("fault injection: rank %d stops itself (SIGSTOP) in its compute at step %d", self.rank, step)
            os.kill(os.getpid(), signal.SIGSTOP)
        if f.kill_group is not None and f.kill_group == trainer_group(self.trainer) and self.rank == 0 \
                and step == f.kill_at_step:
            self.kill_once(step)
        if step == FAULT_STEP and self.rank == f.raise_rank:
            raise RuntimeError(f"fault injection: rank {self.rank} raises at step {step}")
        if step == FAULT_STEP and self.rank == f.short_pipeline_rank:
            log.warning("fault injection: rank %d runs step %d with one micro-batch too few", self.rank, step)
            micro_batches = micro_batches[:-1]
        return original(micro_batches)

    def kill_once(self, step: int) -> None:
        """SIGKILL this process, once per run folder (a restarted group that reaches the step again trains on)."""
        marker = os.path.join(self.trainer.run_dir, "fault_injection_killed")
        if os.path.exists(marker):
            return
        open(marker, "w").close()
        log.warning("fault injection: replica group %d's rank 0 is killed (SIGKILL) at step %d",
                    self.faults.kill_group, step)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)

    def all_reduce_loss(self, original, loss: torch.Tensor) -> torch.Tensor:
        step = self.trainer.step
        if step == FAULT_STEP and self.rank == self.faults.skip_collective_rank:
            log.warning("fault injection: rank %d skips the loss all-reduce of step %d", self.rank, step)
            return loss
        if step == FAULT_STEP and self.rank == self.faults.wrong_shape_rank:
            log.warning("fault injection: rank %d posts the loss all-reduce of step %d with shape [2]", self.rank, step)
            return original(torch.stack([loss, torch.zeros_like(loss)]))
        return original(loss)

    def save(self, original, step: int, *args, **kwargs) -> None:
        return original(step, *args, before_write=lambda: self.during_checkpoint(step), **kwargs)

    def during_checkpoint(self, step: int) -> None:
        if self.rank == 0 and self.faults.slow_checkpoint_s > 0:
            time.sleep(self.faults.slow_checkpoint_s)
        hold = self.faults.hold_checkpoint_write
        if self.rank == 0 and hold and in_background_writer():   # in the training thread it would wait for itself
            with self.step_begun:
                if not self.step_begun.wait_for(lambda: self.current_step >= step + hold, timeout=HOLD_LIMIT_S):
                    log.warning("fault injection: step %d never began; checkpoint %d is written", step + hold, step)

    def loss_denominator(self, original, micro_batches: list[dict]) -> torch.Tensor:
        denominator, trainer = original(micro_batches), self.trainer
        if trainer.step == self.faults.nonfinite_loss_at_step:
            return denominator * float("nan")
        spike = self.faults.spike_at_step   # the batch of that step in a fresh run: where it is read now
        if spike is not None and trainer.batches.consumed_samples == spike * trainer.global_batch:
            log.warning("fault injection: the batch of samples %d-%d (step %d) spikes: its loss x 10",
                        (spike - 1) * trainer.global_batch, spike * trainer.global_batch - 1, trainer.step)
            return denominator / 10
        return denominator

    def slow_forward(self, original, *args, **kwargs):
        time.sleep(self.faults.slow_rank_s)   # a slow rank's compute: a throttled GPU, a busy host
        return original(*args, **kwargs)

    def flip_a_gradient_bit(self, trainer) -> None:
        """At flip_gradient_step, once, flip bit 20 (a mantissa bit) of the first element of this rank's first
        parameter's gradient, as silent data corruption would: in one backward of the step only."""
        name, param = next((n, p) for n, p in trainer.model.named_parameters() if p.requires_grad)
        flipped = set()

        def flip(grad: torch.Tensor) -> torch.Tensor:
            step = trainer.step
            if step != self.faults.flip_gradient_step or step in flipped:
                return grad
            flipped.add(step)
            log.warning("fault injection: rank %d flips bit 20 of %s's gradient at step %d", self.rank, name, step)
            grad = grad.clone()
            grad.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 20)
            return grad
        param.register_hook(flip)


def trainer_group(trainer) -> int | None:
    """The replica group a trainer trains in (fault_tolerance.group), or None."""
    return trainer.cfg.fault_tolerance.get("group")
