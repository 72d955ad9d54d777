"""Context parallelism: every sequence cut over the cp ranks, each holding two zig-zag chunks of it (zigzag.py).

Only attention meets the other ranks' chunks: `apply_context_parallel` gives every layer of a plain model a
kernel that does, by `parallelism.cp_mode` (`CP_KERNELS`: round a ring of the cp ranks, ring.py, by one
all-gather of K/V, all_gather.py, or by all-to-alls to head shards and back, ulysses.py), and sums a MoE block's
router counts over cp. The step runner gives each rank its chunks of every micro-batch and their positions
(nanoexp/runtime/step.py). Each kernel's entry carries its facts, which validation, the memory estimate and the
traffic model ask for instead of comparing names.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

from torch import nn

from nanoexp.model.attention import Causal
from nanoexp.model.llama import Attention
from nanoexp.parallel.context import Axis
from nanoexp.parallel.context_parallel import all_gather, ring, ulysses
from nanoexp.parallel.context_parallel.zigzag import document_starts


class RankAttention(NamedTuple):
    """One layer's attention on one rank, what a kernel's facts are written in: its tp share of the query and
    KV heads, the head dimension, cp; for a micro-batch: its samples, the whole sequence's tokens, bytes of an
    activation and whether documents are masked."""
    heads: int
    kv_heads: int
    head_dim: int
    cp: int
    batch: int = 1
    sequence: int = 0
    act_bytes: int = 4
    documents: bool = False

    @property
    def local_tokens(self) -> int:
        return self.sequence // self.cp


class CPKernel(NamedTuple):
    """A context-parallel attention (parallelism.cp_mode) and its facts (each for cp > 1, in its own module):
    attend(q, k, v, group, cp, cp_rank, scale, starts) -> output, the interface of ring_attention;
    saved_floats(a)       floats a layer saves for backward per local token beyond what one process's attention
                          saves (docs/memory.md);
    workspace_bytes(a)    bytes held only while one layer's attention runs;
    sent_bytes(a, forwards) bytes a rank sends over cp per layer and micro-batch, with `forwards` forward passes
                          (2 under recomputation) and one backward;
    problems(cfg, layout) why it cannot run this config, one line each naming the key ([] when it can)."""
    attend: Callable
    saved_floats: Callable[[RankAttention], float]
    workspace_bytes: Callable[[RankAttention], float]
    sent_bytes: Callable[[RankAttention, int], float]
    problems: Callable[[Any, Any], list[str]] = lambda cfg, layout: []


# parallelism.cp_mode -> how a rank's zig-zag chunks attend to the whole sequence (same interface)
CP_KERNELS = {
    "ring": CPKernel(ring.ring_attention, ring.saved_floats, ring.workspace_bytes, ring.sent_bytes),
    "all_gather": CPKernel(all_gather.all_gather_attention, all_gather.saved_floats, all_gather.workspace_bytes,
                           all_gather.sent_bytes),
    "ulysses": CPKernel(ulysses.ulysses_attention, ulysses.saved_floats, ulysses.workspace_bytes, ulysses.sent_bytes,
                        ulysses.problems),
}


class ContextParallelAttention(nn.Module):
    """An attention kernel (nanoexp/model/attention.py) for a rank's zig-zag chunks of every sequence: causal, or
    within documents, whose starts it finds from the chunks' positions (no ids travel)."""

    def __init__(self, mode: str, axis: Axis):
        super().__init__()
        self.mode, self.attend, self.axis = mode, CP_KERNELS[mode].attend, axis

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
        if isinstance(module, Attention):
            module.kernel = ContextParallelAttention(mode, axis)
    if model.moe_losses is not None:
        model.moe_losses.token_sums.append(functools.partial(_all_reduce, group=axis.group))
    return model


def _all_reduce(tensor, group) -> None:
    import torch.distributed as dist
    dist.all_reduce(tensor, group=group)
