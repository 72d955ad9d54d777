"""Data parallelism: parameters and gradients in flat buffers, averaged across dp in buckets that
start as soon as backward has produced them.

`GradientBuckets` moves a chunk's parameters into one flat float32 buffer and their gradients
into another: `param.data` and `param.grad` are views of them, so no copy of either exists and
autograd accumulates micro-batches straight into the buffer. On the last micro-batch of an
optimizer step (after `arm()`), each bucket (a contiguous range of the buffers) starts its dp
reduction once every gradient in it is final, so most of the communication hides behind the
rest of backward:

* `shard=False` (zero_stage 0): an all-reduce; every rank ends with the whole averaged gradient.
* `shard=True` (ZeRO-1): a reduce-scatter, in place; rank r ends with the averaged gradient of its
  1/dp of every bucket (`shard_pieces`), which is all it updates. Buckets are padded to a multiple
  of dp; one reduce-scatter now plus one all-gather of parameters after the update (zero.py) move
  the bytes of one all-reduce.

`deferred` parameters (sequence-parallel norms, tied embeddings split over the pipeline ends)
need their gradient summed over another group first; they sit in the last buckets, which only
`finish()` starts, after the caller has summed them (`all_reduce_grads`).

Why flat buffers: gloo silently reduces the wrong elements of a non-contiguous view, and one
collective per bucket is much cheaper than one per parameter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from nanoexp.parallel.trace import NO_TRACE


def collective(name: str, old_name: str):
    """torch.distributed's `name`, or `old_name` on torch releases before it (2.13 renamed
    all_gather_into_tensor and reduce_scatter_tensor). Looked up at each call, so that wrappers
    such as the CommCounter see it."""
    return getattr(dist, name, None) or getattr(dist, old_name)


def _unique(params) -> list[nn.Parameter]:
    """Parameters in order of first appearance, each once (tied weights appear twice)."""
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


@dataclass
class ShardPiece:
    """The part [start, end) of a parameter's flattened elements that lies in this rank's shard,
    with the views of the flat buffers holding its values and its averaged gradient."""
    param: nn.Parameter
    start: int
    end: int
    value: torch.Tensor
    grad: torch.Tensor


class _Bucket:
    """A contiguous range [start, start + numel) of the flat buffers and the parameters in it."""

    def __init__(self, index: int, params: list[nn.Parameter], start: int, numel: int, deferred: bool):
        self.index, self.params, self.start, self.numel, self.deferred = index, params, start, numel, deferred
        self.num_ready, self.handle = 0, None


class GradientBuckets:
    """A chunk's parameters and gradients in flat buffers, averaged over one data-parallel group.

    Promises:
      * From construction on, every parameter's `.data` and `.grad` are views of `values` and
        `grads` (float32); `zero_grad()` zeroes the gradients in place (never set them to None).
      * Between `arm()` and `finish()` each bucket starts its reduction once all its gradients are
        final, in bucket order 0, 1, 2, ... on every rank; before `arm()` nothing communicates.
      * After `finish()` the gradients are averaged over the group: all of them (`shard=False`) or
        this rank's `shard_pieces()` (`shard=True`). A parameter that got no gradient counts as
        zeros. With `group is None` or `group_size == 1` nothing communicates.

    With a `trace` (trace.py), each launch is recorded as an "allreduce_launch" instant and each
    wait in `finish()` as an "allreduce_wait" span. Diagnostics of the last step: `launch_order`,
    `launched_in_backward` / `launched_in_finish`, `num_launches` (ever).
    """

    def __init__(self, params: list[nn.Parameter], group, group_size: int, group_rank: int = 0,
                 shard: bool = False, deferred=(), bucket_cap_mb: float = 25.0, trace=NO_TRACE):
        self.group, self.group_size, self.group_rank, self.shard, self.trace = group, group_size, group_rank, shard, trace
        self.enabled = group is not None and group_size > 1
        self.armed = False
        self.launch_order: list[int] = []
        self.launched_in_backward = self.launched_in_finish = self.num_launches = 0
        params = [p for p in _unique(params) if p.requires_grad]
        deferred_ids = {id(p) for p in deferred}
        # Reverse registration order: backward produces the last layers' grads first, so the
        # first bucket fills (and can start communicating) earliest; deferred ones go last.
        self.buckets: list[_Bucket] = []
        for deferred_part in (False, True):
            self._plan([p for p in reversed(params) if (id(p) in deferred_ids) == deferred_part], bucket_cap_mb,
                       deferred_part)
        total = self.buckets[-1].start + self.buckets[-1].numel if self.buckets else 0
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

    def _plan(self, params, cap_mb: float, deferred: bool) -> None:
        """Append buckets of about cap_mb holding params in order, each padded to a multiple of dp."""
        cap, current = max(1, int(cap_mb * 2**20) // 4), []
        start = self.buckets[-1].start + self.buckets[-1].numel if self.buckets else 0
        for p in params + [None]:
            size = sum(q.numel() for q in current)
            if current and (p is None or size + p.numel() > cap):
                padded = -(-size // self.group_size) * self.group_size if self.shard else size
                self.buckets.append(_Bucket(len(self.buckets), current, start, padded, deferred))
                current, start = [], start + padded
            if p is not None:
                current.append(p)

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
        self.launch_order = []
        self.launched_in_backward = self.launched_in_finish = 0
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
            if self.shard:
                lo, hi = self.shard_range(bucket)
                reduce_scatter = collective("reduce_scatter_single", "reduce_scatter_tensor")
                bucket.handle = reduce_scatter(self.grads[lo:hi], data, group=self.group, async_op=True)
            else:
                bucket.handle = dist.all_reduce(data, group=self.group, async_op=True)
            self.launch_order.append(bucket.index)
            self.trace.mark("allreduce_launch", bucket=bucket.index, in_backward=from_hook)
            self.num_launches += 1
            self.launched_in_backward += from_hook
            self.launched_in_finish += not from_hook
            self._next_launch += 1

    @torch.no_grad()
    def finish(self):
        """Start the remaining reductions (deferred buckets, gradients that never arrived), wait for
        all, and average: the whole buffer, or this rank's shard of each bucket."""
        if not self.enabled:
            return
        if not self.armed:
            raise RuntimeError("finish() without arm(): no gradients were collected")
        for bucket in self.buckets:
            bucket.num_ready = len(bucket.params)
        self._launch_ready(from_hook=False)
        for bucket in self.buckets:
            with self.trace.span("allreduce_wait", bucket=bucket.index):
                bucket.handle.wait()
            lo, hi = self.shard_range(bucket)
            self.grads[lo:hi].div_(self.group_size)
            bucket.handle = None
        self.armed = False


@torch.no_grad()
def all_reduce_grads(params, group, op=dist.ReduceOp.SUM):
    """Reduce the `.grad` of `params` over `group` in place, synchronously.

    One flat, contiguous all-reduce per dtype (so gloo never sees a strided view). A
    missing grad counts as zeros and is created, so every rank sends the same layout.
    Every rank of the group must pass the same parameters in the same order. With
    `group is None` (single process) or a one-rank group this does nothing.
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    by_dtype: dict[tuple, list[nn.Parameter]] = {}
    for p in _unique(params):
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
