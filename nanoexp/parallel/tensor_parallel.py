"""Tensor parallelism: sharded Linear / Embedding layers and a vocab-parallel cross-entropy.

A tensor-parallel (tp) group of ranks splits each large weight; the layers below declare which
dimension they split (``placement.place(param, split_dim=...)``; none: replicated on every tp rank).
Initialisation and checkpoint loading build full tensors and cut them with ``shard_tensor``,
so the layers only allocate (``torch.empty``).

Two activation layouts between layers:
  * all-reduce mode: activations are replicated on every tp rank, ``[b, s, h]``;
  * sequence-parallel (SP) mode: each tp rank holds a contiguous chunk of the sequence,
    ``[b, s // tp, h]`` (rank r holds positions r*s/tp .. (r+1)*s/tp).

Every communication is one of the small autograd functions below, each paired with its
conjugate in backward (identity <-> all-reduce, all-gather <-> reduce-scatter, split <->
all-gather). With ``ctx.tp == 1`` nothing communicates and nothing is copied: the layers are
exactly ``F.linear`` / ``F.embedding`` / ``F.cross_entropy``.

Collectives run on the tp group, in the dtype they receive (bf16 under autocast), and always
on contiguous tensors: gloo silently mis-reduces non-contiguous views.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.placement import place, placement


# -- raw collectives on the tp group (contiguous in, new contiguous tensor out) ---------------
def _all_reduce(x: torch.Tensor, pc: ParallelContext, op=dist.ReduceOp.SUM) -> torch.Tensor:
    # A fresh buffer: never reduce a view (gloo) and never modify an autograd input in place.
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=pc.tp_group)
    return out


def _check_seq(x: torch.Tensor, pc: ParallelContext):
    if x.shape[1] % pc.tp != 0:
        raise ValueError(f"sequence parallelism needs the sequence ({x.shape[1]}) divisible by the "
                         f"tensor-parallel size ({pc.tp})")


def _all_gather_seq(x: torch.Tensor, pc: ParallelContext) -> torch.Tensor:
    """[b, s/tp, ...] chunks from every rank -> [b, s, ...] in rank order."""
    x = x.contiguous()
    chunks = [torch.empty_like(x) for _ in range(pc.tp)]
    dist.all_gather(chunks, x, group=pc.tp_group)
    return torch.cat(chunks, dim=1)


def _reduce_scatter_seq(x: torch.Tensor, pc: ParallelContext) -> torch.Tensor:
    """[b, s, ...] partial sums on every rank -> this rank's [b, s/tp, ...] chunk of the sum."""
    _check_seq(x, pc)
    chunks = [c.contiguous() for c in x.chunk(pc.tp, dim=1)]
    out = torch.empty_like(chunks[pc.tp_rank])
    dist.reduce_scatter(out, chunks, group=pc.tp_group)
    return out


def _split_seq(x: torch.Tensor, pc: ParallelContext) -> torch.Tensor:
    """[b, s, ...] replicated -> this rank's [b, s/tp, ...] chunk (no communication)."""
    _check_seq(x, pc)
    return x.chunk(pc.tp, dim=1)[pc.tp_rank].contiguous()


# -- autograd functions: a forward collective and its conjugate in backward -------------------
# (`ctx` is autograd's context by PyTorch convention; the ParallelContext is `pc`.)
class _CopyToTP(torch.autograd.Function):
    """f: identity forward; backward sums the input gradient (each rank used x for its shard)."""
    @staticmethod
    def forward(ctx, x, pc):
        ctx.pc = pc
        return x.view_as(x)  # a view, so autograd records this node without copying

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.pc), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (sum of partial results); identity backward."""
    @staticmethod
    def forward(ctx, x, pc):
        return _all_reduce(x, pc)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSeqReduceScatterGrad(torch.autograd.Function):
    """SP input of a column-parallel layer: gather the sequence; every rank's gradient w.r.t.
    the full sequence is partial (it covers only its output shard), so reduce-scatter it."""
    @staticmethod
    def forward(ctx, x, pc):
        ctx.pc = pc
        return _all_gather_seq(x, pc)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.pc), None


class _ReduceScatterSeq(torch.autograd.Function):
    """SP output of a row-parallel layer: sum partials and keep this rank's sequence chunk."""
    @staticmethod
    def forward(ctx, x, pc):
        ctx.pc = pc
        return _reduce_scatter_seq(x, pc)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.pc), None


class _GatherSeq(torch.autograd.Function):
    """Gather the sequence for a computation replicated on every rank: backward keeps the chunk."""
    @staticmethod
    def forward(ctx, x, pc):
        ctx.pc = pc
        return _all_gather_seq(x, pc)

    @staticmethod
    def backward(ctx, grad):
        return _split_seq(grad, ctx.pc), None


