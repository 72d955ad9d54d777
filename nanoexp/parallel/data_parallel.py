"""Data parallelism: average gradients across the dp group, overlapped with backward.

`GradientBuckets` packs the gradients into a few flat float32 buckets and starts each
bucket's all-reduce as soon as backward has produced every gradient in it, so most of the
communication hides behind the rest of backward. It only communicates on the last
micro-batch of an optimizer step (the one after `arm()`); earlier micro-batches just
accumulate into `param.grad` locally, as in single-process gradient accumulation.

`all_reduce_grads` is the small, synchronous helper for the extra reductions that are not
data parallelism (tied embeddings across pipeline ends, sequence-parallel norms across tp).

Why flat buffers everywhere: gloo silently reduces the wrong elements of a non-contiguous
view, and one collective per bucket is much cheaper than one per parameter.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from nanoexp.parallel.trace import NO_TRACE


def _unique(params) -> list[nn.Parameter]:
    """Parameters in order of first appearance, each once (tied weights appear twice)."""
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class _Bucket:
    """A flat float32 buffer and the parameter slots inside it."""

    def __init__(self, index: int, params: list[nn.Parameter]):
        self.index = index
        self.params = params
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.flat = torch.zeros(total, dtype=torch.float32, device=params[0].device)
        self.num_ready = 0
        self.handle = None

    def slot(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.flat[self.offsets[i]:self.offsets[i] + p.numel()].view(p.shape)


class GradientBuckets:
    """Bucketed, overlapped gradient averaging over one data-parallel group.

    Promises:
      * Between `arm()` and `finish()` each parameter's final gradient is copied into its
        bucket; a bucket's async all-reduce (SUM) starts as soon as all of its parameters
        are ready, in bucket order 0, 1, 2, ... on every rank.
      * After `finish()` every parameter's `.grad` is the mean over the group of the
        ranks' local gradients (a missing grad counts as zeros and is created), identical
        on every rank; the object is disarmed again.
      * Before `arm()` (earlier micro-batches) the hooks do nothing: no copy, no traffic.
      * With `group is None` or `group_size == 1` nothing is registered and `arm`/`finish`
        do nothing, so a single process pays nothing.

    With a `trace` (trace.py), each launch is recorded as an "allreduce_launch" instant and
    each wait in `finish()` as an "allreduce_wait" span, so the timeline shows the overlap.

    Diagnostics of the last step: `launch_order` (bucket ids in launch order),
    `launched_in_backward` / `launched_in_finish` (how many buckets started from inside
    backward's hooks vs from `finish()`), `num_launches` (all-reduces ever started).
    """

    def __init__(self, params: list[nn.Parameter], group, group_size: int,
                 bucket_cap_mb: float = 25.0, trace=NO_TRACE):
        self.group, self.group_size, self.trace = group, group_size, trace
        self.enabled = group is not None and group_size > 1
        self.armed = False
        self.buckets: list[_Bucket] = []
        self.launch_order: list[int] = []
        self.launched_in_backward = self.launched_in_finish = self.num_launches = 0
        self._next_launch = 0
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, slot)
        self._ready: set[int] = set()  # id(param) of slots filled since arm()
        if not self.enabled:
            return

        # Reverse registration order: backward produces the last layers' grads first,
        # so the first bucket fills (and can start communicating) earliest.
        cap_bytes = max(1, int(bucket_cap_mb * 2**20))
        current, current_bytes = [], 0
        for p in reversed(_unique(q for q in params if q.requires_grad)):
            nbytes = p.numel() * 4  # buckets are float32 whatever the param dtype
            if current and current_bytes + nbytes > cap_bytes:
                self._add_bucket(current)
                current, current_bytes = [], 0
            current.append(p)
            current_bytes += nbytes
        if current:
            self._add_bucket(current)
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _add_bucket(self, params: list[nn.Parameter]):
        bucket = _Bucket(len(self.buckets), params)
        for i, p in enumerate(params):
            self._where[id(p)] = (bucket.index, i)
        self.buckets.append(bucket)

    # -- the step protocol ----------------------------------------------------------------
    def arm(self):
        """Call right before the last micro-batch's backward of an optimizer step."""
        if not self.enabled:
            return
        for b in self.buckets:
            b.num_ready, b.handle = 0, None
        self._ready.clear()
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
        self._fill(p)
        self._launch_ready(from_hook=True)

    def _fill(self, p: nn.Parameter):
        b_idx, i = self._where[id(p)]
        bucket = self.buckets[b_idx]
        slot = bucket.slot(i)
        if p.grad is None:
            slot.zero_()
        else:
            slot.copy_(p.grad)
        self._ready.add(id(p))
        bucket.num_ready += 1

    def _launch_ready(self, from_hook: bool):
        # Launch strictly in bucket order: gloo matches collectives by issue order, so
        # every rank must start the same buckets in the same sequence even if its
        # backward finished them in a different order (e.g. data-dependent unused params).
        while (self._next_launch < len(self.buckets)
               and self.buckets[self._next_launch].num_ready
               == len(self.buckets[self._next_launch].params)):
            bucket = self.buckets[self._next_launch]
            bucket.handle = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM,
                                            group=self.group, async_op=True)
            self.launch_order.append(bucket.index)
            self.trace.mark("allreduce_launch", bucket=bucket.index, in_backward=from_hook)
            self.num_launches += 1
            if from_hook:
                self.launched_in_backward += 1
            else:
                self.launched_in_finish += 1
            self._next_launch += 1

    @torch.no_grad()
    def finish(self):
        """Wait for (and start any remaining) all-reduces; write averaged grads back."""
        if not self.enabled:
            return
        if not self.armed:
            raise RuntimeError("finish() without arm(): no gradients were collected")
        # Params that got no gradient in the last backward: take whatever .grad holds
        # (earlier micro-batches) or zeros, so every rank still joins every bucket.
        for bucket in self.buckets:
            for p in bucket.params:
                if id(p) not in self._ready:
                    self._fill(p)
        self._launch_ready(from_hook=False)
        for bucket in self.buckets:
            with self.trace.span("allreduce_wait", bucket=bucket.index):
                bucket.handle.wait()
            bucket.handle = None
            bucket.flat.div_(self.group_size)
            for i, p in enumerate(bucket.params):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(bucket.slot(i))
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
