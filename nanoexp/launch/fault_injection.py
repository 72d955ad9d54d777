"""Deliberate faults for the robustness tests (`fault_injection.*`, all off by default), entering through the
trainer's hooks (TrainerHooks), so that the trainer reads as the training loop alone."""
from __future__ import annotations

import logging
import time

from nanoexp.runtime.trainer import TrainerHooks

log = logging.getLogger("nanoexp")


class FaultInjection(TrainerHooks):
    """`faults.slow_step_s`: every step starts that much later, as on a slow host (a signal sent after a step
    then arrives well before the end of training, however fast the machine). `faults.hang_at_step`: rank
    `faults.hang_rank` stops answering before that step, as a stuck GPU or host would.
    `faults.nonfinite_loss_at_step`: the training loss of that step becomes NaN on the loss stage."""

    def __init__(self, faults, rank: int):
        self.faults, self.rank = faults, rank

    def before_step(self, step: int) -> None:
        if self.faults.hang_at_step == step and self.rank == self.faults.hang_rank:
            log.warning("fault injection: rank %d hangs at step %d", self.rank, step)
            time.sleep(3600)
        if self.faults.slow_step_s > 0:
            time.sleep(self.faults.slow_step_s)

    def training_loss(self, step: int, loss):
        return loss * float("nan") if step == self.faults.nonfinite_loss_at_step else loss
