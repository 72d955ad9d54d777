"""Tensor parallelism: sharded linear and embedding layers, a vocab-parallel cross-entropy, and
`apply_tensor_parallel`, which tensor_parallel_plan.py puts into a plain model by a plan (which layer is split how).

A tensor-parallel (tp) group of ranks splits each large weight; the layers below declare which dimension they split
and which part a rank holds (``placement.place``), which is all that initialisation, checkpoints and Hugging Face
weights need to cut full tensors.
Two activation layouts between layers:
  * all-reduce mode: activations are replicated on every tp rank, ``[b, s, h]``;
  * sequence-parallel (SP) mode: each tp rank holds a contiguous chunk of the sequence,
    ``[b, s // tp, h]`` (rank r holds positions r*s/tp .. (r+1)*s/tp).
Every communication is one of the small autograd functions below, each paired with its conjugate in backward
(identity <-> all-reduce, all-gather <-> reduce-scatter). Collectives run on the tp group (`axis`: group, size, this
rank), in the dtype they receive (bf16 under autocast), and always on contiguous tensors: gloo silently mis-reduces
non-contiguous views.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from nanoexp.model.linear import Linear
from nanoexp.parallel.context import Axis
from nanoexp.model.placement import place


# -- raw collectives on the tp group (contiguous in, new contiguous tensor out) ---------------
def _all_reduce(x: torch.Tensor, axis: Axis, op=dist.ReduceOp.SUM) -> torch.Tensor:
    # A fresh buffer: never reduce a view (gloo) and never modify an autograd input in place.
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=op, group=axis.group)
    return out


def _check_seq(x: torch.Tensor, axis: Axis):
    if x.shape[1] % axis.size != 0:
        raise ValueError(f"sequence parallelism needs the sequence ({x.shape[1]}) divisible by the "
                         f"tensor-parallel size ({axis.size})")


def _all_gather_seq(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """[b, s/tp, ...] chunks from every rank -> [b, s, ...] in rank order."""
    x = x.contiguous()
    chunks = [torch.empty_like(x) for _ in range(axis.size)]
    dist.all_gather(chunks, x, group=axis.group)
    return torch.cat(chunks, dim=1)


def _reduce_scatter_seq(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """[b, s, ...] partial sums on every rank -> this rank's [b, s/tp, ...] chunk of the sum."""
    _check_seq(x, axis)
    chunks = [c.contiguous() for c in x.chunk(axis.size, dim=1)]
    out = torch.empty_like(chunks[axis.rank])
    dist.reduce_scatter(out, chunks, group=axis.group)
    return out



# -- autograd functions: a forward collective and its conjugate in backward -------------------
# (`ctx` is autograd's context by PyTorch convention; the tp group is `axis`.)
class _CopyToTP(torch.autograd.Function):
    """f: identity forward; backward sums the input gradient (each rank used x for its shard)."""
    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x.view_as(x)  # a view, so autograd records this node without copying

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.axis), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (sum of partial results); identity backward."""
    @staticmethod
    def forward(ctx, x, axis):
        return _all_reduce(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSeqReduceScatterGrad(torch.autograd.Function):
    """SP input of a column-parallel layer: gather the sequence; every rank's gradient w.r.t.
    the full sequence is partial (it covers only its output shard), so reduce-scatter it."""
    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return _all_gather_seq(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.axis), None


class _ReduceScatterSeq(torch.autograd.Function):
    """SP output of a row-parallel layer: sum partials and keep this rank's sequence chunk."""
    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return _reduce_scatter_seq(x, axis)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.axis), None


def column_input(x: torch.Tensor, axis: Axis, sequence_parallel: bool) -> torch.Tensor:
    """The input every column-parallel layer needs: replicated (backward: all-reduce of the
    gradient) or, under sequence parallelism, the whole sequence gathered (backward:
    reduce-scatter). Layers that read the same input (q, k, v; gate, up) share one call, so a
    block communicates once per input instead of once per layer."""
    if axis.size == 1:
        return x
    return _GatherSeqReduceScatterGrad.apply(x, axis) if sequence_parallel else _CopyToTP.apply(x, axis)


# -- layers ----------------------------------------------------------------------------------
def _divide(n: int, tp: int, what: str) -> int:
    if n % tp != 0:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {tp}")
    return n // tp


def _param(*shape: int, split_dim: int | None, axis: Axis) -> nn.Parameter:
    # Filled later by the model's init, from full tensors.
    parts = dict(parts=axis.size, part=axis.rank) if split_dim is not None else {}
    return place(nn.Parameter(torch.empty(*shape)), split_dim=split_dim, **parts)


class ColumnParallelLinear(Linear):
    """y = x W^T (+ b) with W split by output rows: each rank returns its [b, s, out/tp] slice.

    Input: [b, s, in] replicated (all-reduce mode) or [b, s/tp, in] (sequence_parallel=True), made ready for the
    product by `column_input` here, or before (`gather_input=False`: a ColumnInput shared by the layers that read
    the same input). The weight is [out/tp, in], split on dim 0; a bias is sharded the same way.
    """

    def __init__(self, in_features, out_features, axis: Axis, *, bias=False, sequence_parallel=False,
                 gather_input=True):
        super().__init__(in_features, _divide(out_features, axis.size, "out_features"))
        self.axis, self.sequence_parallel, self.gather_input = axis, sequence_parallel, gather_input
        self.out_features = out_features
        self.weight = _param(*self.weight.shape, split_dim=0, axis=axis)
        self.bias = _param(self.weight.shape[0], split_dim=0, axis=axis) if bias else None

    def forward(self, x):
        if self.gather_input:
            x = column_input(x, self.axis, self.sequence_parallel)
        y = self.matmul(x, self.weight, self)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features} (split over tp={self.axis.size}), "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}" + self.format_repr())


