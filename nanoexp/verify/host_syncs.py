"""Counting where the host would wait for the GPU, on any device: the calls that read a tensor's value on the
host (`.item()`, `.tolist()`, `bool()`, `int()`, `float()`), and the ops whose output size depends on the data
(`nonzero`, boolean indexing's `masked_select`, `unique`, `bincount`, `repeat_interleave` without `output_size`),
each of which makes the host wait for the device to finish what it queued. On CPU nothing waits, but the same
calls are made, so a CPU test counts what a GPU step would stall on. Never used in training.

    with HostSyncCounter() as syncs:
        ...                      # a training step
    syncs.count, syncs.by_site   # {"nanoexp/model/moe.py:133 __init__ tolist": 16, ...}
"""
from __future__ import annotations

import os
import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
         torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy}
DATA_DEPENDENT = {torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select, torch.unique,
                  torch.Tensor.unique, torch.bincount, torch.Tensor.bincount, torch.argwhere}
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _is_host_wait(func, args, kwargs) -> bool:
    if func in READS or func in DATA_DEPENDENT:
        return True
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):   # tensor repeats need the output size
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return torch.is_tensor(repeats) and kwargs.get("output_size") is None
    if func is torch.Tensor.__getitem__:   # boolean-mask indexing: the size depends on the mask
        index = args[1]
        indices = index if isinstance(index, tuple) else (index,)
        return any(torch.is_tensor(i) and i.dtype == torch.bool for i in indices)
    return False


class HostSyncCounter(TorchFunctionMode):
    """A torch function mode counting the host waits nanoexp's own lines make inside it, by line."""

    def __init__(self):
        super().__init__()
        self.by_site: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_host_wait(func, args, kwargs):
            caller = traceback.extract_stack(limit=2)[0]   # the line that made this call
            if caller.filename.startswith(PACKAGE):   # torch's own (AdamW's step counters live on the host) aside
                where = os.path.relpath(caller.filename, os.path.dirname(PACKAGE))
                self.by_site[f"{where}:{caller.lineno} {caller.name} {getattr(func, '__name__', func)}"] += 1
        return func(*args, **kwargs)

    @property
    def count(self) -> int:
        return sum(self.by_site.values())


class _CountOneStep:
    """Counts the host waits of optimizer step `step`, from its start to the next one's (around the trainer's
    run_step phase)."""

    def __init__(self, step: int):
        self.step, self.counter = step, HostSyncCounter()

    def run_step(self, original, step: int) -> bool:
        if step == self.step:
            self.counter.__enter__()
        elif step == self.step + 1:
            self.counter.__exit__(None, None, None)
        return original(step)


def host_waits_of_a_step(cfg, ctx, run_dir: str, step: int = 3) -> HostSyncCounter:
    """The host waits of training step `step` (its batch, forward, backward, gradient sync, norm, scalars, update,
    logging) in a run of cfg.tokens.train_steps > `step` steps without evaluation or checkpoints due then."""
    from nanoexp.runtime.seams import wrap_method
    from nanoexp.runtime.trainer import Trainer
    trainer, counting = Trainer(cfg, ctx, run_dir), _CountOneStep(step)
    wrap_method(trainer, "run_step", counting.run_step)
    trainer.train()
    return counting.counter
