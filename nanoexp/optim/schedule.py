"""The learning rate of each optimizer step: warm-up, a hold at the peak, then the decay to its floor; and the
rate set on each parameter group (times the group's µP `lr_scale`)."""
from __future__ import annotations

import math


def min_decay_lr(cfg) -> float:
    """The rate the decay ends at: optimizer.learning_rate_scheduler.min_decay_lr, or half the peak if null."""
    s = cfg.optimizer.learning_rate_scheduler
    return s.min_decay_lr if s.min_decay_lr is not None else 0.5 * s.learning_rate


def lr_at(step: int, cfg) -> float:
    """The learning rate used by the update of optimizer step `step` (the first step is 1)."""
    s = cfg.optimizer.learning_rate_scheduler
    peak, warmup = s.learning_rate, s.lr_warmup_steps
    if step <= warmup:
        return peak * step / warmup if s.lr_warmup_style == "linear" else peak
    # After warm-up the rate holds at the peak until lr_decay_starting_step (nanotron's), then decays.
    start = warmup if s.lr_decay_starting_step is None else s.lr_decay_starting_step
    decay_steps = s.lr_decay_steps or max(cfg.tokens.train_steps - start, 1)
    progress = min(max(step - start, 0) / decay_steps, 1.0)
    floor = min_decay_lr(cfg)
    if s.lr_decay_style == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if s.lr_decay_style == "linear":
        return peak - (peak - floor) * progress
    return peak


def set_lr(optimizer, lr: float) -> None:
    """Every group trains at the scheduled `lr` times its lr_scale (µP: 1/m for hidden matrices)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
