"""Context-parallel attention by all-to-all (parallelism.cp_mode=ulysses), DeepSpeed Ulysses' recipe (Jacobs et al.
2023, arXiv:2309.14509): a cp rank holds two zig-zag chunks of every sequence with all of its tp share of the heads;
ONE all-to-all of q, k and v gives it the whole sequence for 1/cp of those heads, plain attention runs on it (the
model's `auto` kernel: flash-attn or SDPA, causal or within documents), and ONE all-to-all of the output gives the
chunks back with all their heads. The backward is the two all-to-alls reversed (a permutation's adjoint is its
inverse) around the kernel's own backward. Every cp rank posts the same collectives in the same order.

Beside the ring and the all-gather: no tiles or log-sum-exp merging of its own, and a rank sends (cp − 1)/cp of its
q, k, v and output per pass (and as much back in the backward) instead of K/V cp − 1 times; the heads per tp rank
must divide by cp. K/V heads that do not are repeated to lcm(kv heads, cp), which divides the query heads: exact,
a repeated head is the same head and autograd sums its gradients back. With document masking each rank all-gathers
the chunks' document starts (int64, [b, s/cp]) to mask the whole sequence; no ids travel.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from nanoexp.model.attention import Causal, Documents, FlashAttention
from nanoexp.parallel.collectives import all_gather_into
from nanoexp.parallel.context_parallel.zigzag import rank_chunks

LOCAL_ATTENTION = FlashAttention()   # model.attention_kernel=auto: flash-attn on CUDA in half precision, else SDPA


def _placements(cp: int) -> list[tuple[int, int, int]]:
    """(cp rank, half of what it holds, sequence chunk) for every one of the 2·cp chunks."""
    return [(rank, half, chunk) for rank in range(cp) for half, chunk in enumerate(rank_chunks(cp, rank))]


def _offsets(widths: list[int]) -> list[int]:
    return [sum(widths[:i]) for i in range(len(widths))]


def _exchange(send: torch.Tensor, group) -> torch.Tensor:
    """ONE all-to-all over the cp group: send[i] goes to cp rank i; returns received[i], from cp rank i."""
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received


def to_heads(tensors, group, cp: int) -> list[torch.Tensor]:
    """Each [b, h_i, s/cp, d] of this rank's zig-zag chunks -> [b, h_i/cp, s, d]: on cp rank j the j-th block of
    h_i/cp heads over the whole sequence, in order. One all-to-all carries all of them."""
    b, _, local, d = tensors[0].shape
    widths = [x.shape[1] // cp for x in tensors]
    send = tensors[0].new_empty(cp, b, sum(widths), local, d)
    for x, at, w in zip(tensors, _offsets(widths), widths):
        send[:, :, at:at + w] = x.unflatten(1, (cp, w)).transpose(0, 1)   # head block j to rank j
    received = _exchange(send, group).unflatten(3, (2, local // 2))      # [cp, b, W, 2, c, d]: rank i's chunks
    outs = [received.new_empty(b, w, 2 * cp, local // 2, d) for w in widths]
    for out, at, w in zip(outs, _offsets(widths), widths):
        for rank, half, chunk in _placements(cp):
            out[:, :, chunk] = received[rank, :, at:at + w, half]
    return [out.flatten(2, 3) for out in outs]


def to_chunks(tensors, group, cp: int) -> list[torch.Tensor]:
    """The inverse of to_heads: each [b, w_i, s, d] -> [b, cp·w_i, s/cp, d] of this rank's zig-zag chunks."""
    b, _, seq, d = tensors[0].shape
    widths, c = [x.shape[1] for x in tensors], seq // (2 * cp)
    send = tensors[0].new_empty(cp, b, sum(widths), 2, c, d)
    for x, at, w in zip(tensors, _offsets(widths), widths):
        chunks = x.unflatten(2, (2 * cp, c))
        for rank, half, chunk in _placements(cp):
            send[rank, :, at:at + w, half] = chunks[:, :, chunk]
    received = _exchange(send.flatten(3, 4), group)   # [cp, b, W, s/cp, d]: from rank j its head block j
    return [received[:, :, at:at + w].transpose(0, 1).flatten(1, 2) for at, w in zip(_offsets(widths), widths)]


class _AllToAll(torch.autograd.Function):
    """to_heads (heads_first) or to_chunks forward; the other one backward."""

    @staticmethod
    def forward(ctx, heads_first: bool, group, cp: int, *tensors):
        ctx.exchange = heads_first, group, cp
        return tuple((to_heads if heads_first else to_chunks)(tensors, group, cp))

    @staticmethod
    def backward(ctx, *grads):
        heads_first, group, cp = ctx.exchange
        return (None, None, None, *(to_chunks if heads_first else to_heads)(grads, group, cp))


