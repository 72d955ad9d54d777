"""The accumulated path of a ZeRO engine: gradients that autograd sums over the step's micro-batches into one whole
buffer, reduced once a step (ZeRO-0 and 1: every parameter; ZeRO-2 and 3: those always accumulated, which stay
whole). The rules and why: docs/zero.md#how-each-stage-works."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from nanoexp.parallel.collectives import reduce_scatter_into
from nanoexp.parallel.zero.buckets import bucket_full
from nanoexp.parallel.zero.units import ShardPiece, Unit, average


def plan_accumulated(params: list[nn.Parameter], size: int, rank: int, sharded: bool, reduced_in_finish,
                     all_reduced_whole, cap_mb: float) -> list[Unit]:
    """Accumulated units of about cap_mb, in reverse order (backward makes the last layers' gradients first, so the
    first unit fills earliest), those `reduced_in_finish` last; an `all_reduced_whole` parameter gets a unit of its
    own where the order reaches it. `sharded`: each rank owns 1/size of every unit (ZeRO-1 and up)."""
    later_ids, whole_ids, out = {id(p) for p in reduced_in_finish}, {id(p) for p in all_reduced_whole}, []
    for later in (False, True):
        current = []
        for p in (p for p in reversed(params) if (id(p) in later_ids) == later):
            if id(p) in whole_ids or (current and bucket_full(current, p, cap_mb)):
                if current:
                    out.append(Unit(len(out), None, current, size, rank, sharded, True, later))
                current = []
            if id(p) in whole_ids:
                out.append(Unit(len(out), None, [p], size, rank, sharded, True, later, all_reduced_whole=True))
            else:
                current.append(p)
        if current:
            out.append(Unit(len(out), None, current, size, rank, sharded, True, later))
    return out


class AccumulatedGradients:
    """The accumulated units of one engine over `group` (`reduces`: it has other ranks), and their reduction.

    Autograd sums every micro-batch's gradients into a unit's buffer (`Unit.grads`). In the step's last backward
    (`before_last_backward`) a hook counts each gradient as it lands, and `reduce` posts each unit as soon as all
    of its gradients are in, strictly in unit order (NCCL's rule): a reduce-scatter into this rank's shard from
    ZeRO-1 on, an all-reduce at ZeRO-0 and for units all-reduced whole. After the backwards `reduce(rest=True)`
    posts the rest (units reduced in finish, gradients that never came: zeros) and `finish()` waits for all and
    averages (`units.average`)."""

    def __init__(self, units: list[Unit], group, reduces: bool, average_over: int, replicas, trace):
        self.units, self.group, self.reduces = units, group, reduces
        self.average_over, self.replicas, self.trace = average_over, replicas, trace
        self._ready, self._next = None, 0   # ids of the last backward's gradients in (None: not in it); next to post
        for unit in units if reduces else []:
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda p, unit=unit: self._on_gradient(p, unit))

    def before_last_backward(self) -> None:
        """From now on each unit is reduced as soon as its gradients are final."""
        for unit in self.units:
            unit.num_ready, unit.handle = 0, None
        self._ready, self._next = set(), 0

    def _on_gradient(self, p: nn.Parameter, unit: Unit) -> None:
        if self._ready is None or unit.reduced_in_finish:   # accumulating, or reduced by finish() whenever it comes
            return
        if id(p) in self._ready:   # its unit may already be on the wire: a second gradient would be lost
            raise RuntimeError("a parameter received two gradients in the last backward of the step")
        self._ready.add(id(p))
        unit.num_ready += 1
        self.reduce()

    def reduce(self, rest: bool = False) -> None:
        """Post the reductions of complete units, strictly in unit order (the hooks never post one reduced in
        finish). `rest`: the step's backwards are done, every unit not posted yet goes (a missing gradient: zeros)."""
        if not self.reduces:
            return
        if rest:
            if self._ready is None and self.units:
                raise RuntimeError("finish() without a last backward: no gradients were collected")
            for unit in self.units:
                unit.num_ready = len(unit.params)
        while self._next < len(self.units):
            unit = self.units[self._next]
            if unit.num_ready < len(unit.params) or (not rest and unit.reduced_in_finish):
                return
            if unit.sharded and not unit.all_reduced_whole:
                unit.handle = reduce_scatter_into(unit.shard_grad, unit.grads, self.group, async_op=True)
            else:
                unit.handle = dist.all_reduce(unit.grads, group=self.group, async_op=True)
            self.trace.mark("allreduce_launch", bucket=unit.index, in_backward=not rest)
            self._next += 1

    @torch.no_grad()
    def finish(self) -> None:
        """After `reduce(rest=True)`: wait for every reduction, and average."""
        if not self.units:
            return
        if not self.reduces:
            if self.average_over > 1:
                for unit in self.units:
                    unit.grads.div_(self.average_over)
            return
        for unit in self.units:
            with self.trace.span("allreduce_wait", bucket=unit.index):
                unit.handle.wait()
            unit.handle = None
        average([unit.grads if unit.all_reduced_whole else unit.shard_grad for unit in self.units], self.replicas,
                self.average_over, self.trace)
        self._ready = None

    def zero_grad(self) -> None:
        """Zero the buffers in place; each parameter's `.grad` a view of its unit's (re-attached if replaced)."""
        for unit in self.units:
            unit.grads.zero_()
            for p in unit.params:
                if p.grad is None or p.grad.data_ptr() != unit.view(unit.grads, p).data_ptr():
                    p.grad = unit.view(unit.grads, p)

    def pieces(self) -> list[ShardPiece]:
        return [piece for unit in self.units for piece in unit.pieces()]
