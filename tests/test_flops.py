"""The analytic FLOP count behind `model_tflops_per_sec`/`mfu` and `hardware_tflops_per_sec`,
checked against torch.utils.flop_counter.FlopCounterMode on a real training step.

Convention: FlopCounterMode counts matmuls only (2·m·n·k each, forward and backward), which is
exactly what PaLM's 6N + 12·L·h·s formula counts (norms, rotary, softmax and the embedding
lookup are left out by both). On CPU it counts nothing for scaled_dot_product_attention, so the
step runs a math attention path (explicit q·kᵀ and p·v over the FULL s×s matrix, GQA heads
repeated), which is the full-attention convention the formula uses (not the causal half).
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from nanoexp.model import attention
from nanoexp.observe.metrics import flops_per_token, hardware_flops_per_token
from nanoexp.runtime.build import build_model
from nanoexp.model.shape import model_shape
from nanoexp.parallel.context import ParallelContext
from tests.helpers import FAST, compose_config


class MathAttention(torch.nn.Module):
    """An attention kernel (nanoexp/model/attention.py) computing causal attention as plain matmuls over the full
    s x s score matrix (scores q·k * scale, None: 1/sqrt(d)), which the FLOP counter sees."""

    def forward(self, q, k, v, scale, mask):
        return math_attention(q, k, v, scale)


def math_attention(q, k, v, scale=None):
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    s = q.shape[-2]
    scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def counted_flops(overrides, monkeypatch) -> tuple[float, object, int]:
    """FLOPs FlopCounterMode sees in one forward + backward of one micro-batch."""
    monkeypatch.setitem(attention.ATTENTION_KERNELS, "auto", MathAttention)
    cfg = compose_config(FAST + overrides)
    model = build_model(cfg, ParallelContext())
    b, s = cfg.tokens.micro_batch_size, cfg.tokens.sequence_length
    ids = torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).mean().backward()
    return counter.get_total_flops(), model_shape(cfg), b * s


def test_model_flops_match_flop_counter(monkeypatch):
    counted, shape, tokens = counted_flops([], monkeypatch)
    expected = flops_per_token(shape, 32) * tokens
    # Both count the same matmuls exactly; 1e-9 only absorbs float rounding of the formula.
    assert counted == pytest.approx(expected, rel=1e-9)


def test_recomputation_counts_as_hardware_not_model_flops(monkeypatch):
    counted, shape, tokens = counted_flops(["parallelism.recompute_layer=true"], monkeypatch)
    # The recomputed block forwards run inside backward and are counted by FlopCounterMode.
    assert counted == pytest.approx(hardware_flops_per_token(shape, 32, True) * tokens, rel=1e-9)
    assert counted > flops_per_token(shape, 32) * tokens * 1.2   # and they are not model FLOPs
    assert hardware_flops_per_token(shape, 32, False) == flops_per_token(shape, 32)
