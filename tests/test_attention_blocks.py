"""Tiled block attention (nanoexp/parallel/context_parallel/blocks.py) against SDPA on one process.

A block computed in tiles of any size, the last one short, must give the same output, log-sum-exp and
q/k/v gradients as attention computed in one go: only the order of the sums differs.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import nanoexp.parallel.context_parallel.blocks as attention_blocks
from nanoexp.parallel.context_parallel.blocks import attend_block, attend_block_backward, tile_pairs

# float64 so that the tiled sums and SDPA's agree to ~1e-15 (measured at most 1.8e-15); a tiling error is O(1)
EXACT = dict(atol=1e-12, rtol=1e-10)


def test_tiles_cover_the_block_once_and_skip_the_causal_upper_tiles(monkeypatch):
    monkeypatch.setattr(attention_blocks, "TILE", 3)
    for n, m in ((7, 7), (7, 4), (3, 3), (1, 5)):
        covered = torch.zeros(n, m, dtype=torch.int)
        for rows, cols, masked in tile_pairs(n, m, causal=False):
            covered[rows, cols] += 1
            assert not masked
        assert covered.eq(1).all()
    seen = torch.zeros(7, 7, dtype=torch.int)
    for rows, cols, masked in tile_pairs(7, 7, causal=True):
        tile = torch.ones(rows.stop - rows.start, cols.stop - cols.start, dtype=torch.int)
        seen[rows, cols] += tile.tril() if masked else tile
    assert torch.equal(seen, torch.ones(7, 7, dtype=torch.int).tril())   # the causal triangle, once


def run_block(q, k, v, grad_out, scale, causal):
    out = torch.zeros(q.shape, dtype=q.dtype)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=q.dtype)
    attend_block(q, k, v, scale, causal, out, lse)
    delta = (grad_out * out).sum(-1)
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    attend_block_backward(q, k, v, grad_out, lse, delta, scale, causal, *grads)
    return out, lse, grads


@pytest.mark.parametrize("tile", [1, 3, 5, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_tiled_block_matches_sdpa(monkeypatch, tile, causal):
    monkeypatch.setattr(attention_blocks, "TILE", tile)
    gen = torch.Generator().manual_seed(tile)
    heads, kv_heads, n, d, scale = 4, 2, 11, 8, 0.3   # GQA, a length no tile divides, a µP-like scale
    m = n if causal else 7                           # a full block may be rectangular
    q = torch.randn(2, heads, n, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, m, d, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(2, heads, n, d, generator=gen, dtype=torch.float64)
    out, lse, grads = run_block(q.detach(), k.detach(), v.detach(), grad_out, scale, causal)

    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    expected.backward(grad_out)
    scores = q @ k.repeat_interleave(heads // kv_heads, 1).transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(out, expected.detach(), **EXACT)
    torch.testing.assert_close(lse, scores.logsumexp(-1).detach(), **EXACT)
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want, **EXACT)
