"""Deliberate faults for the robustness tests (`fault_injection.*`, all off by default), wrapped around
a trainer from outside, so that the trainer reads as the training loop alone."""
from __future__ import annotations

import logging
import time

log = logging.getLogger("nanoexp")


def inject_faults(trainer, faults) -> None:
    """`faults.hang_at_step`: rank `faults.hang_rank` stops answering before that step, as a stuck GPU
    or host would. `faults.nonfinite_loss_at_step`: the loss of that step becomes NaN on the loss stage.
    `faults.slow_step_s`: every step starts that much later, as on a slow host (a signal sent after a
    step then arrives well before the end of training, however fast the machine)."""
    if faults.slow_step_s > 0:
        step_now = trainer.run_step

        def slow_step(step: int) -> bool:
            time.sleep(faults.slow_step_s)
            return step_now(step)

        trainer.run_step = slow_step
    if faults.hang_at_step is not None and trainer.ctx.rank == faults.hang_rank:
        run_step = trainer.run_step

        def hang_then_run(step: int) -> bool:
            if step == faults.hang_at_step:
                log.warning("fault injection: rank %d hangs at step %d", trainer.ctx.rank, step)
                time.sleep(3600)
            return run_step(step)

        trainer.run_step = hang_then_run
    if faults.nonfinite_loss_at_step is not None:
        forward_step = trainer.forward_step

        def nan_loss(micro_batch, hidden_states, chunk=0, **kwargs):
            out = forward_step(micro_batch, hidden_states, chunk, **kwargs)
            if trainer.step == faults.nonfinite_loss_at_step and trainer.model.has_head(chunk):
                return out * float("nan")
            return out

        trainer.forward_step = nan_loss
