"""Attention kernels: what turns each query's q, k, v into its output, chosen by name (`model.attention_kernel`).

A kernel is a module called as `kernel(q, k, v, scale, mask)`: q [b, heads, s, d], k and v [b, kv_heads, s_k, d]
(a KV head serves heads / kv_heads query heads), scores q·k * scale (None: 1/sqrt(d)), output [b, heads, s, d].
`mask` says which keys a query sees:
  Causal(offset)     query i sits at position offset + i and sees keys 0 .. offset + i (offset: a KV cache's
                     earlier positions; 0 in training, where queries and keys are the same tokens)
  Documents(ids, positions)
                     packed samples (model.attention_mask=document): a query sees the keys of its own document
                     up to itself; ids and positions [b, s] count from 0 in each document.
Context parallelism replaces the kernel of every layer by one that meets the other ranks' chunks
(nanoexp/parallel/context_parallel/); a new kernel is a class here (or in its own file) and a line in
`ATTENTION_KERNELS`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

try:  # optional GPU extra
    from flash_attn import flash_attn_func
except ImportError:  # pragma: no cover - not installable on CPU machines
    flash_attn_func = None


@dataclass(frozen=True)
class Causal:
    offset: int = 0


@dataclass(frozen=True)
class Documents:
    document_ids: torch.Tensor
    position_ids: torch.Tensor


def document_mask(document_ids, position_ids, kv_document_ids=None, kv_position_ids=None) -> torch.Tensor:
    """[b, 1, s, s_k], True where query i sees key j: the same document, j's position not after i's (positions
    restart at 0 in each document, so within one they order tokens as the sequence does)."""
    kv_document_ids = document_ids if kv_document_ids is None else kv_document_ids
    kv_position_ids = position_ids if kv_position_ids is None else kv_position_ids
    same_document = document_ids[:, None, :, None] == kv_document_ids[:, None, None, :]
    not_after = position_ids[:, None, :, None] >= kv_position_ids[:, None, None, :]
    return same_document & not_after


def native_gqa(q: torch.Tensor, masked: bool) -> bool:
    """Whether SDPA takes grouped K/V heads as they are (enable_gqa) on a fused kernel. On CUDA only flash
    attention does, in half precision without an explicit mask; otherwise enable_gqa falls back to the math kernel,
    which builds [b, heads, s, s_k] scores per layer (out of memory at long sequences), so K/V are repeated
    instead ([b, heads, s_k, d]) for the memory-efficient kernel, which takes masks. CPU's fused kernel takes
    both (benchmarks/bench_attention_memory.py)."""
    if not q.is_cuda:
        return True
    return q.dtype in (torch.bfloat16, torch.float16) and not masked


def repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V with each KV head repeated for the query heads it serves (head h reads KV head h // group)."""
    group = q.shape[1] // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


class SDPA(nn.Module):
    """torch's scaled_dot_product_attention (its fused CPU and CUDA kernels), any mask."""

    def forward(self, q, k, v, scale, mask):
        causal_only = isinstance(mask, Causal) and mask.offset == 0 and q.shape[2] == k.shape[2]
        gqa = q.shape[1] != k.shape[1]
        if gqa and not native_gqa(q, masked=not causal_only):
            (k, v), gqa = repeat_kv(q, k, v), False
        if isinstance(mask, Documents):
            attn_mask = document_mask(mask.document_ids, mask.position_ids)   # one mask for every head
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=gqa)
        if causal_only:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        queries = mask.offset + torch.arange(q.shape[2], device=q.device)
        attn_mask = torch.arange(k.shape[2], device=q.device)[None, :] <= queries[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=gqa)


class FlashAttention(SDPA):
    """flash-attn (the [flash] extra) for causal attention on CUDA in half precision; SDPA for the rest. Its
    causal mask aligns the last query with the last key, which is the KV cache's rule too."""

    def forward(self, q, k, v, scale, mask):
        if not (usable_flash(q) and isinstance(mask, Causal)):
            return super().forward(q, k, v, scale, mask)
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                              softmax_scale=scale)
        return out.transpose(1, 2)


def usable_flash(q: torch.Tensor) -> bool:
    return flash_attn_func is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)


# model.attention_kernel -> the kernel class; "auto" is flash-attn where it can run, SDPA elsewhere
ATTENTION_KERNELS = {"auto": FlashAttention, "sdpa": SDPA, "flash": FlashAttention}


def attention_kernel(name: str) -> nn.Module:
    return ATTENTION_KERNELS[name]()


def kernel_problems(name: str) -> list[str]:
    """Why model.attention_kernel=`name` cannot run here: "flash" insists on flash-attn ("auto" falls back)."""
    if name == "flash" and flash_attn_func is None:
        return ["model.attention_kernel=flash needs flash-attn, which is not importable here: pip install -e "
                "'.[flash]' on a CUDA machine, or use auto"]
    return []
