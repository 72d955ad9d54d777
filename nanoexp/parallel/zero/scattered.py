"""The scattered path of a ZeRO engine (ZeRO-2 and 3): gradients reduce-scattered after every backward into this
rank's gradient shard, so no rank holds the whole model's gradients. The rules and why: docs/zero.md."""
from __future__ import annotations

import torch
from torch import nn

from nanoexp.parallel.collectives import reduce_scatter_into
from nanoexp.parallel.zero.buckets import size_buckets
from nanoexp.parallel.zero.units import ShardPiece, Unit, average


def plan_scattered(units, stage, size: int, rank: int, cap_mb: float, gather_format=None) -> list[Unit]:
    """ZeRO-3: one unit per module that runs as one block (the embedding, a layer, the norm, the head), gathered in
    `gather_format` where it takes all of the unit's parameters (else float32); ZeRO-2, where nothing is gathered:
    consecutive parameters in buckets of about cap_mb. `units`: (module, parameters) in forward order."""
    if stage.number == 2:
        units = [(None, bucket) for bucket in size_buckets([p for _, params in units for p in params], cap_mb)]
    units = [(module, params) for module, params in units if params]
    fmt = gather_format if stage.shards_parameters else None
    wires = [fmt if fmt is not None and all(map(fmt.takes, params)) else None for _, params in units]
    return [Unit(i, module, params, size, rank, True, False, wire=wire)
            for i, ((module, params), wire) in enumerate(zip(units, wires))]


class ScatteredGradients:
    """The scattered units of one engine over `group`, reduce-scattered in every backward (`reduce`).

    Autograd writes a unit's gradients into fresh tensors; once all are in (hooks count them; at ZeRO-3 once the
    module before it begins its backward, GatheredParameters), they are copied into one flat tensor, reduce-
    scattered and freed, and this rank's sum is added into the unit's gradient shard (its own storage, allocated
    when the step's first reduce-scatter lands, freed by `zero_grad`, as FSDP2). Units go strictly in backward
    order (NCCL's rule); with `overlap` one stays in flight during the next unit's backward. `finish()` averages.
    `gathered` (ZeRO-3, set by the engine) frees a unit's parameters before its reduce-scatter. With
    `split_backward` (zb_h1) a B step's gradients wait in .grad for the next W's reduce-scatters."""

    def __init__(self, units: list[Unit], group, average_over: int, replicas, trace, overlap: bool,
                 split_backward: bool):
        self.units, self.group, self.trace = units, group, trace
        self.average_over, self.replicas = average_over, replicas
        self.overlap, self.split_backward, self.gathered = overlap, split_backward, None
        self.in_backward, self.in_flight, self._next = False, [], len(units) - 1   # _next: the next unit to post
        for unit in units:   # each its own storage, held from its first landing to zero_grad (as FSDP2)
            unit.shard_grad = torch.zeros(unit.shard_size, dtype=torch.float32, device=unit.shard.device)
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda p, unit=unit: self._on_gradient(p, unit))

    def before_backward(self) -> None:
        if self.units:
            for unit in self.units:
                unit.num_ready = 0
            self._next, self.in_backward = len(self.units) - 1, True

    def _on_gradient(self, p: nn.Parameter, unit: Unit) -> None:
        if not self.in_backward:
            if self.split_backward:   # a B step's (norms, embedding): kept in .grad for the next W's reduce-scatter
                return
            raise RuntimeError("a sharded parameter got a gradient outside the pipeline's backward")
        if unit.index > self._next:   # ZeRO-3 reduced it when the module before it began its backward
            raise RuntimeError(f"a gradient of unit {unit.index} came after its reduce-scatter: a parameter used "
                               "outside its module cannot be sharded by ZeRO-3")
        unit.num_ready += 1
        if self.gathered is None or self.split_backward:   # ZeRO-3 in B and W: by W's order
            self.reduce(flush=False)

    @torch.no_grad()
    def reduce(self, flush: bool, stop: int = 0) -> None:
        """Reduce-scatter complete units in backward order, down to unit `stop` (all of them with `flush`: a
        gradient that never came counts as zeros); with `overlap` one stays in flight during the next unit's
        backward, without it each is waited for at once."""
        while self._next >= stop:
            unit = self.units[self._next]
            if not flush and unit.num_ready < len(unit.params):
                return
            if self.gathered is not None and not self.split_backward:   # a W needs no weights: B freed them
                self.gathered.after_backward_of(unit)   # its backward is done: its parameters go before its gradients
            while self.in_flight:   # one in flight: its copies (gloo's too) live until it lands
                self._land(*self.in_flight.pop())
            flat = torch.zeros(unit.padded, dtype=torch.float32, device=unit.shard_grad.device)
            for p in unit.params:
                if p.grad is not None:
                    unit.view(flat, p).copy_(p.grad)
                    p.grad = None
            summed = torch.empty_like(unit.shard_grad)
            work = reduce_scatter_into(summed, flat, self.group, async_op=True)
            self.trace.mark("reduce_scatter_launch", unit=unit.index)
            self.in_flight.append((unit, work, summed, flat))
            if not self.overlap:
                self._land(*self.in_flight.pop())
            self._next -= 1

    def _land(self, unit: Unit, work, summed: torch.Tensor, flat: torch.Tensor) -> None:
        with self.trace.span("reduce_scatter_wait", unit=unit.index):
            work.wait()
        storage = unit.shard_grad.untyped_storage()
        if storage.size() == 0:   # the step's first: the optimizer's views of it see the new storage
            storage.resize_(unit.shard_size * unit.shard_grad.element_size())
            unit.shard_grad.zero_()
        unit.shard_grad.add_(summed)

    @torch.no_grad()
    def after_backward(self) -> None:
        """The rest of the units go, and every reduce-scatter is added into the gradient shards."""
        if not self.units:
            return
        self.reduce(flush=True)
        while self.in_flight:
            self._land(*self.in_flight.pop())
        self.in_backward = False

    @torch.no_grad()
    def finish(self) -> None:
        """The step's backwards are done: average the gradient shards (under hybrid sharding summed across the
        replicas first, once a step: the same sum as after every micro-batch's reduce-scatter, 1/m of the bytes)."""
        average([unit.shard_grad for unit in self.units], self.replicas, self.average_over, self.trace)

    def zero_grad(self) -> None:
        """Free every gradient shard until its next reduce-scatter lands."""
        for unit in self.units:
            unit.shard_grad.untyped_storage().resize_(0)
            for p in unit.params:
                p.grad = None

    def pieces(self) -> list[ShardPiece]:
        return [piece for unit in self.units for piece in unit.pieces()]