class RowParallelLinear(Linear):
    """y = x W^T (+ b) with W split by input columns: each rank multiplies its [b, s, in/tp] slice of x and the
    partial results are summed over tp.

    Output: [b, s, out] replicated (all-reduce mode) or [b, s/tp, out] (sequence_parallel=True). The weight is
    [out, in/tp], split on dim 1; a bias is replicated, added once after the sum. In SP mode each rank's bias
    gradient covers only its sequence chunk, so the bias is placed ``sequence_parallel`` (its grad is summed
    over tp).
    """

    def __init__(self, in_features, out_features, axis: Axis, *, bias=False, sequence_parallel=False):
        super().__init__(_divide(in_features, axis.size, "in_features"), out_features)
        self.axis, self.sequence_parallel = axis, sequence_parallel
        self.in_features = in_features
        self.weight = _param(*self.weight.shape, split_dim=1, axis=axis)
        self.bias = _param(out_features, split_dim=None, axis=axis) if bias else None
        if self.bias is not None and sequence_parallel and axis.size > 1:
            place(self.bias, sequence_parallel=True)

    def forward(self, x):
        y = self.matmul(x, self.weight, self)   # partial sum: the bias must be added once, after the sum
        if self.axis.size > 1:
            y = _ReduceScatterSeq.apply(y, self.axis) if self.sequence_parallel else _ReduceFromTP.apply(y, self.axis)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return (f"in={self.in_features} (split over tp={self.axis.size}), out={self.out_features}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}" + self.format_repr())


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split by rows: rank r holds ids [r*V/tp, (r+1)*V/tp).

    Each rank looks up the ids it owns (zeros elsewhere) and the partial lookups are summed:
    ids [b, s] (replicated) -> [b, s, H] replicated, or [b, s/tp, H] with sequence_parallel.
    """

    def __init__(self, num_embeddings, embedding_dim, axis: Axis, *, sequence_parallel=False):
        super().__init__()
        self.axis, self.sequence_parallel = axis, sequence_parallel
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.local_vocab = _divide(num_embeddings, axis.size, "vocab_size")
        self.vocab_start = axis.rank * self.local_vocab
        self.weight = _param(self.local_vocab, embedding_dim, split_dim=0, axis=axis)

    def forward(self, ids):
        if self.axis.size == 1:
            return F.embedding(ids, self.weight)
        local_ids = ids - self.vocab_start
        foreign = (local_ids < 0) | (local_ids >= self.local_vocab)
        # Look up row 0 for foreign ids, then zero them: their gradient is zeroed with them.
        out = F.embedding(local_ids.masked_fill(foreign, 0), self.weight)
        out.masked_fill_(foreign.unsqueeze(-1), 0.0)  # in place: embedding backward keeps no output
        if self.sequence_parallel:
            return _ReduceScatterSeq.apply(out, self.axis)
        return _ReduceFromTP.apply(out, self.axis)

    def extra_repr(self):
        return (f"{self.num_embeddings}, {self.embedding_dim} (vocab split over tp={self.axis.size}), "
                f"sequence_parallel={self.sequence_parallel}")


class ColumnInput(nn.Module):
    """`column_input` as a module: the one communication of the column-parallel layers that read one input."""

    def __init__(self, axis: Axis, sequence_parallel: bool):
        super().__init__()
        self.axis, self.sequence_parallel = axis, sequence_parallel

    def forward(self, x):
        return column_input(x, self.axis, self.sequence_parallel)


# -- vocab-parallel cross-entropy ------------------------------------------------------------
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """loss = logsumexp(logits) - logits[target], with the vocab split across tp ranks.

    Only three [N]-sized all-reduces cross the wire (max, sum of exp, target logit); the local
    softmax shard is kept for backward: d loss / d logits = softmax - onehot(target).
    """

    @staticmethod
    def forward(ctx, logits, targets, axis, ignore_index):
        local_vocab = logits.shape[-1]
        with torch.autocast(logits.device.type, enabled=False):  # float32 math, whatever autocast says
            x = logits.float()
            # Subtract the global max so exp() cannot overflow.
            x = x - _all_reduce(x.amax(dim=-1), axis, dist.ReduceOp.MAX).unsqueeze(-1)
            local_t = targets - axis.rank * local_vocab
            ignored = targets == ignore_index
            mine = (local_t >= 0) & (local_t < local_vocab) & ~ignored
            local_t = local_t.masked_fill(~mine, 0)
            target_logit = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
            target_logit = _all_reduce(target_logit, axis)
            softmax = x.exp_()  # x is our own buffer: reuse it
            sum_exp = _all_reduce(softmax.sum(dim=-1), axis)
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


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, axis: Axis,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy, float32, shape of ``targets``, from this rank's vocab shard.

    logits: [..., V/tp] (any float dtype), this rank's columns r*V/tp .. (r+1)*V/tp.
    targets: [...] global token ids; ``ignore_index`` tokens get loss 0 and no gradient.
    No rank ever holds full-vocab logits. With tp == 1 this is F.cross_entropy(reduction='none').
    """
    if axis.size == 1:
        flat = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               reduction="none", ignore_index=ignore_index)
        return flat.view(targets.shape)
    return _VocabParallelCrossEntropy.apply(logits, targets, axis, ignore_index)


class VocabParallelCrossEntropy(nn.Module):
    """The model's loss when the LM head's output is split by vocabulary."""

    def __init__(self, axis: Axis):
        super().__init__()
        self.axis = axis

    def forward(self, logits, labels):
        return vocab_parallel_cross_entropy(logits, labels, self.axis)
