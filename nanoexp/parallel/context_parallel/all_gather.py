"""Context-parallel attention by one all-gather of K/V (parallelism.cp_mode=all_gather), Llama 3's recipe (Dubey et
al. 2024, section 3.3.2): every cp rank gathers the keys and values of the whole sequence and attends with its own
queries. Beside the ring it trades overlap for simplicity: under GQA K/V are small next to Q, and one large
collective is easier to run than cp − 1 point-to-point steps. Same zig-zag layout and blocks as the ring (so the
same balanced work), tiles merged by log-sum-exp (blocks.py). Forward: ONE all-gather of K and V stacked, the
attention to the rank's own K/V running while it is in flight; the gathered K/V are saved for backward. Backward:
probabilities recomputed from the saved log-sum-exp, dK/dV of every gathered chunk in one float32 buffer, ONE
reduce-scatter back to their owners. Every cp rank posts the same two collectives in the same order."""
from __future__ import annotations

import math

import torch

from nanoexp.parallel.context_parallel.blocks import attend_block, attend_block_backward
from nanoexp.parallel.collectives import all_gather_into, reduce_scatter_into
from nanoexp.parallel.context_parallel import ring
from nanoexp.parallel.context_parallel.ring import ring_blocks
from nanoexp.parallel.context_parallel.zigzag import chunk_start


def gather_blocks(cp: int, cp_rank: int) -> dict[int, list[tuple[int, int, bool]]]:
    """Per source cp rank, the blocks this rank computes against that rank's K/V: (query half, key half,
    causal), halves 0 and 1 of the local chunks. The ring's blocks, indexed by the K/V's owner instead of
    by the step at which they arrive (step t holds rank (cp_rank − t) mod cp)."""
    return {(cp_rank - t) % cp: blocks for t, blocks in enumerate(ring_blocks(cp, cp_rank))}


def _halves(x, dim=2):
    return x.chunk(2, dim)


def _documents(starts, q_half: int, source: int, k_half: int, local_len: int, cp: int) -> dict:
    """attend_block's document-masking arguments (none without document masking): the query half's document
    starts and the sequence index of the first key of half k_half of rank `source`'s chunks."""
    if starts is None:
        return {}
    return dict(starts=_halves(starts, dim=1)[q_half], key_start=chunk_start(local_len, cp, source, k_half))


def _start_gather(kv, group, cp):
    """Post the all-gather of this rank's stacked K/V [2, ...]; returns (work, [cp, 2, ...] buffer)."""
    gathered = torch.empty((cp,) + kv.shape, dtype=kv.dtype, device=kv.device)
    if cp == 1:
        gathered[0] = kv
        return None, gathered
    # rank i's [2, ...] lands in rows 2i, 2i+1 of the concatenated view, i.e. gathered[i]
    work = all_gather_into(gathered.flatten(0, 1), kv, group=group, async_op=True)
    return work, gathered


def _reduce_scatter(grad_gathered, group, cp):
    """Sum the [cp, 2, ...] dK/dV of every rank; rank i keeps the [2, ...] sum for its own K/V."""
    if cp == 1:
        return grad_gathered[0]
    grad_kv = torch.empty(grad_gathered.shape[1:], dtype=grad_gathered.dtype, device=grad_gathered.device)
    reduce_scatter_into(grad_kv, grad_gathered.flatten(0, 1), group=group)
    return grad_kv


