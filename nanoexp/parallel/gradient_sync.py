"""GradientSync: the one owner of gradient synchronisation. After `finish()` every gradient the update reads
is final: averaged over the dp x cp ranks that hold the same weights, summed where one replica holds a
parameter twice.

Flat buffers. Each chunk of layers moves its parameters into one flat float32 buffer and their gradients into
another (`ChunkBuffers`): `param.data` and `param.grad` are views of them, so no copy of either exists and
autograd accumulates micro-batches straight into the buffer. Why flat: gloo silently reduces the wrong
elements of a non-contiguous view, and one collective per bucket is much cheaper than one per parameter.

Overlap. The pipeline engine calls `before_backward(chunk, last=True)` right before a chunk's last backward of
the step; from then on each bucket (a contiguous range of the buffers) starts its dp x cp reduction once every
gradient in it is final, so most of the communication hides behind the rest of backward:
* without ZeRO: an all-reduce; every rank ends with the whole averaged gradient;
* ZeRO-1 (`shard=True`): a reduce-scatter; rank r ends with the averaged gradient of its 1/(dp·cp) of every
  bucket (`shard_pieces`), which is all it updates; after the update `gather_parameters` all-gathers the
  parameters. Buckets are padded to a multiple of dp·cp; the two move the bytes of one all-reduce.
ZeRO-2 and 3 keep no gradient buffer: their parameters live in `ShardedBuffers` (sharded_buffers.py), reduced in
every micro-batch's backward; only the parameters held twice (below) stay here, whole, as without ZeRO.

Expert parallelism (ep > 1): a routed expert lives on one rank of each ep group, and its gradient there already
sums the tokens of the whole ep group (they came to it through the all-to-all). Each chunk's experts get buffers
of their own, summed over the edp group (the ranks holding the same experts) and divided by dp x cp, which gives
the dp x cp average every other parameter gets; ZeRO-1 shards them over edp.

Parameters held twice in a replica need a second sum:
* sequence-parallel norm weights (each tp rank saw part of the sequence) are summed over tp first, then averaged
  over dp x cp: they sit in each chunk's last buckets, which only `finish()` starts, after the tp sum;
* a tied embedding split over the first and last stage is averaged over dp x cp first, each copy in its own
  stage's buckets, then the two copies are summed over the embedding group (as Megatron-LM does). A sum of two
  numbers is the same on both ends, so the copies stay identical bit for bit; summing first and averaging each
  copy in its stage's bucket layout could round them apart. A copy has a bucket of its own, averaged whole
  (an all-reduce, also under ZeRO-1), so that the embedding-group sum sees the whole averaged gradient.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from nanoexp.parallel.collectives import all_gather_into, reduce_scatter_into
from nanoexp.parallel.placement import counted_here, placement
from nanoexp.parallel.sharded_buffers import ShardedBuffers
from nanoexp.parallel.trace import NO_TRACE


@dataclass
class ShardPiece:
    """The part [start, end) of a parameter's flattened elements that lies in this rank's shard,
    with the views of the flat buffers holding its values and its averaged gradient. `replicated`: every
    rank of dp x cp holds and updates the same piece (a parameter kept whole under ZeRO-2/3)."""
    param: nn.Parameter
    start: int
    end: int
    value: torch.Tensor
    grad: torch.Tensor
    replicated: bool = False


class _Bucket:
    """A contiguous range [start, start + numel) of the flat buffers and the parameters in it. `deferred`:
    started only by finish(); `whole`: averaged whole (all-reduce) even when the buffers are sharded."""

    def __init__(self, index: int, params: list[nn.Parameter], start: int, numel: int, deferred: bool = False,
                 whole: bool = False):
        self.index, self.params, self.start, self.numel = index, params, start, numel
        self.deferred, self.whole = deferred, whole
        self.num_ready, self.handle = 0, None


class ChunkBuffers:
    """One chunk's parameters and gradients in flat buffers, averaged over one group in buckets.

    Promises:
      * From construction on, every parameter's `.data` and `.grad` are views of `values` and `grads`
        (float32); `zero_grad()` zeroes the gradients in place (never sets them to None).
      * Between `arm()` and `finish()` each bucket starts its reduction once all its gradients are final, in
        bucket order 0, 1, 2, ... on every rank; `deferred` parameters' buckets start only in `finish()`.
        Before `arm()` nothing communicates.
      * After `finish()` the gradients are summed over the group and divided by `average_over` (default: the
        group's size, an average): all of them (`shard=False`) or this rank's `shard_pieces()` (`shard=True`),
        and always all of each `whole` parameter (each in a bucket of its own). A parameter that got no
        gradient counts as zeros. With `group is None` or `group_size == 1` nothing communicates.
    With a `trace` (trace.py), each launch is an "allreduce_launch" instant and each wait in `finish()` an
    "allreduce_wait" span.
    """

    def __init__(self, params: list[nn.Parameter], group, group_size: int, group_rank: int = 0,
                 shard: bool = False, deferred=(), whole=(), bucket_cap_mb: float = 25.0, trace=NO_TRACE,
                 average_over: int | None = None):
        self.group, self.group_size, self.group_rank, self.shard, self.trace = group, group_size, group_rank, shard, trace
        self.average_over = average_over or group_size   # the group's sum is divided by this
        self.enabled = group is not None and group_size > 1
        self.armed = False
        params = [p for p in params if p.requires_grad]
        deferred_ids, whole_ids = {id(p) for p in deferred}, {id(p) for p in whole}
        # Reverse registration order: backward produces the last layers' grads first, so the
        # first bucket fills (and can start communicating) earliest; deferred ones go last.
        self.buckets: list[_Bucket] = []
        for deferred_part in (False, True):
            self._plan([p for p in reversed(params) if (id(p) in deferred_ids) == deferred_part], bucket_cap_mb,
                       deferred_part, whole_ids)
        total = self._end()
        device = params[0].device if params else torch.device("cpu")
        self.values = torch.zeros(total, dtype=torch.float32, device=device)
        self.grads = torch.zeros_like(self.values)
        self._views = {}   # id(param) -> (bucket, offset in the buffers)
        for bucket in self.buckets:
            offset = bucket.start
            for p in bucket.params:
                self._views[id(p)] = (bucket, offset)
                self.values[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.values[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                if self.enabled:
                    p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.params = [p for bucket in self.buckets for p in bucket.params]
        self.zero_grad()

    def _end(self) -> int:
        return self.buckets[-1].start + self.buckets[-1].numel if self.buckets else 0

    def _padded(self, size: int) -> int:
        """A bucket's length: `size`, rounded up to a multiple of the group when sharded."""
        return -(-size // self.group_size) * self.group_size if self.shard else size

    def _plan(self, params, cap_mb: float, deferred: bool, whole_ids: set[int]) -> None:
        """Append buckets of about cap_mb holding params in order, each padded to a multiple of the group; a
        whole parameter gets a bucket of its own, where the order reaches it."""
        cap, current = max(1, int(cap_mb * 2**20) // 4), []

        def close(params, whole=False):
            size = sum(q.numel() for q in params)
            self.buckets.append(_Bucket(len(self.buckets), params, self._end(), self._padded(size), deferred, whole))

        for p in params:
            if id(p) in whole_ids or (current and sum(q.numel() for q in current) + p.numel() > cap):
                if current:
                    close(current)
                current = []
            if id(p) in whole_ids:
                close([p], whole=True)
            else:
                current.append(p)
        if current:
            close(current)

    def zero_grad(self) -> None:
        """Zero every gradient in place; (re)attach `.grad` as views of the buffer."""
        self.grads.zero_()
        for p in self.params:
            bucket, offset = self._views[id(p)]
            if p.grad is None or p.grad.data_ptr() != self.grads[offset:].data_ptr():
                p.grad = self.grads[offset:offset + p.numel()].view_as(p)

    def shard_range(self, bucket: _Bucket) -> tuple[int, int]:
        """[lo, hi) of the buffers: this rank's part of `bucket` (all of it without sharding)."""
        if not self.shard:
            return bucket.start, bucket.start + bucket.numel
        size = bucket.numel // self.group_size
        lo = bucket.start + self.group_rank * size
        return lo, lo + size

    def shard_pieces(self) -> list[ShardPiece]:
        """The parts of parameters in this rank's shard of every bucket, in buffer order."""
        pieces = []
        for bucket in self.buckets:
            lo, hi = self.shard_range(bucket)
            for p in bucket.params:
                offset = self._views[id(p)][1]
                a, b = max(lo, offset), min(hi, offset + p.numel())
                if a < b:
                    pieces.append(ShardPiece(p, a - offset, b - offset, self.values[a:b], self.grads[a:b]))
        return pieces

    # -- the step protocol ----------------------------------------------------------------
    def arm(self):
        """Call right before the last micro-batch's backward of an optimizer step."""
        if not self.enabled:
            return
        for b in self.buckets:
            b.num_ready, b.handle = 0, None
        self._ready: set[int] = set()
        self._next_launch = 0
        self.armed = True

    def _on_grad_ready(self, p: nn.Parameter):
        if not self.armed:
            return
        if id(p) in self._ready:
            # The bucket may already be on the wire; a second gradient would be lost.
            raise RuntimeError("a parameter received two gradients after arm(); call arm() "
                               "only before the last backward of the optimizer step")
        self._ready.add(id(p))
        self._views[id(p)][0].num_ready += 1
        self._launch_ready(from_hook=True)

    def _launch_ready(self, from_hook: bool):
        # Launch strictly in bucket order: collectives are matched by issue order, so every rank
        # must start the same buckets in the same sequence even if its backward finished them in
        # a different order (e.g. data-dependent unused params). Hooks never start a deferred one.
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.num_ready < len(bucket.params) or (from_hook and bucket.deferred):
                return
            data = self.grads[bucket.start:bucket.start + bucket.numel]
            if self.shard and not bucket.whole:
                lo, hi = self.shard_range(bucket)
                bucket.handle = reduce_scatter_into(self.grads[lo:hi], data, self.group, async_op=True)
            else:
                bucket.handle = dist.all_reduce(data, group=self.group, async_op=True)
            self.trace.mark("allreduce_launch", bucket=bucket.index, in_backward=from_hook)
            self._next_launch += 1

    @torch.no_grad()
    def finish(self):
        """Start the remaining reductions (deferred buckets, gradients that never arrived), wait for
        all, and average: the whole buffer, or this rank's shard of each bucket."""
        if not self.enabled:
            if self.average_over > 1:
                self.grads.div_(self.average_over)
            return
        if not self.armed:
            raise RuntimeError("finish() without arm(): no gradients were collected")
        for bucket in self.buckets:
            bucket.num_ready = len(bucket.params)
        self._launch_ready(from_hook=False)
        for bucket in self.buckets:
            with self.trace.span("allreduce_wait", bucket=bucket.index):
                bucket.handle.wait()
            lo, hi = (bucket.start, bucket.start + bucket.numel) if bucket.whole else self.shard_range(bucket)
            self.grads[lo:hi].div_(self.average_over)
            bucket.handle = None
        self.armed = False

    def gather_parameters(self) -> list:
        """ZeRO-1, after the update: post the all-gather of every bucket's updated shards into the whole
        parameter buffer; returns the works to wait on."""
        if not (self.enabled and self.shard):
            return []
        works = []
        for bucket in self.buckets:
            lo, hi = self.shard_range(bucket)
            full = self.values[bucket.start:bucket.start + bucket.numel]
            works.append(all_gather_into(full, self.values[lo:hi], self.group, async_op=True))
        return works


class GradientSync:
    """The gradients of this rank's model shard, from the pipeline's backward to the update.

        sync = GradientSync(model.chunk_units(), ctx, stage=cfg.optimizer.zero_stage)
        engine.run(..., grad_sync=sync)   # before_backward / after_backward around each chunk's backward
        sync.finish()                     # SP and tied sums, every gradient averaged over dp x cp
        clip by sync.norm_inputs(); optimizer.step(); sync.zero_grad()

    `chunks[c]` are the units of chunk c of the model, (module, its parameters) in forward order (a plain list
    of parameters is one unit without a module: enough below stage 3). Stages 0 and 1 bucket each chunk's
    parameters (ChunkBuffers); stages 2 and 3 shard them (sharded_buffers.py: stage 3 by module, stage 2 in
    buckets), except the parameters held twice in a replica (sequence-parallel norms, tied embeddings), which
    stay whole and are averaged as at stage 0. With dp x cp = 1 there is nothing to shard: stages 2 and 3 run
    as stage 1.
    """

    def __init__(self, chunks: list[list[tuple[nn.Module, list[nn.Parameter]]]], ctx, stage: int = 0,
                 bucket_cap_mb: float = 25.0, prefetch: int = 1, reshard_after_forward: bool = True, trace=NO_TRACE):
        self.ctx, self.stage = ctx, stage if ctx.dp_cp > 1 else min(stage, 1)
        self.shard = self.stage >= 1
        chunks = [chunk if chunk and isinstance(chunk[0], tuple) else [(None, list(chunk))] for chunk in chunks]
        uses = [p for chunk in chunks for _module, unit in chunk for p in unit]   # a tied head twice
        params = list({id(p): p for p in uses}.values())
        self.sequence_parallel = [p for p in params if placement(p).sequence_parallel]
        self.tied = [p for p in params if placement(p).tied_across_stages]
        twice = {key for key, count in Counter(map(id, uses)).items() if count > 1}   # tied on one stage
        whole = {id(p) for p in self.sequence_parallel + self.tied} | twice
        self.chunks, self.sharded, self.expert_chunks = [], [], []
        for c, chunk in enumerate(chunks):
            chunk_params = list({id(p): p for _module, unit in chunk for p in unit}.values())
            if ctx.ep > 1:   # routed experts: summed over the edp ranks that hold them, averaged over dp x cp
                experts = [p for p in chunk_params if placement(p).expert]
                chunk_params = [p for p in chunk_params if not placement(p).expert]
                self.expert_chunks.append(ChunkBuffers(
                    experts, ctx.edp_group, ctx.edp, ctx.edp_rank, self.stage == 1, deferred=self.sequence_parallel,
                    bucket_cap_mb=bucket_cap_mb, trace=trace.bind(chunk=c, experts=True), average_over=ctx.dp_cp))
            if self.stage >= 2:
                units = [(module, [p for p in unit if id(p) not in whole]) for module, unit in chunk]
                if self.stage == 2:   # nothing to gather: reduce in buckets, whose gradients in flight are smaller
                    units = size_buckets([p for _module, unit in units for p in unit], bucket_cap_mb)
                self.sharded.append(ShardedBuffers(units, ctx.dp_cp_group, ctx.dp_cp, ctx.dp_cp_rank, self.stage,
                                                   prefetch, reshard_after_forward, trace.bind(chunk=c)))
                chunk_params = [p for p in chunk_params if id(p) in whole]
            self.chunks.append(ChunkBuffers(chunk_params, ctx.dp_cp_group, ctx.dp_cp, ctx.dp_cp_rank,
                                            self.stage == 1, deferred=self.sequence_parallel, whole=self.tied,
                                            bucket_cap_mb=bucket_cap_mb, trace=trace.bind(chunk=c)))

    def before_backward(self, chunk: int, last: bool) -> None:
        """Call right before each backward through chunk `chunk`; `last`: its last of the step (whole buckets
        start as they fill during it; sharded units are reduced during every one)."""
        if self.sharded:
            self.sharded[chunk].before_backward()
        if last:
            self.chunks[chunk].arm()
            if self.expert_chunks:
                self.expert_chunks[chunk].arm()

    def after_backward(self, chunk: int, last: bool) -> None:
        """Call right after each backward through chunk `chunk`."""
        if self.sharded:
            self.sharded[chunk].after_backward()

    def finish(self) -> None:
        """Every gradient final: sequence-parallel sums over tp, every chunk's dp x cp average, then the tied
        copies' sum over the embedding group (module docstring)."""
        ctx = self.ctx
        if ctx.tp > 1:
            all_reduce_grads(self.sequence_parallel, ctx.tp_group)
        for chunk in self.buffers:
            chunk.finish()
        all_reduce_grads(self.tied, ctx.embedding_group)

    @property
    def buffers(self) -> list:
        """Every ChunkBuffers and ShardedBuffers, in the order every rank finishes them."""
        return self.chunks + self.expert_chunks + self.sharded

    def zero_grad(self) -> None:
        for chunk in self.buffers:
            chunk.zero_grad()

    # -- what the optimizer reads ------------------------------------------------------------
    def held_as_shards(self) -> set[int]:
        """ZeRO-3: the ids of the parameters held only as `shard_pieces()` (over the ranks; a rank may hold
        no piece of one); their whole values are gathered for their module's forward and backward, then freed."""
        return {id(p) for chunk in self.sharded for p in chunk.params} if self.stage == 3 else set()

    def shard_pieces(self) -> list[ShardPiece]:
        """ZeRO: the parts of parameters this rank updates, with their averaged gradients."""
        whole = [piece for chunk in self.chunks + self.expert_chunks for piece in chunk.shard_pieces()]
        if self.stage >= 2:
            whole = [replace(piece, replicated=True) for piece in whole]
        return whole + [piece for chunk in self.sharded for piece in chunk.shard_pieces(ShardPiece)]

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """ZeRO-1 and 2, after the update of the shard pieces: every rank gets every updated parameter."""
        works = [work for chunk in self.buffers for work in chunk.gather_parameters()]
        for work in works:
            work.wait()

    def norm_inputs(self, params: list[nn.Parameter]) -> tuple[list, list, object]:
        """What clipping reads: the gradients the update uses, those of them that count in the global norm
        (each element of the model once), and the group their squares are summed over. ZeRO: this rank's
        shard pieces, summed over every rank (a piece every dp x cp rank holds counts on the first); else
        every parameter's gradient (already identical across dp x cp), summed over the replica's
        model-parallel group; with expert parallelism, whose experts differ between the ep ranks, over every
        rank, each element counted on the first rank that holds it (ParallelContext.replica_rank)."""
        ctx = self.ctx
        if self.shard:
            pieces = self.shard_pieces()
            grads = [piece.grad for piece in pieces]
            counted = [piece.grad for piece in pieces if counted_here(piece.param, ctx.tp_rank)
                       and (ctx.dp_cp_rank == 0 or not piece.replicated)]
            return grads, counted, dist.group.WORLD if ctx.world_size > 1 else None
        used = [(p.grad, p) for p in params if p.grad is not None]
        if ctx.ep > 1:
            counted = [g for g, p in used if counted_here(p, ctx.tp_rank) and ctx.replica_rank(p) == 0]
            return [g for g, _ in used], counted, dist.group.WORLD
        group = ctx.model_parallel_group if ctx.tp * ctx.pp > 1 else None
        return [g for g, _ in used], [g for g, p in used if counted_here(p, ctx.tp_rank)], group

    def buffer_bytes(self) -> tuple[int, int]:
        """(parameter, gradient) bytes held between steps."""
        whole = self.chunks + self.expert_chunks
        values = sum(c.values.numel() * c.values.element_size() for c in whole)
        grads = sum(c.grads.numel() * c.grads.element_size() for c in whole)
        for chunk in self.sharded:
            sharded_values, sharded_grads = chunk.persistent_bytes()
            values, grads = values + sharded_values, grads + sharded_grads
        return values, grads


def size_buckets(params: list[nn.Parameter], cap_mb: float) -> list[tuple[None, list[nn.Parameter]]]:
    """Consecutive parameters in buckets of about `cap_mb` (a parameter larger than that alone), as units
    without a module."""
    cap, buckets = max(1, int(cap_mb * 2**20) // 4), [[]]
    for p in params:
        if buckets[-1] and sum(q.numel() for q in buckets[-1]) + p.numel() > cap:
            buckets.append([])
        buckets[-1].append(p)
    return [(None, bucket) for bucket in buckets if bucket]


@torch.no_grad()
def all_reduce_grads(params, group, op=dist.ReduceOp.SUM):
    """Reduce the `.grad` of `params` (each once) over `group` in place, synchronously.

    One flat, contiguous all-reduce per dtype (so gloo never sees a strided view). A missing grad counts as
    zeros and is created, so every rank sends the same layout. Every rank of the group must pass the same
    parameters in the same order. With `group is None` (single process) or a one-rank group this does nothing.
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    by_dtype: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault((p.grad.dtype, p.grad.device), []).append(p)
    for same in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in same])
        dist.all_reduce(flat, op=op, group=group)
        offset = 0
        for p in same:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
