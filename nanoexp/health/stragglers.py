"""Stragglers: a rank whose compute is slower than its peers'. One throttled GPU or noisy host sets every rank's
pace, and since the next collective evens the ranks out, the step time cannot show which: each rank's own compute
time can. A rank's compute is the wall time of its forward and backward and of its optimizer step less the time
it spends inside torch.distributed's calls and waiting for their results: a rank waiting for a slower one is not
computing (on CUDA measured on the compute stream with events, whose waits for collectives are bracketed the same
way). Every `health.every` steps (a window) each rank puts its typical compute time a step into the step's one
all-reduce (Trainer.step_maxima); rank 0 compares the ranks of each pipeline stage (they do the same work) with
their median, and names a rank slower than `straggler_factor` x that median in `straggler_windows` windows in a
row. The first step (warm-up) is not timed.
"""
from __future__ import annotations

import functools
import socket
import statistics
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from nanoexp.health import Finding
from nanoexp.runtime.seams import wrap_method

# The collectives nanoexp calls (by attribute, at each call: nanoexp/parallel/collectives.py), as this torch has them.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
               "reduce_scatter_single", "all_to_all_single", "broadcast", "batch_isend_irecv", "barrier")


class ComputeClock:
    """This rank's compute time in the sections it is told of: their wall time less the time spent in them inside
    torch.distributed's calls or in `.wait()` on their results (the outermost of nested ones). Marks are host
    times on CPU, events on the current CUDA stream on CUDA; `read()` must come after a host read that waited
    for the stream (the step's)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.open, self.depth = False, 0
        self.spans: list[tuple] = []   # (start mark, end mark, +1 for a section, -1 for a wait in one)
        self.originals: dict = {}

    def install(self) -> None:
        """Time torch.distributed's collectives (as nanoexp.verify.comm_counter wraps them) until `uninstall`."""
        for name in (name for name in COLLECTIVES if hasattr(dist, name)):
            self.originals[name] = getattr(dist, name)
            setattr(dist, name, self.timed(self.originals[name]))

    def uninstall(self) -> None:
        for name, call in self.originals.items():
            setattr(dist, name, call)
        self.originals = {}

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start

    @contextmanager
    def section(self):
        start, self.open = self.mark(), True
        try:
            yield
        finally:
            self.open = False
            self.spans.append((start, self.mark(), 1.0))

    @contextmanager
    def waiting(self):
        if not self.open or self.depth:
            yield
            return
        self.depth += 1
        start = self.mark()
        try:
            yield
        finally:
            self.depth -= 1
            self.spans.append((start, self.mark(), -1.0))

    def timed(self, call):
        @functools.wraps(call)
        def wrapped(*args, **kwargs):
            with self.waiting():
                result = call(*args, **kwargs)
            if isinstance(result, list):   # batch_isend_irecv: a work per operation (gloo) or one (NCCL)
                return [TimedWork(work, self) if isinstance(work, dist.Work) else work for work in result]
            return TimedWork(result, self) if isinstance(result, dist.Work) else result
        return wrapped

    def read(self) -> float:
        """The compute seconds of the spans since the last read."""
        total = sum(sign * self.seconds(start, end) for start, end, sign in self.spans)
        self.spans = []
        return total


class TimedWork:
    """A collective's work whose `wait()` counts as waiting; everything else is the work's own."""

    def __init__(self, work, clock: ComputeClock):
        self.work, self.clock = work, clock

    def wait(self, *args, **kwargs):
        with self.clock.waiting():
            return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


class Stragglers:
    """The straggler detector of `trainer` (health.stragglers and its keys in `h`)."""

    def __init__(self, h, trainer):
        ctx = trainer.ctx
        self.trainer, self.rank, self.world = trainer, ctx.rank, ctx.world_size
        self.every, self.factor, self.windows = h.every, h.straggler_factor, h.straggler_windows
        self.clock, self.first_step = ComputeClock(ctx.device), trainer.resume.step + 1
        self.stages: dict[int, list[int]] = {}   # pipeline stage -> its ranks
        for rank in range(self.world):
            self.stages.setdefault(ctx.layout.position(rank)[0], []).append(rank)
        self.hosts = [None] * self.world
        dist.all_gather_object(self.hosts, socket.gethostname())
        self.step_seconds: list[float] = []   # the compute of each timed step of the current window
        self.in_a_row = [0] * self.world    # windows in a row each rank was slow

    def install(self, monitor) -> None:
        self.monitor = monitor
        self.clock.install()
        for name in ("forward_backward", "optimizer_step"):
            wrap_method(self.trainer, name, self.timed)
        wrap_method(self.trainer, "train", self.train)

    def train(self, original):
        try:
            return original()
        finally:
            self.clock.uninstall()

    def timed(self, original, *args):
        if self.trainer.step == self.first_step:   # warm-up: allocations, compilation
            return original(*args)
        with self.clock.section():
            return original(*args)

    def maxima(self, step: int) -> torch.Tensor:
        """At a window's end, [world]: in this rank's slot the lower median of its steps' compute (a step the OS
        held the rank back in does not count; 0 without a timed step)."""
        if step % self.every:
            return torch.zeros(0, device=self.trainer.ctx.device)
        values = torch.zeros(self.world, device=self.trainer.ctx.device)
        if self.step_seconds:
            values[self.rank] = statistics.median_low(self.step_seconds)   # a fill on the device: no copy, no wait
        self.step_seconds = []
        return values

    def read(self, step: int, values: list[float], loss: float) -> None:
        seconds = self.clock.read()   # the step's host read waited for every mark so far
        if seconds > 0:   # the first step is not timed
            self.step_seconds.append(seconds)
        if values and self.rank == 0:
            for finding in self.judge(step, values):
                self.monitor.report(finding)

    def judge(self, step: int, times: list[float]) -> list[Finding]:
        """The ranks slow in `straggler_windows` windows in a row as of this one (each named once a spell)."""
        found = []
        for stage, ranks in self.stages.items():
            if len(ranks) < 2 or min(times[r] for r in ranks) <= 0:   # a rank without a timed step
                continue
            median = statistics.median_low([times[r] for r in ranks])   # of two ranks: the faster one
            for r in ranks:
                self.in_a_row[r] = self.in_a_row[r] + 1 if times[r] > self.factor * median else 0
                if self.in_a_row[r] == self.windows:
                    found.append(self.finding(step, r, times[r], median, stage, len(ranks)))
        return found

    def finding(self, step: int, rank: int, seconds: float, median: float, stage: int, peers: int) -> Finding:
        line = (f"straggler: rank {rank} on {self.hosts[rank]} computes {seconds:.3g} s a step, "
                f"{seconds / median:.2f}x the median {median:.3g} s of the {peers} ranks of pipeline stage {stage}, "
                f"in {self.windows} window{'s' * (self.windows > 1)} of {self.every} steps in a row")
        return Finding("straggler", step, line, {"rank": rank, "host": self.hosts[rank], "compute_s": seconds,
                                                  "median_s": median, "stage": stage})
