"""Loss spikes: a step loss above the median of the last `window` steps by more than `z` robust deviations (1.4826
x the median absolute deviation, which equals the standard deviation for normal noise; at least 0.1 % of the
median, so that a flat loss does not make every rise a spike). The loss is the same on every rank, so every rank
reaches the same verdict without communicating. `action`: warn (logged, trained through), skip (the step's update
dropped, counted as a non-finite step's), rollback (every rank returns to the run's latest checkpoint and reads past
the batch that spiked, as OLMo does).

A skipped or rolled-back batch is recorded by its first sample's position in `<checkpoints>/skipped_batches.json`
(JSON: step, first_sample, samples, loss, median, action), which a resume reads: a recorded rollback is read past
again, a recorded skip dropped again, so that a resume from any checkpoint trains the same steps. After a resume
or a rollback the median needs `window` losses again before a new spike is judged.
"""
from __future__ import annotations

import json
import logging
import math
import os
import statistics
from collections import deque

import torch
import torch.distributed as dist

from nanoexp.checkpoint.manager import Start, latest_checkpoint
from nanoexp.health import Finding
from nanoexp.runtime.seams import wrap_method

log = logging.getLogger("nanoexp")

MAD_TO_SIGMA = 1.4826       # the median absolute deviation of normal noise is 1/1.4826 of its standard deviation
SMALLEST_DEVIATION = 1e-3   # x |median|: the deviation a flat loss is judged with
RECORD = "skipped_batches.json"


