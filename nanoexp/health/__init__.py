"""A slow, spiking or silently wrong rank, named: stragglers (stragglers.py), loss spikes (spikes.py) and replay
checks for silent data corruption (replay.py). Each detector wraps the trainer's phases (nanoexp/runtime/seams.py),
installed at start-up by the entry point only when it is on, as the stall watchdog's marks are; the loop itself
holds none of it (docs/health.md).

What the detectors share lives here: `HealthMonitor` adds their values to the step's one all-reduce and host read
(Trainer.step_maxima, read_scalars), drops a step's update when one asks (Trainer.drop_update), and reports each
finding on rank 0: one console line, a metrics.jsonl record that TensorBoard and W&B also get as an event, and
summary.json's `health` lists.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from nanoexp.failures import KnownFailure
from nanoexp.runtime.seams import wrap_method

log = logging.getLogger("nanoexp")


@dataclass
class Finding:
    """What a detector found at `step`: its kind (straggler, spike, replay), the console line, the numbers."""
    kind: str
    step: int
    line: str
    fields: dict = field(default_factory=dict)

    def record(self) -> dict:
        """Its metrics.jsonl record: health/event names the kind, health/<field> each number or name."""
        return {"step": self.step, "health/event": self.kind, "health/message": self.line,
                **{f"health/{key}": value for key, value in self.fields.items()}}


class HealthMonitor:
    """The detectors that are on, around `trainer`'s phases. A detector gives `maxima(step)` (a tensor on the
    device, its part of the step's all-reduce; empty on most steps) and `read(step, values, loss)` (its part of
    the result, on the host, after the step's read); it may install wrappers of its own (`install(monitor)`)."""

    def __init__(self, trainer, detectors: list):
        self.trainer, self.detectors = trainer, detectors
        self.findings: list[Finding] = []
        self.sizes: list[int] = []
        self.dropping: str | None = None   # why this step's update is dropped

    def install(self) -> None:
        for name in ("step_maxima", "read_scalars", "optimizer_step", "finish"):
            wrap_method(self.trainer, name, getattr(self, name))
        for detector in self.detectors:
            detector.install(self)

    def step_maxima(self, original) -> torch.Tensor:
        parts = [detector.maxima(self.trainer.step) for detector in self.detectors]
        self.sizes = [part.numel() for part in parts]
        return torch.cat([original(), *parts])

    def read_scalars(self, original, loss, grad_norm) -> tuple[float, float]:
        self.dropping = None   # a non-finite step skips optimizer_step: nothing carries over from it
        loss, grad_norm = original(loss, grad_norm)
        values = self.trainer.maxima
        start = len(values) - sum(self.sizes)
        for detector, size in zip(self.detectors, self.sizes):
            detector.read(self.trainer.step, values[start:start + size], loss)
            start += size
        return loss, grad_norm

    def drop(self, why: str) -> None:
        """This step's update is dropped (every rank asks the same: their detectors agree)."""
        self.dropping = self.dropping or why

    def optimizer_step(self, original) -> None:
        why, self.dropping = self.dropping, None
        if why:
            self.trainer.drop_update(why)
        else:
            original()

    def stop(self, message: str) -> None:
        """Every rank stops together here (the step's checkpoint write, if any, is published first)."""
        raise self.trainer.raised_together(KnownFailure(message))

    def report(self, finding: Finding) -> None:
        """Rank 0 logs the finding and writes it into metrics.jsonl, TensorBoard and W&B."""
        self.findings.append(finding)
        trainer = self.trainer
        if trainer.is_writer:
            log.warning("step %d/%d | %s", finding.step, trainer.cfg.tokens.train_steps, finding.line)
            trainer.reporter.writer.event(finding.record(), f"health/{finding.kind}", finding.line)

    def finish(self, original, summary: dict) -> None:
        """summary.json's `health`: every finding by kind (empty lists: none)."""
        kinds = {"straggler": "stragglers", "spike": "spikes", "replay": "replay_mismatches"}
        summary["health"] = {name: [{"step": f.step, **f.fields} for f in self.findings if f.kind == kind]
                             for kind, name in kinds.items()}
        original(summary)


def install(cfg, trainer) -> HealthMonitor | None:
    """The detectors `cfg.health` turns on, wrapped around `trainer` (None when none is on)."""
    from nanoexp.config import compares_ranks
    from nanoexp.health.replay import ReplayCheck
    from nanoexp.health.spikes import Spikes
    from nanoexp.health.stragglers import Stragglers

    h = cfg.health
    detectors = ([Stragglers(h, trainer)] if compares_ranks(cfg) else []) + \
                ([Spikes(h.spike, trainer)] if h.spike.action != "off" else []) + \
                ([ReplayCheck(h, trainer)] if h.replay_every else [])
    if not detectors:
        return None
    monitor = HealthMonitor(trainer, detectors)
    monitor.install()
    return monitor
