"""The ops of a decoder layer whose outputs selective recomputation keeps for backward, by the names
`parallelism.selective_ops` gives them (nanoexp/runtime/recompute.py applies them; docs/memory.md).

A group names torch's aten ops, the level torch.utils.checkpoint's selective policy sees. The default keeps the
products and attention, as torchtitan's op list does: the ops that cost FLOPs, so that the backward recomputes only
the cheap element-wise ones (norms, rotary, SwiGLU's silu and product). Only out-of-place ops can be kept: a
collective that reduces in place (tensor parallelism's all-reduce) runs again with the recomputed forward.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _flash_attn_ops() -> tuple:
    """flash-attn's forward, a registered op from its release 2.6 (absent where it is not installed)."""
    ops = getattr(torch.ops, "flash_attn", None)
    try:
        return (ops._flash_attn_forward.default,) if ops is not None else ()
    except (AttributeError, RuntimeError):
        return ()


SAVABLE_OPS: dict[str, tuple] = {
    # Linear's x W^T (a 3-D input runs as one mm), FP8's scaled product, the experts' grouped products. Not bmm:
    # the context-parallel kernels' tiles of scores are batched products, s/cp x s/cp each, never worth keeping.
    "matmul": (aten.mm.default, aten.addmm.default, aten._scaled_mm.default, aten._grouped_mm.default,
               aten._scaled_grouped_mm.default),
    # SDPA's fused kernels (each returns the output and its log-sum-exp) and flash-attn's
    "attention": (aten._scaled_dot_product_flash_attention.default,
                  aten._scaled_dot_product_flash_attention_for_cpu.default,
                  aten._scaled_dot_product_efficient_attention.default,
                  aten._scaled_dot_product_cudnn_attention.default,
                  aten._scaled_dot_product_fused_attention_overrideable.default) + _flash_attn_ops(),
}


def saved_ops(names) -> frozenset:
    """The aten ops of the groups `names` (each a key of SAVABLE_OPS)."""
    return frozenset(op for name in names for op in SAVABLE_OPS[name])