class Spikes:
    """The loss-spike detector of `trainer` (health.spike: `s`)."""

    def __init__(self, s, trainer):
        self.trainer, self.action, self.z, self.max_rollbacks = trainer, s.action, s.z, s.max_rollbacks
        self.losses: deque[tuple[int, float]] = deque(maxlen=s.window)   # (step, loss) of the last steps
        self.path = os.path.join(trainer.checkpoints.root, RECORD)
        self.recorded = {entry["first_sample"]: entry for entry in read_record(self.path)}
        self.recorded_skip, self.rolling_back = None, False

    def install(self, monitor) -> None:
        self.monitor = monitor
        self.watch_data()
        for name in ("run_step", "save_checkpoint", "evaluate_when_due"):
            wrap_method(self.trainer, name, getattr(self, name))

    def watch_data(self) -> None:
        wrap_method(self.trainer.batches, "next_step", self.next_step)

    def next_step(self, original):
        """The step's micro-batches, past the batches a rollback skipped; a batch recorded as skipped is marked."""
        batches = self.trainer.batches
        while self.recorded.get(batches.consumed_samples, {}).get("action") == "rollback":
            entry = self.recorded[batches.consumed_samples]
            log.info("step %d: the batch of samples %d-%d is read past (a loss spike at step %d, rolled back)",
                     batches.step, entry["first_sample"], entry["first_sample"] + entry["samples"] - 1, entry["step"])
            original()
            batches.step -= 1   # read past: the optimizer step it served is served by the next batch
        entry = self.recorded.get(batches.consumed_samples, {})
        self.recorded_skip = entry if entry.get("action") == "skip" else None
        return original()

    def maxima(self, step: int) -> torch.Tensor:
        return torch.zeros(0, device=self.trainer.ctx.device)

    def read(self, step: int, values: list[float], loss: float) -> None:
        if self.recorded_skip is not None:   # a resume passes a step skipped before: skipped again
            self.monitor.drop(f"a loss spike recorded at step {self.recorded_skip['step']} ({RECORD})")
            return
        if not math.isfinite(loss):   # the trainer's own rule (optimizer.skip_nonfinite_steps)
            return
        median, deviations = self.judge(loss)
        if deviations is None or deviations <= self.z:
            self.losses.append((step, loss))
            return
        self.spiked(step, loss, median, deviations)

    def judge(self, loss: float) -> tuple[float | None, float | None]:
        """(median of the window, robust deviations `loss` lies above it); (None, None) before the window is full."""
        if len(self.losses) < self.losses.maxlen:
            return None, None
        window = [value for _, value in self.losses]
        median = statistics.median(window)
        deviation = MAD_TO_SIGMA * statistics.median(abs(value - median) for value in window)
        return median, (loss - median) / max(deviation, SMALLEST_DEVIATION * abs(median), 1e-12)

    def spiked(self, step: int, loss: float, median: float, deviations: float) -> None:
        action, trainer = self.action, self.trainer
        first = trainer.batches.consumed_samples - trainer.global_batch   # the batch this step trained on
        found = (f"loss spike: {loss:.4f} is {deviations:.1f} robust deviations above the median {median:.4f} of "
                 f"the last {len(self.losses)} steps")
        fields = {"loss": loss, "median": median, "deviations": deviations, "action": action, "first_sample": first}
        if action == "warn":
            self.losses.append((step, loss))
            return self.monitor.report(Finding("spike", step, f"{found}: trained through (health.spike.action=warn)",
                                               fields))
        if action == "rollback" and trainer.checkpoints.last_saved is None:   # nothing to return to yet
            action = fields["action"] = "skip"
        if action == "rollback" and self.rollbacks() >= self.max_rollbacks:
            self.monitor.report(Finding("spike", step, found, fields))
            self.monitor.stop(f"step {step}: {found}; health.spike.max_rollbacks={self.max_rollbacks} rollbacks "
                              "done already: the loss keeps spiking (lower the learning rate, or allow more)")
        self.record({"step": step, "first_sample": first, "samples": trainer.global_batch, "loss": loss,
                     "median": median, "action": action})
        self.monitor.drop("a loss spike")
        self.rolling_back = action == "rollback"
        then = ("update skipped" if action == "skip" else
                f"rolling back to checkpoint {trainer.checkpoints.last_saved}; samples {first}-"
                f"{first + trainer.global_batch - 1} are read past from now on")
        self.monitor.report(Finding("spike", step, f"{found}: {then} ({RECORD})", fields))

    def rollbacks(self) -> int:
        return sum(entry["action"] == "rollback" for entry in self.recorded.values())

    def record(self, entry: dict) -> None:
        """Add `entry` to skipped_batches.json (rank 0 writes it; every rank keeps the same record)."""
        self.recorded[entry["first_sample"]] = entry
        if self.trainer.is_writer:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path + ".tmp", "w") as f:
                json.dump({"batches": sorted(self.recorded.values(), key=lambda e: e["first_sample"])}, f, indent=1)
            os.replace(self.path + ".tmp", self.path)

    # -- a rollback: after the step, instead of its checkpoint and evaluation ----------------------
    def run_step(self, original, step: int) -> bool:
        stopped = original(step)
        if self.rolling_back and not stopped:   # a stop: the resume reads the record
            self.roll_back(step)
        self.rolling_back = False
        return stopped

    def save_checkpoint(self, original, step: int, wait: bool) -> None:
        if self.rolling_back:
            log.info("step %d is not saved: the run rolls back", step)
            return None
        return original(step, wait)

    def evaluate_when_due(self, original, step: int, stage: dict) -> None:
        return None if self.rolling_back else original(step, stage)

    def roll_back(self, step: int) -> None:
        """Every rank back to the run's latest checkpoint (a collective): weights, optimizer, data, progress."""
        trainer = self.trainer
        trainer.finish_checkpoint_write("a rollback")
        folder = [latest_checkpoint(trainer.checkpoints.root)]   # rank 0's reading is every rank's
        if trainer.ctx.world_size > 1:
            dist.broadcast_object_list(folder, src=0)
        if folder[0] is None:   # a warm start's seed is not this run's: the step counts as skipped
            log.warning("step %d: no checkpoint of this run to roll back to yet: the step's update was skipped", step)
            return self.record({**self.recorded[trainer.batches.consumed_samples - trainer.global_batch],
                                "action": "skip"})
        trainer.checkpoints.start = Start(folder[0], "a rollback after a loss spike", own=True)
        trainer.resume = trainer.checkpoints.where_to_start()
        trainer.checkpoints.restore(trainer.model, trainer.optimizer)
        trainer.batches.close()
        trainer.start_data()
        self.watch_data()
        trainer.step = trainer.resume.step
        self.losses = deque(((s, loss) for s, loss in self.losses if s <= trainer.step), maxlen=self.losses.maxlen)


def read_record(path: str) -> list[dict]:
    """The batches skipped so far (skipped_batches.json; none without it)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)["batches"]
