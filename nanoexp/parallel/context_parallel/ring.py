"""Ring attention over context-parallel ranks, load-balanced by the zig-zag split (issue #18).

Each cp rank holds two chunks of the sequence, r and 2·cp−1−r (zigzag.py). Each rank keeps the queries of its two
chunks; the K/V blocks travel round the ring (to the next rank, from the previous one), and at step t rank r attends
to the block of rank (r − t) mod cp. Chunk pairs are fully visible (key chunk before query chunk), causal on the
diagonal (the same chunk), or invisible (key chunk after): a rank computes only the visible ones, which is the same
work on every rank (`ring_blocks`). The partial outputs are merged with the log-sum-exp rule; each block is computed
in tiles (blocks.py), so no rank holds more than one tile's scores.
The backward recomputes each block's probabilities from the saved log-sum-exp (as flash attention does). K/V go
round the ring again, and with them one float accumulator of dK/dV per block, which reaches its owner after visiting
every other rank: K/V and dK/dV each travel cp − 1 hops. Every exchange is ONE batch_isend_irecv that pairs the
sends to the next rank with the receives from the previous one, so NCCL's ordered, tagless channels cannot deadlock;
nanoexp.verify.context_parallel.ring_plan writes the exchanges as a plan, and tests/test_ring_attention.py checks it
under NCCL's rules and that the function posts exactly it. parallelism.cp_mode=ring (parallelism.cp > 1) runs it.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from nanoexp.parallel.context_parallel import blocks as attention_blocks
from nanoexp.parallel.context_parallel.blocks import attend_block, attend_block_backward
from nanoexp.parallel.context_parallel.zigzag import chunk_start, rank_chunks


# -- which blocks a rank computes -------------------------------------------------------------

def visibility(q_chunk: int, k_chunk: int) -> str | None:
    """How queries of one chunk see keys of another under causal masking: "full", "causal" or None."""
    return "full" if k_chunk < q_chunk else "causal" if k_chunk == q_chunk else None


def ring_blocks(cp: int, cp_rank: int) -> list[list[tuple[int, int, bool]]]:
    """Per ring step, the blocks rank `cp_rank` computes: (query half, key half, causal) with halves 0 and 1 of
    the local chunks. Step t holds the K/V of rank (cp_rank − t) mod cp. Every step but the first is two full
    chunk×chunk blocks; the first is local causal attention (two diagonal blocks and one full one)."""
    steps = []
    for t in range(cp):
        source = (cp_rank - t) % cp
        steps.append([(qi, ki, vis == "causal")
                      for qi, q_chunk in enumerate(rank_chunks(cp, cp_rank))
                      for ki, k_chunk in enumerate(rank_chunks(cp, source))
                      if (vis := visibility(q_chunk, k_chunk))])
    return steps


def _halves(x, dim=2):
    return x.chunk(2, dim)


def key_start(local_len: int, cp: int, cp_rank: int, step: int, half: int) -> int:
    """The sequence index of the first key of half `half` of the K/V block rank `cp_rank` holds at ring step
    `step` (the block of rank cp_rank − step); local_len = the 2 chunks a rank holds."""
    return chunk_start(local_len, cp, (cp_rank - step) % cp, half)


def _documents(starts, half: int, key_start: int) -> dict:
    """attend_block's document-masking arguments for query half `half` (none without document masking)."""
    return {} if starts is None else dict(starts=_halves(starts, dim=1)[half], key_start=key_start)


# -- the ring ---------------------------------------------------------------------------------

def _exchange(sends, group, cp, cp_rank):
    """Post ONE batch: every tensor of `sends` to the next rank, a buffer like each from the previous one.
    Returns (works, buffers); wait on the works before reading the buffers."""
    nxt, prev = (cp_rank + 1) % cp, (cp_rank - 1) % cp
    if group is not None:   # P2POp wants global ranks
        nxt, prev = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prev)
    buffers = [torch.empty_like(t) for t in sends]
    ops = ([dist.P2POp(dist.isend, t, nxt, group) for t in sends]
           + [dist.P2POp(dist.irecv, b, prev, group) for b in buffers])
    return dist.batch_isend_irecv(ops), buffers