def whole_starts(starts: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[b, s/cp] document starts of this rank's chunks -> [b, s], the whole sequence's in order (ONE all-gather)."""
    b, local = starts.shape
    gathered = starts.new_empty(cp * b, local)
    all_gather_into(gathered, starts.contiguous(), group)
    gathered = gathered.view(cp, b, 2, local // 2)
    whole = starts.new_empty(b, 2 * cp, local // 2)
    for rank, half, chunk in _placements(cp):
        whole[:, chunk] = gathered[rank, :, half]
    return whole.flatten(1)


def kv_repeats(kv_heads: int, cp: int) -> int:
    """How many copies of each KV head make their count divisible by cp: lcm(kv_heads, cp) / kv_heads."""
    return cp // math.gcd(kv_heads, cp)


def ulysses_attention(q, k, v, group=None, cp: int = 1, cp_rank: int = 0, scale: float | None = None,
                      starts: torch.Tensor | None = None):
    """Exact causal attention over the whole sequence from this cp rank's two zig-zag chunks, by an all-to-all
    to head shards and back. The interface of ring_attention: q [b, heads, s_local, d], k/v [b, kv_heads, s_local,
    d] (kv_heads divides heads, cp divides heads), s_local = 2 chunks in the order zigzag_split gives; returns
    [b, heads, s_local, d]. `group` is the cp process group (None: the default group) of cp ranks; cp = 1
    communicates nothing. Document masking: starts [b, s_local] (zigzag.document_starts)."""
    if q.shape[1] % k.shape[1] or k.shape != v.shape or q.shape[2] != k.shape[2] or q.shape[2] % 2 or q.shape[1] % cp:
        raise ValueError(f"ulysses_attention needs q [b, h, s, d], k/v [b, kvh, s, d] with kvh dividing h, cp={cp} "
                         f"dividing h and s even; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if cp > 1:
        starts = None if starts is None else whole_starts(starts, group, cp)
        repeats = kv_repeats(k.shape[1], cp)
        k, v = (k, v) if repeats == 1 else (k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1))
        q, k, v = _AllToAll.apply(True, group, cp, q, k, v)
    mask = Causal() if starts is None else Documents(starts, torch.arange(q.shape[2], device=q.device) - starts)
    out = LOCAL_ATTENTION(q, k, v, scale, mask)
    return out if cp == 1 else _AllToAll.apply(False, group, cp, out)[0]


# -- its facts (CP_KERNELS' entry; `a` is a RankAttention) ----------------------------------------

def _repeated_kv_heads(a) -> int:
    return a.kv_heads * kv_repeats(a.kv_heads, a.cp)


def saved_floats(a) -> float:
    """Per local token: o_proj's copy of the output in chunk layout beside the kernel's in head layout (as the
    ring's), and the repeated K/V heads' share the kernel saves beyond one process's K/V."""
    return a.heads * a.head_dim + 2 * (_repeated_kv_heads(a) - a.kv_heads) * a.head_dim


def workspace_bytes(a) -> float:
    """While q, k, v change layout: the chunk-layout inputs (still referenced by the layer), the all-to-all's
    send buffer and what it receives, in the activation dtype (estimated from the copies, not measured)."""
    return 3 * a.act_bytes * a.batch * a.local_tokens * (a.heads + 2 * _repeated_kv_heads(a)) * a.head_dim


def sent_bytes(a, forwards: int) -> float:
    """(cp − 1)/cp of q, k, v and the output each forward; of their gradients once backward; with document
    masking the int64 starts all-gathered each forward."""
    floats = 2 * (a.heads + _repeated_kv_heads(a)) * a.batch * a.local_tokens * a.head_dim
    starts = 8 * a.batch * a.local_tokens * (a.cp - 1) if a.documents else 0
    return (forwards + 1) * floats * a.act_bytes * (a.cp - 1) / a.cp + forwards * starts


def problems(cfg, layout) -> list[str]:
    """Each cp rank attends with heads / (cp·tp) of the query heads (K/V heads are repeated to fit)."""
    heads, cp, tp = cfg.model.model_config.num_attention_heads, layout.cp, layout.tp
    if heads % (cp * tp) == 0:
        return []
    return [(f"model.model_config.num_attention_heads={heads} is not divisible by parallelism.cp * tp = {cp}*{tp}: "
             "parallelism.cp_mode=ulysses gives each rank heads / (cp·tp) of the heads over the whole sequence; "
             "change the head count or use parallelism.cp_mode=ring")]