class _ScatterSeq(torch.autograd.Function):
    """Enter SP from a replicated tensor: keep this rank's chunk; backward gathers the chunks."""
    @staticmethod
    def forward(ctx, x, pc):
        ctx.pc = pc
        return _split_seq(x, pc)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.pc), None


def copy_to_tp(x: torch.Tensor, pc: ParallelContext) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient in backward (returns x itself if tp == 1)."""
    return x if pc.tp == 1 else _CopyToTP.apply(x, pc)


def reduce_from_tp(x: torch.Tensor, pc: ParallelContext) -> torch.Tensor:
    """All-reduce (sum) forward, identity backward (returns x itself if tp == 1)."""
    return x if pc.tp == 1 else _ReduceFromTP.apply(x, pc)


def gather_from_sequence_parallel(x: torch.Tensor, pc: ParallelContext) -> torch.Tensor:
    """[b, s/tp, ...] -> [b, s, ...]; backward keeps this rank's chunk of the gradient.
    Use it before a computation that every tp rank repeats identically."""
    return x if pc.tp == 1 else _GatherSeq.apply(x, pc)


def scatter_to_sequence_parallel(x: torch.Tensor, pc: ParallelContext) -> torch.Tensor:
    """[b, s, ...] replicated -> this rank's [b, s/tp, ...]; backward all-gathers the gradient.
    Raises ValueError if s is not divisible by tp."""
    return x if pc.tp == 1 else _ScatterSeq.apply(x, pc)


def column_input(x: torch.Tensor, pc: ParallelContext, sequence_parallel: bool) -> torch.Tensor:
    """The input every column-parallel layer needs: replicated (backward: all-reduce of the
    gradient) or, under sequence parallelism, the whole sequence gathered (backward:
    reduce-scatter). Layers that read the same input (q, k, v; gate, up) share one call, so a
    block communicates once per input instead of once per layer."""
    if pc.tp == 1:
        return x
    return _GatherSeqReduceScatterGrad.apply(x, pc) if sequence_parallel else _CopyToTP.apply(x, pc)


# -- layers ----------------------------------------------------------------------------------
def _divide(n: int, tp: int, what: str) -> int:
    if n % tp != 0:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {tp}")
    return n // tp


def _param(*shape: int, split_dim: int | None) -> nn.Parameter:
    # Filled later by the model's init, from full tensors.
    return place(nn.Parameter(torch.empty(*shape)), split_dim=split_dim)


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W split by output rows: each rank returns its [b, s, out/tp] slice.

    Input: [b, s, in] replicated (all-reduce mode) or [b, s/tp, in] (sequence_parallel=True).
    The weight is [out/tp, in], split on dim 0; a bias is sharded the same way.
    """

    def __init__(self, in_features, out_features, ctx, *, bias=False, sequence_parallel=False):
        super().__init__()
        self.ctx, self.sequence_parallel = ctx, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        local_out = _divide(out_features, ctx.tp, "out_features")
        self.weight = _param(local_out, in_features, split_dim=0)
        self.bias = _param(local_out, split_dim=0) if bias else None

    def forward(self, x, input_is_ready: bool = False):
        """input_is_ready: x already went through column_input (shared by several layers)."""
        if not input_is_ready:
            x = column_input(x, self.ctx, self.sequence_parallel)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features} (split over tp={self.ctx.tp}), "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """y = x W^T (+ b) with W split by input columns: each rank multiplies its [b, s, in/tp]
    slice of x and the partial results are summed over tp.

    Output: [b, s, out] replicated (all-reduce mode) or [b, s/tp, out] (sequence_parallel=True).
    The weight is [out, in/tp], split on dim 1; a bias is replicated, added once after the sum.
    In SP mode each rank's bias gradient covers only its sequence chunk, so the bias is placed
    ``sequence_parallel`` (its grad must be summed over tp).
    """

    def __init__(self, in_features, out_features, ctx, *, bias=False, sequence_parallel=False):
        super().__init__()
        self.ctx, self.sequence_parallel = ctx, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param(out_features, _divide(in_features, ctx.tp, "in_features"), split_dim=1)
        self.bias = _param(out_features, split_dim=None) if bias else None
        if self.bias is not None and sequence_parallel and ctx.tp > 1:
            place(self.bias, sequence_parallel=True)

    def forward(self, x):
        if self.ctx.tp == 1:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight)  # partial sum: the bias must be added once, after the sum
        if self.sequence_parallel:
            y = _ReduceScatterSeq.apply(y, self.ctx)
        else:
            y = _ReduceFromTP.apply(y, self.ctx)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return (f"in={self.in_features} (split over tp={self.ctx.tp}), out={self.out_features}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split by rows: rank r holds ids [r*V/tp, (r+1)*V/tp).

    Each rank looks up the ids it owns (zeros elsewhere) and the partial lookups are summed:
    ids [b, s] (replicated) -> [b, s, H] replicated, or [b, s/tp, H] with sequence_parallel.
    """

    def __init__(self, num_embeddings, embedding_dim, ctx, *, sequence_parallel=False):
        super().__init__()
        self.ctx, self.sequence_parallel = ctx, sequence_parallel
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.local_vocab = _divide(num_embeddings, ctx.tp, "vocab_size")
        self.vocab_start = ctx.tp_rank * self.local_vocab
        self.weight = _param(self.local_vocab, embedding_dim, split_dim=0)

    def forward(self, ids):
        if self.ctx.tp == 1:
            return F.embedding(ids, self.weight)
        local_ids = ids - self.vocab_start
        foreign = (local_ids < 0) | (local_ids >= self.local_vocab)
        # Look up row 0 for foreign ids, then zero them: their gradient is zeroed with them.
        out = F.embedding(local_ids.masked_fill(foreign, 0), self.weight)
        out.masked_fill_(foreign.unsqueeze(-1), 0.0)  # in place: embedding backward keeps no output
        if self.sequence_parallel:
            return _ReduceScatterSeq.apply(out, self.ctx)
        return _ReduceFromTP.apply(out, self.ctx)

    def extra_repr(self):
        return (f"{self.num_embeddings}, {self.embedding_dim} (vocab split over tp={self.ctx.tp}), "
                f"sequence_parallel={self.sequence_parallel}")


