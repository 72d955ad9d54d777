"""The memory half of the cost model (cost.py is the time half): the bytes the busiest GPU of a layout holds, and
how far they sit below what fits.

The estimate is nanoexp/observe/memory_estimate.py's for the busiest pipeline stage (what scripts/estimate_memory.py
prints: parameters, gradients, the optimizer's state, the activations of the micro-batches the engine holds, ZeRO-2/3's
units in flight), plus what a GPU adds: under bf16 autocast the bf16 copies of the weights it keeps during a step
(2 B per parameter held, whatever the stage: each matmul saves its weight's cast for backward, even where ZeRO-3
frees the float32 unit), and one process's fixed cost (the CUDA context and workspaces; on a CPU Python and torch:
Hardware.cuda_context_gb). It leaves out allocator fragmentation and NCCL's buffers: hence HEADROOM, a layout fits
when its estimate is at most 90 % of the device's memory. Sizes are GiB (2^30 bytes); datasheets print GB (10^9).
"""
from __future__ import annotations

from nanoexp.instruments.memory import CUDA_CONTEXT_MB, MB
from nanoexp.model.shape import model_shape
from nanoexp.observe.memory_estimate import device_estimate as estimate   # noqa: F401 - the planner's name for it
from nanoexp.observe.memory_estimate import estimate as rank_estimate, total

GIB = 1024 ** 3
GB = 1e9
HEADROOM = 0.9   # of the device's memory: the estimate leaves out fragmentation and NCCL's buffers


def device_gib(cfg, context_gb: float, shape=None) -> float:
    """GiB the busiest process holds on a device whose fixed cost a process is `context_gb` (decimal GB:
    Hardware.cuda_context_gb) in place of the estimate's nominal CUDA context."""
    return (sum(estimate(cfg, shape).values()) - CUDA_CONTEXT_MB * MB + context_gb * GB) / GIB


def first_rank_gib(cfg, context_gb: float, shape=None) -> float:
    """A bound below device_gib, from the first pipeline rank alone (the one holding the most micro-batches in
    flight under 1F1B): the busiest holds at least as much. Cheaper by the pipeline's depth."""
    return total(rank_estimate(cfg, shape or model_shape(cfg), 0, "cuda")) / GIB + context_gb * GB / GIB


def limit_gib(memory_gb: float) -> float:
    """What fits on a device of `memory_gb` (decimal GB, as datasheets print it), in GiB: HEADROOM of it."""
    return HEADROOM * memory_gb * GB / GIB