def _wait(works):
    for work in works:
        work.wait()


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, group, cp, cp_rank, scale, starts):
        acc = torch.promote_types(q.dtype, torch.float32)   # softmax statistics and sums in at least float32
        q, kv = q.contiguous(), torch.stack([k, v]).contiguous()   # K and V travel as one message
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        out_halves, lse_halves, q_halves = _halves(out), _halves(lse), _halves(q.to(acc))
        for t, blocks in enumerate(ring_blocks(cp, cp_rank)):
            # post the next exchange first, so it runs while this block computes (kv is only read)
            works, received = _exchange([kv], group, cp, cp_rank) if t < cp - 1 else ([], None)
            k_halves, v_halves = _halves(kv[0].to(acc)), _halves(kv[1].to(acc))
            for qi, ki, causal in blocks:
                attend_block(q_halves[qi], k_halves[ki], v_halves[ki], scale, causal, out_halves[qi], lse_halves[qi],
                             **_documents(starts, qi, key_start(q.shape[2], cp, cp_rank, t, ki)))
            _wait(works)
            kv = received[0] if received else kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = group, cp, cp_rank, scale, starts
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, cp, cp_rank, scale, starts = ctx.ring
        acc = lse.dtype
        delta = (grad_out.to(acc) * out.to(acc)).sum(-1)
        rows = list(zip(_halves(q.to(acc)), _halves(grad_out.to(acc)), _halves(lse), _halves(delta)))
        grad_q = torch.zeros(q.shape, dtype=acc, device=q.device)
        grad_q_halves, steps = _halves(grad_q), ring_blocks(cp, cp_rank)

        def add_block(t, kv, grad_kv):
            """Accumulate step t's blocks into grad_q and the travelling dK/dV accumulator grad_kv [2, ...]."""
            k_halves, v_halves = _halves(kv[0].to(acc)), _halves(kv[1].to(acc))
            gk_halves, gv_halves = _halves(grad_kv[0]), _halves(grad_kv[1])
            for qi, ki, causal in steps[t]:
                q_rows, grad_out_rows, lse_rows, delta_rows = rows[qi]
                attend_block_backward(q_rows, k_halves[ki], v_halves[ki], grad_out_rows, lse_rows, delta_rows, scale,
                                      causal, grad_q_halves[qi], gk_halves[ki], gv_halves[ki],
                                      **_documents(starts, qi, key_start(q.shape[2], cp, cp_rank, t, ki)))

        kv = torch.stack([k, v]).contiguous()
        own_kv, grad_kv = kv, None
        coming = _exchange([kv], group, cp, cp_rank) if cp > 1 else None   # step 1's block
        for t in range(1, cp):
            _wait(coming[0])
            kv = coming[1][0]
            # The accumulator of the block held at step t−1 travels on (none exists before step 1): posted first,
            # since NCCL runs a group's batches in order and this one is needed now; then the next block, which
            # arrives while this one computes.
            works, received = _exchange([grad_kv], group, cp, cp_rank) if grad_kv is not None else ([], None)
            coming = _exchange([kv], group, cp, cp_rank) if t < cp - 1 else None
            _wait(works)
            grad_kv = received[0] if received else torch.zeros(kv.shape, dtype=acc, device=kv.device)
            add_block(t, kv, grad_kv)
        own_grad_kv = torch.zeros(own_kv.shape, dtype=acc, device=own_kv.device)
        if cp > 1:   # the last accumulator goes to its owner, the next rank; ours comes from the previous one
            works, received = _exchange([grad_kv], group, cp, cp_rank)
            add_block(0, own_kv, own_grad_kv)   # our own block, while the exchange runs
            _wait(works)
            own_grad_kv += received[0]
        else:
            add_block(0, own_kv, own_grad_kv)
        return (grad_q.to(q.dtype), own_grad_kv[0].to(k.dtype), own_grad_kv[1].to(v.dtype),
                None, None, None, None, None)


def ring_attention(q, k, v, group=None, cp: int = 1, cp_rank: int = 0, scale: float | None = None,
                   starts: torch.Tensor | None = None):
    """Exact causal attention over the whole sequence from this cp rank's two zig-zag chunks.
    q [b, heads, s_local, d], k/v [b, kv_heads, s_local, d] (kv_heads divides heads), s_local = 2 chunks in
    the order zigzag_split gives; returns [b, heads, s_local, d]. Scores q·k · scale (None: 1/sqrt(d)).
    `group` is the cp process group (None: the default group) of cp ranks; cp = 1 communicates nothing.
    Document masking: starts [b, s_local] (document_starts) hides the keys before each query's document."""
    if q.shape[1] % k.shape[1] or k.shape != v.shape or q.shape[2] != k.shape[2] or q.shape[2] % 2:
        raise ValueError(f"ring_attention needs q [b, h, s, d], k/v [b, kvh, s, d] with kvh dividing h and s even; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, group, cp, cp_rank, scale, starts)


# -- its facts (CP_KERNELS' entry; `a` is a RankAttention) ----------------------------------------

def saved_floats(a) -> float:
    """Per local token: the ring keeps its output [b, heads, s, d] for backward, and o_proj saves its [b, s,
    heads*d] copy; SDPA's output already has o_proj's layout, so without cp one tensor serves both."""
    return a.heads * a.head_dim


def workspace_bytes(a) -> float:
    """One tile in flight: a tile's forward or backward holds up to 3 [batch, heads, T, T] float32 tensors at
    once (scores or probabilities, and two temporaries of the score gradient), T = min(TILE, s / 2cp)."""
    tile = min(attention_blocks.TILE, a.sequence // (2 * a.cp))
    return 3 * 4 * a.batch * a.heads * tile * tile


def sent_bytes(a, forwards: int) -> float:
    """K/V cp − 1 hops each forward and again in the backward, the float32 dK/dV accumulator cp − 1 hops home."""
    kv = 2 * a.batch * a.kv_heads * a.local_tokens * a.head_dim   # floats of one K/V message
    return (a.cp - 1) * ((forwards + 1) * kv * a.act_bytes + kv * 4)
