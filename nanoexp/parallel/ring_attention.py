"""Ring attention over context-parallel ranks, load-balanced by the zig-zag split (issue #18).

The sequence is cut into 2·cp chunks; cp rank r holds chunks r and 2·cp−1−r ("head-tail" or zig-zag), so a
rank with an early, cheap chunk also holds a late, expensive one. Each rank keeps the queries of its two chunks;
the K/V blocks travel round the ring (to the next rank, from the previous one), and at step t rank r attends
to the block of rank (r − t) mod cp. Chunk pairs are fully visible (key chunk before query chunk), causal on
the diagonal (the same chunk), or invisible (key chunk after): a rank computes only the visible ones, which is
the same work on every rank (`ring_blocks`). The partial outputs are merged with the log-sum-exp rule; each block
is computed in tiles (attention_blocks.py), so no rank holds more than one tile's scores.

The backward recomputes each block's probabilities from the saved log-sum-exp (as flash attention does). K/V
go round the ring again, and with them one float accumulator of dK/dV per block, which reaches its owner
after visiting every other rank: K/V and dK/dV each travel cp − 1 hops. Every exchange is ONE
batch_isend_irecv that pairs the sends to the next rank with the receives from the previous one, so NCCL's
ordered, tagless channels cannot deadlock; `ring_plan` writes the exchanges in p2p_plan's format, and
tests/test_ring_attention.py checks the plan with p2p_plan.check and that the function posts exactly it.

parallelism.cp > 1 runs it in every attention layer (nanoexp/model/llama.py); the trainer gives each cp rank its
zig-zag part of every micro-batch (Trainer.context_part).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from nanoexp.parallel.attention_blocks import attend_block, attend_block_backward


# -- the zig-zag split ------------------------------------------------------------------------

def rank_chunks(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two of the 2·cp sequence chunks that cp rank `cp_rank` holds, in the order it holds them."""
    return cp_rank, 2 * cp - 1 - cp_rank


def zigzag_indices(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The sequence positions cp rank `cp_rank` holds, in its local order (ascending). seq_len must be a
    multiple of 2·cp (ValueError otherwise)."""
    if seq_len % (2 * cp):
        raise ValueError(f"the sequence length ({seq_len}) must be a multiple of 2·cp ({2 * cp})")
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in rank_chunks(cp, cp_rank)])


def zigzag_split(x: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of x along the sequence dimension `dim` (1 for [b, s, ...], 2 for [b, heads, s, d])."""
    return x.index_select(dim, zigzag_indices(x.shape[dim], cp, cp_rank).to(x.device))


def zigzag_gather(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every cp rank's part (parts[r] from rank r): the inverse of zigzag_split."""
    cp = len(parts)
    full = torch.cat(parts, dim)
    order = torch.cat([zigzag_indices(full.shape[dim], cp, r) for r in range(cp)])
    return full.index_select(dim, torch.argsort(order).to(full.device))


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
    return rank_chunks(cp, (cp_rank - step) % cp)[half] * (local_len // 2)


def document_starts(position_ids: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """Under document masking: the sequence index where each local token's document starts, [b, s_local]
    (position_ids count from 0 in each document, and a document is contiguous in the sequence)."""
    local = zigzag_indices(position_ids.shape[1] * cp, cp, cp_rank).to(position_ids.device)
    return local - position_ids


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
        for t in range(1, cp):
            # the accumulator of the block held at step t−1 travels with it (none exists before step 1)
            works, received = _exchange([kv] + ([grad_kv] if grad_kv is not None else []), group, cp, cp_rank)
            _wait(works)
            kv = received[0]
            grad_kv = received[1] if len(received) > 1 else torch.zeros(kv.shape, dtype=acc, device=kv.device)
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


def ring_plan(cp: int, kv_nbytes: int = 0, grad_kv_nbytes: int = 0, named: bool = False) -> list:
    """The batches of one ring_attention forward and backward, per cp rank, in p2p_plan's format: ops
    ("send" | "recv", peer cp rank, nbytes). kv_nbytes is one K/V message (K and V stacked), grad_kv_nbytes
    one dK/dV accumulator (float32 or wider). named: each op carries a fourth item naming its message
    (pass, block owner, step), so that p2p_plan.check also proves every receive gets its intended block."""
    out = []
    for r in range(cp):
        nxt, prev = (r + 1) % cp, (r - 1) % cp

        def batch(step, *kinds, pass_):
            # before `step`, rank r sends what it held at step−1 and receives the block of rank r − step
            sends = [("send", nxt, nbytes, (pass_, kind, (r - step + 1) % cp, step)) for kind, nbytes in kinds]
            recvs = [("recv", prev, nbytes, (pass_, kind, (r - step) % cp, step)) for kind, nbytes in kinds]
            return sends + recvs

        kv, grad_kv = ("kv", kv_nbytes), ("grad_kv", grad_kv_nbytes)
        forward = [batch(t, kv, pass_="forward") for t in range(1, cp)]
        backward = [batch(t, kv, *([grad_kv] if t > 1 else []), pass_="backward") for t in range(1, cp)]
        backward += [batch(cp, grad_kv, pass_="backward")] if cp > 1 else []   # step cp: home to the owner
        out.append([[op if named else op[:3] for op in b] for b in forward + backward])
    return out
