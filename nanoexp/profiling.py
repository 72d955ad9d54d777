"""Looking inside a training step: a torch.profiler trace on request, and saved-activation bytes.

* `StepProfiler` (config `logging.profiler`): a `torch.profiler` schedule of `wait` idle
  steps, `warmup` steps traced but dropped, then `active` recorded steps, once. The trace is
  written as Chrome-trace JSON into `<run folder>/profiler/rank<r>.<...>.pt.trace.json`
  (one per rank), which Perfetto (ui.perfetto.dev) opens directly and TensorBoard's profiler
  plugin reads from that folder. Disabled, it does nothing and costs nothing.
* `saved_activation_bytes`: how many bytes autograd keeps for backward while a forward runs
  (what activation recomputation saves), measured with `saved_tensors_hooks`.
"""
from __future__ import annotations

import contextlib
import os

import torch


class StepProfiler:
    """Call `step()` after every optimizer step and `close()` at the end of training."""

    def __init__(self, profiler_cfg, run_dir: str, rank: int):
        self.profile = None
        if not profiler_cfg.enabled:
            return
        self.trace_dir = os.path.join(run_dir, "profiler")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profile = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=profiler_cfg.wait, warmup=profiler_cfg.warmup,
                                             active=profiler_cfg.active, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.trace_dir, worker_name=f"rank{rank}"),
            record_shapes=profiler_cfg.record_shapes, with_stack=False)
        self.profile.start()

    def step(self) -> None:
        if self.profile is not None:
            self.profile.step()

    def close(self) -> None:
        """Stop profiling; a run shorter than the schedule still writes what was recorded."""
        if self.profile is not None:
            self.profile.stop()
            self.profile = None


class _ByteCounter:
    def __init__(self):
        self.bytes = 0


@contextlib.contextmanager
def saved_activation_bytes(params):
    """Count the bytes of distinct storages that autograd saves for backward inside the block,
    leaving out the parameters' own storages (weights are kept anyway; only activations count).

        with saved_activation_bytes(model.parameters()) as saved:
            loss = model(...)
        saved.bytes   # activations held until backward

    Under activation recomputation (torch.utils.checkpoint, non-reentrant) only what the
    checkpoints keep is seen: the inner recomputed tensors are saved by checkpoint's own hooks.
    """
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    seen: set[int] = set()
    counter = _ByteCounter()

    def pack(tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in param_storages and ptr not in seen and storage.nbytes() > 0:
            seen.add(ptr)
            counter.bytes += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield counter
