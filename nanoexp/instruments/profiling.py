"""Looking inside a training step: a torch.profiler trace on request (config `logging.profiler`).

`StepProfiler` runs a `torch.profiler` schedule of `wait` idle steps, `warmup` steps traced but
dropped, then `active` recorded steps, once. The trace is written as Chrome-trace JSON into
`<run folder>/profiler/rank<r>.<...>.pt.trace.json` (one per rank), which Perfetto
(ui.perfetto.dev) opens directly and TensorBoard's profiler plugin reads from that folder.
Disabled, it does nothing and costs nothing.
"""
from __future__ import annotations

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
