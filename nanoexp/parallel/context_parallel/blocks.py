"""Exact attention of one block of queries against one block of keys, in tiles, with log-sum-exp statistics.

A chunk x chunk block of scores would grow as (s/cp)², so each block runs in TILE x TILE tiles, as flash attention
does: the forward folds tiles into a running (output, log-sum-exp) with the online-softmax rule, the backward
recomputes each tile's probabilities from the final log-sum-exp. A block is full or causal (a chunk against itself:
tiles above the diagonal skipped); document masking hides the keys before each query's document start (every row
sees its own key, so its log-sum-exp stays finite). Tiles compute in their inputs' dtype, which the cp attentions
give in float32 whatever autocast is active: a bf16 log-sum-exp would disagree with the float32 backward."""
from __future__ import annotations

import torch

TILE = 256   # rows and columns of one tile: 256² float32 scores a head, 3 MB for 4 heads and 3 such tensors


def _spans(n: int) -> list[tuple[int, int]]:
    return [(i, min(i + TILE, n)) for i in range(0, n, TILE)]


def tile_pairs(n: int, m: int, causal: bool) -> list[tuple[slice, slice, bool]]:
    """(query rows, key columns, masked) of the tiles an n × m block computes. A causal block (n == m) skips
    the tiles above its diagonal and masks those on it; every other tile is full."""
    return [(slice(*rows), slice(*cols), causal and rows == cols)
            for rows in _spans(n) for cols in _spans(m) if not causal or cols[0] <= rows[0]]


def _grouped(x, kv_heads):
    """[b, heads, n, d] -> [b, kv_heads, group, n, d]: head i reads KV head i // group."""
    return x.unflatten(1, (kv_heads, x.shape[1] // kv_heads))


def tile_mask(rows: slice, cols: slice, diagonal: bool, device, starts=None, key_start: int = 0):
    """Where a tile's scores are hidden (True), or None: above the diagonal on a diagonal tile, and with
    document masking (starts [b, n]: the sequence index where each query row's document starts) the keys
    before that start. key_start is the sequence index of the block's first key."""
    n, m = rows.stop - rows.start, cols.stop - cols.start
    mask = torch.ones(n, m, dtype=torch.bool, device=device).triu(1) if diagonal else None
    if starts is None:
        return mask
    keys = torch.arange(key_start + cols.start, key_start + cols.stop, device=device)
    earlier = keys < starts[:, rows].unsqueeze(-1)                    # [b, n, m]
    mask = earlier if mask is None else earlier | mask
    return mask[:, None, None]                                        # over [b, kv_heads, group, n, m]


def _scores(q, k, scale, mask):
    """q [b, kvh, g, n, d] · k [b, kvh, m, d] -> [b, kvh, g, n, m], −inf where mask is True."""
    scores = q @ k.unsqueeze(2).transpose(-1, -2) * scale
    return scores if mask is None else scores.masked_fill(mask, float("-inf"))


def _finite(lse):
    """lse with −inf (a row that sees no key of this tile, under document masking) as 0, to subtract safely."""
    return lse.masked_fill(lse == float("-inf"), 0)


def _tile_forward(q, k, v, scale, mask):
    """One tile's output [b, h, n, d] and log-sum-exp [b, h, n] (−inf and output 0 on rows that see nothing)."""
    scores = _scores(_grouped(q, k.shape[1]), k, scale, mask)
    lse = scores.logsumexp(-1)
    out = torch.exp(scores - _finite(lse).unsqueeze(-1)) @ v.unsqueeze(2)
    return out.flatten(1, 2), lse.flatten(1, 2)


def _tile_backward(q, k, v, grad_out, lse, delta, scale, mask):
    """dq [b, h, n, d], dk/dv [b, kvh, m, d] of one tile; delta = rowsum(grad_out · out), the softmax's
    correction term."""
    kvh = k.shape[1]
    q, grad_out = _grouped(q, kvh), _grouped(grad_out, kvh)
    lse, delta = lse.unflatten(1, (kvh, -1)).unsqueeze(-1), delta.unflatten(1, (kvh, -1)).unsqueeze(-1)
    probs = torch.exp(_scores(q, k, scale, mask) - lse)                # [b, kvh, g, n, m]
    grad_v = (probs.transpose(-1, -2) @ grad_out).sum(2)                # a KV head gathers its whole group
    grad_scores = probs * (grad_out @ v.unsqueeze(2).transpose(-1, -2) - delta)
    grad_q = (grad_scores @ k.unsqueeze(2)).flatten(1, 2) * scale
    grad_k = (grad_scores.transpose(-1, -2) @ q).sum(2) * scale
    return grad_q, grad_k, grad_v


def merge(out, lse, part_out, part_lse):
    """Fold a partial result into the running one (online softmax), in place; rows neither has seen a key
    for stay at output 0 and lse −inf."""
    new_lse = torch.logaddexp(lse, part_lse)
    shift = _finite(new_lse).unsqueeze(-1)
    out.mul_(torch.exp(lse.unsqueeze(-1) - shift)).add_(part_out * torch.exp(part_lse.unsqueeze(-1) - shift))
    lse.copy_(new_lse)


def attend_block(q, k, v, scale, causal, out, lse, starts=None, key_start=0):
    """Fold the attention of queries q to keys/values k, v into the running out [b, h, n, d] and lse
    [b, h, n] (−inf where nothing is folded yet), in place. Document masking: starts and key_start as in
    tile_mask."""
    with torch.autocast(q.device.type, enabled=False):   # the inputs' precision (module docstring)
        for rows, cols, diagonal in tile_pairs(q.shape[2], k.shape[2], causal):
            mask = tile_mask(rows, cols, diagonal, q.device, starts, key_start)
            tile_out, tile_lse = _tile_forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], scale, mask)
            merge(out[:, :, rows], lse[:, :, rows], tile_out, tile_lse)


def attend_block_backward(q, k, v, grad_out, lse, delta, scale, causal, grad_q, grad_k, grad_v, starts=None,
                          key_start=0):
    """Add the block's share of the gradients to grad_q [b, h, n, d] and grad_k, grad_v [b, kvh, m, d], in
    place; lse is the rows' final log-sum-exp over all blocks (finite: a row sees at least its own key),
    delta their rowsum(grad_out · out)."""
    with torch.autocast(q.device.type, enabled=False):   # as the forward's
        for rows, cols, diagonal in tile_pairs(q.shape[2], k.shape[2], causal):
            mask = tile_mask(rows, cols, diagonal, q.device, starts, key_start)
            gq, gk, gv = _tile_backward(q[:, :, rows], k[:, :, cols], v[:, :, cols], grad_out[:, :, rows],
                                        lse[:, :, rows], delta[:, :, rows], scale, mask)
            grad_q[:, :, rows].add_(gq)
            grad_k[:, :, cols].add_(gk)
            grad_v[:, :, cols].add_(gv)
