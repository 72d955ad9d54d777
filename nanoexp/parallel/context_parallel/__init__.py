"""Context parallelism: every sequence cut over the cp ranks, each holding two zig-zag chunks of it (zigzag.py).

Only attention meets the other ranks' chunks: `apply_context_parallel` gives every layer of a plain model a
kernel that does, by `parallelism.cp_mode` (`CP_KERNELS`: round a ring of the cp ranks, ring.py, or by one
all-gather of K/V, all_gather.py), and sums a MoE block's router counts over cp. The step runner gives each rank
its chunks of every micro-batch and their positions (nanoexp/runtime/step.py).
"""
from __future__ import annotations

import functools

from torch import nn

from nanoexp.model.attention import Causal
from nanoexp.parallel.context import Axis
from nanoexp.parallel.context_parallel.all_gather import all_gather_attention
from nanoexp.parallel.context_parallel.ring import ring_attention
from nanoexp.parallel.context_parallel.zigzag import document_starts

# parallelism.cp_mode -> how a rank's zig-zag chunks attend to the whole sequence (same interface)
CP_KERNELS = {"ring": ring_attention, "all_gather": all_gather_attention}


class ContextParallelAttention(nn.Module):
    """An attention kernel (nanoexp/model/attention.py) for a rank's zig-zag chunks of every sequence: causal, or
    within documents, whose starts it finds from the chunks' positions (no ids travel)."""

    def __init__(self, mode: str, axis: Axis):
        super().__init__()
        self.mode, self.attend, self.axis = mode, CP_KERNELS[mode], axis

    def forward(self, q, k, v, scale, mask):
        if isinstance(mask, Causal) and mask.offset:
            raise ValueError("context-parallel attention has no KV cache (Causal offset)")
        starts = None if isinstance(mask, Causal) else document_starts(mask.position_ids, self.axis.size,
                                                                         self.axis.rank)
        return self.attend(q, k, v, self.axis.group, self.axis.size, self.axis.rank, scale, starts)

    def extra_repr(self):
        return f"{self.mode}, cp={self.axis.size}"


def apply_context_parallel(model: nn.Module, axis: Axis, mode: str) -> nn.Module:
    """Every layer of `model` attends across the cp ranks; its MoE blocks' router counts are summed over them."""
    for module in model.modules():
        if type(module).__name__ == "Attention":
            module.kernel = ContextParallelAttention(mode, axis)
    if model.moe_losses is not None:
        model.moe_losses.token_sums.append(functools.partial(_all_reduce, group=axis.group))
    return model


def _all_reduce(tensor, group) -> None:
    import torch.distributed as dist
    dist.all_reduce(tensor, group=group)