# -- vocab-parallel cross-entropy ------------------------------------------------------------
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """loss = logsumexp(logits) - logits[target], with the vocab split across tp ranks.

    Only three [N]-sized all-reduces cross the wire (max, sum of exp, target logit); the local
    softmax shard is kept for backward: d loss / d logits = softmax - onehot(target).
    """

    @staticmethod
    def forward(ctx, logits, targets, pc, ignore_index):
        local_vocab = logits.shape[-1]
        with torch.autocast(logits.device.type, enabled=False):  # float32 math, whatever autocast says
            x = logits.float()
            # Subtract the global max so exp() cannot overflow.
            x = x - _all_reduce(x.amax(dim=-1), pc, dist.ReduceOp.MAX).unsqueeze(-1)
            local_t = targets - pc.tp_rank * local_vocab
            ignored = targets == ignore_index
            mine = (local_t >= 0) & (local_t < local_vocab) & ~ignored
            local_t = local_t.masked_fill(~mine, 0)
            target_logit = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
            target_logit = _all_reduce(target_logit, pc)
            softmax = x.exp_()  # x is our own buffer: reuse it
            sum_exp = _all_reduce(softmax.sum(dim=-1), pc)
            loss = sum_exp.log() - target_logit
            softmax.div_(sum_exp.unsqueeze(-1))
        loss = loss.masked_fill(ignored, 0.0)
        ctx.save_for_backward(softmax, local_t, mine, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, mine, ignored = ctx.saved_tensors
        g = grad_loss.float().masked_fill(ignored, 0.0).unsqueeze(-1)
        # Out of place, so the saved softmax stays valid if backward runs twice (retain_graph).
        grad = softmax * g
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -(g * mine.unsqueeze(-1)))  # the -onehot term
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ctx: ParallelContext,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy, float32, shape of ``targets``, from this rank's vocab shard.

    logits: [..., V/tp] (any float dtype), this rank's columns r*V/tp .. (r+1)*V/tp.
    targets: [...] global token ids; ``ignore_index`` tokens get loss 0 and no gradient.
    No rank ever holds full-vocab logits. With tp == 1 this is F.cross_entropy(reduction='none').
    """
    if ctx.tp == 1:
        flat = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               reduction="none", ignore_index=ignore_index)
        return flat.view(targets.shape)
    return _VocabParallelCrossEntropy.apply(logits, targets, ctx, ignore_index)


# -- sharding helper for init and checkpoint loading -----------------------------------------
def shard_tensor(full: torch.Tensor, param_or_dim, ctx: ParallelContext) -> torch.Tensor:
    """This rank's slice of ``full`` along the split dimension, contiguous.

    ``param_or_dim`` is a parameter (its placement's ``split_dim`` is used), an int dimension, or
    None (replicated: ``full`` itself is returned). The result may share storage with ``full``;
    copy it into the parameter rather than keeping it.
    """
    dim = placement(param_or_dim).split_dim if isinstance(param_or_dim, torch.Tensor) else param_or_dim
    if dim is None or ctx.tp == 1:
        return full
    _divide(full.shape[dim], ctx.tp, f"dimension {dim} of a {tuple(full.shape)} tensor")
    return full.chunk(ctx.tp, dim=dim)[ctx.tp_rank].contiguous()