class _AllGatherAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, group, cp, cp_rank, scale, starts):
        acc = torch.promote_types(q.dtype, torch.float32)   # softmax statistics and sums in at least float32
        q, kv = q.contiguous(), torch.stack([k, v]).contiguous()   # K and V are gathered as one message
        work, gathered = _start_gather(kv, group, cp)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        out_halves, lse_halves, q_halves = _halves(out), _halves(lse), _halves(q.to(acc))

        def attend(source, source_kv, blocks):
            k_halves, v_halves = _halves(source_kv[0].to(acc)), _halves(source_kv[1].to(acc))
            for qi, ki, causal in blocks:
                attend_block(q_halves[qi], k_halves[ki], v_halves[ki], scale, causal, out_halves[qi], lse_halves[qi],
                             **_documents(starts, qi, source, ki, q.shape[2], cp))

        blocks = gather_blocks(cp, cp_rank)
        attend(cp_rank, kv, blocks[cp_rank])   # our own K/V, while the gather is in flight
        if work is not None:
            work.wait()
        for source in range(cp):
            if source != cp_rank:
                attend(source, gathered[source], blocks[source])
        out = out.to(q.dtype)
        ctx.save_for_backward(q, gathered, out, lse)
        ctx.gather = group, cp, cp_rank, scale, starts
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, gathered, out, lse = ctx.saved_tensors
        group, cp, cp_rank, scale, starts = ctx.gather
        acc = lse.dtype
        delta = (grad_out.to(acc) * out.to(acc)).sum(-1)
        rows = list(zip(_halves(q.to(acc)), _halves(grad_out.to(acc)), _halves(lse), _halves(delta)))
        grad_q = torch.zeros(q.shape, dtype=acc, device=q.device)
        grad_gathered = torch.zeros(gathered.shape, dtype=acc, device=q.device)   # dK/dV of every rank's chunks
        grad_q_halves = _halves(grad_q)
        for source, blocks in gather_blocks(cp, cp_rank).items():
            k_halves, v_halves = _halves(gathered[source, 0].to(acc)), _halves(gathered[source, 1].to(acc))
            gk_halves, gv_halves = _halves(grad_gathered[source, 0]), _halves(grad_gathered[source, 1])
            for qi, ki, causal in blocks:
                q_rows, grad_out_rows, lse_rows, delta_rows = rows[qi]
                attend_block_backward(q_rows, k_halves[ki], v_halves[ki], grad_out_rows, lse_rows, delta_rows,
                                      scale, causal, grad_q_halves[qi], gk_halves[ki], gv_halves[ki],
                                      **_documents(starts, qi, source, ki, q.shape[2], cp))
        grad_kv = _reduce_scatter(grad_gathered, group, cp)
        return (grad_q.to(q.dtype), grad_kv[0].to(gathered.dtype), grad_kv[1].to(gathered.dtype),
                None, None, None, None, None)


def all_gather_attention(q, k, v, group=None, cp: int = 1, cp_rank: int = 0, scale: float | None = None,
                         starts: torch.Tensor | None = None):
    """Exact causal attention over the whole sequence from this cp rank's two zig-zag chunks, by one
    all-gather of K/V forward and one reduce-scatter of dK/dV backward. The interface of ring_attention:
    q [b, heads, s_local, d], k/v [b, kv_heads, s_local, d] (kv_heads divides heads), s_local = 2 chunks in
    the order zigzag_split gives; returns [b, heads, s_local, d]. Scores q·k · scale (None: 1/sqrt(d)).
    `group` is the cp process group (None: the default group) of cp ranks; cp = 1 communicates nothing.
    Document masking: starts [b, s_local] (ring_attention.document_starts) hides the keys before each query's
    document, as in ring_attention; no ids travel."""
    if q.shape[1] % k.shape[1] or k.shape != v.shape or q.shape[2] != k.shape[2] or q.shape[2] % 2:
        raise ValueError(f"all_gather_attention needs q [b, h, s, d], k/v [b, kvh, s, d] with kvh dividing h and "
                         f"s even; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _AllGatherAttention.apply(q, k, v, group, cp, cp_rank, scale, starts)


# -- its facts (CP_KERNELS' entry; `a` is a RankAttention) ----------------------------------------

def saved_floats(a) -> float:
    """Per local token: the ring's output copy, and the K/V of every cp rank's chunks saved instead of its own:
    cp − 1 more K/V."""
    return ring.saved_floats(a) + (a.cp - 1) * 2 * a.kv_heads * a.head_dim


def workspace_bytes(a) -> float:
    """The ring's tile, and in the backward the float32 dK/dV of all cp ranks' K/V (the whole sequence's) and
    the reduce-scatter's 1/cp of it for this rank."""
    kv = 2 * a.batch * a.kv_heads * a.head_dim   # K and V, per token
    return ring.workspace_bytes(a) + 4 * kv * a.sequence * (1 + 1 / a.cp)


def sent_bytes(a, forwards: int) -> float:
    """K/V all-gathered once a forward ((cp − 1) x this rank's), the float32 dK/dV reduce-scattered once."""
    kv = 2 * a.batch * a.kv_heads * a.local_tokens * a.head_dim
    return (a.cp - 1) * (forwards * kv * a.act_bytes + kv * 4)
