"""ZeRO-2 and ZeRO-3: one chunk's gradients (and, at stage 3, parameters) sharded over the dp x cp ranks.

The unit of sharding is, at stage 3, a module that runs as one block: the embedding, a decoder layer, the final
norm, the LM head; at stage 2, where nothing is gathered, a bucket of consecutive parameters of about
`model.ddp_bucket_cap_mb` (GradientSync plans both). Each unit's parameters sit in one flat float32 buffer padded
to a multiple of the group size d; rank r owns the r-th 1/d of it, its *shard*, and updates only that (ZeroAdamW
over `shard_pieces`).

Gradients (stages 2 and 3). Autograd puts a unit's gradients in fresh `.grad` tensors; once all of them are in
(hooks count them, per micro-batch), they are copied into one flat tensor, reduce-scattered over the group and
freed: the rank adds the sum of its shard into `shard_grads`, so no rank ever holds the whole model's gradients,
during backward or between steps. One reduce-scatter is in flight at a time (the next unit's launch waits for
it), so a rank holds at most two units' gradients. With gradient accumulation this costs one reduce-scatter per
micro-batch.

Parameters (stage 3). A unit's whole buffer is freed (its storage resized to 0; the parameters stay views of it)
except while the unit is in use: a forward pre-hook all-gathers it from the shards, a hook on the unit's output
gathers it again before its backward, and it is freed after each (`reshard_after_forward=True`), or kept from
forward until its last pending backward (False: one all-gather per micro-batch instead of two, the memory of the
whole stage between a micro-batch's forward and backward). The `prefetch` units after it (before it, in backward)
are gathered asynchronously while it computes. Stage 2 keeps the whole buffer and all-gathers the updated shards
after the step, as ZeRO-1 does.

Every collective is posted in the same order on every rank of the group, as NCCL requires: stage 2 launches its
reduce-scatters in backward order as their gradients complete (a unit waits for the ones before it); stage 3
ties both its gathers and its reduce-scatters to the modules' order (a unit is reduced when the module before it
begins its backward), never to when a gradient arrives, which may differ between ranks.
"""
from __future__ import annotations

import torch
from torch import nn

from nanoexp.parallel.collectives import all_gather_into, reduce_scatter_into
from nanoexp.parallel.trace import NO_TRACE


class Unit:
    """One unit's sharded parameters. `full` is the padded flat buffer the parameters view; `shard` this
    rank's part of it (a view of `full` at stage 2, a tensor of its own at stage 3); `shard_grad` the summed
    gradient of the shard (a view of the chunk's `shard_grads`)."""

    def __init__(self, index: int, module: nn.Module | None, params: list[nn.Parameter], group_size: int):
        self.index, self.module, self.params = index, module, params
        numel = sum(p.numel() for p in params)
        self.padded = -(-numel // group_size) * group_size
        self.shard_size = self.padded // group_size
        self.offsets = {}
        offset = 0
        for p in params:
            self.offsets[id(p)] = offset
            offset += p.numel()
        self.full = self.shard = self.shard_grad = None
        self.gather_work = None        # an all-gather in flight into `full`
        self.gathered = True
        self.pending_backwards = 0     # forwards (with grad) whose backward has not run yet
        self.num_ready = 0             # gradients in, this micro-batch


class ShardedBuffers:
    """One chunk's units (ZeRO-2 or ZeRO-3) and their part in the step.

    Promises:
      * Between `before_backward()` and `after_backward()` of each micro-batch, each unit's gradients are
        reduce-scattered once all of them are in (units in backward order); after `after_backward()` they
        are added to `shard_grads` and no `.grad` of a unit's parameter is held. `finish()` divides by the
        group size: `shard_grads` is then the dp x cp average of this rank's shard of the step's gradient.
      * Stage 3: a unit's parameters are whole during its forward and its backward (module hooks), freed
        otherwise (module docstring).
      * `units[i].module` is the module whose forward uses unit i's parameters; modules run in unit order.
    """

    def __init__(self, units: list[tuple[nn.Module, list[nn.Parameter]]], group, group_size: int, group_rank: int,
                 stage: int, prefetch: int = 1, reshard_after_forward: bool = True, trace=NO_TRACE):
        assert stage in (2, 3) and group_size > 1
        self.group, self.group_size, self.group_rank, self.stage = group, group_size, group_rank, stage
        self.prefetch, self.reshard_after_forward, self.trace = prefetch, reshard_after_forward, trace
        units = [(module, [p for p in params if p.requires_grad]) for module, params in units]
        self.units = [Unit(i, module, params, group_size) for i, (module, params) in enumerate(
            (module, params) for module, params in units if params)]   # index: the position in self.units
        self.unit_of = {id(p): unit for unit in self.units for p in unit.params}
        self.params = [p for unit in self.units for p in unit.params]
        device = self.params[0].device if self.params else torch.device("cpu")
        self.shard_grads = torch.zeros(sum(u.shard_size for u in self.units), dtype=torch.float32, device=device)
        offset = 0
        for unit in self.units:
            self._build(unit, device)
            unit.shard_grad = self.shard_grads[offset:offset + unit.shard_size]
            offset += unit.shard_size
            for p in unit.params:
                p.grad = None
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
            if stage == 3:
                self._free(unit)
                unit.module.register_forward_pre_hook(lambda module, args, unit=unit: self._before_forward(unit))
                unit.module.register_forward_hook(lambda module, args, out, unit=unit: self._after_forward(unit, out))
        self.in_backward, self.armed, self.in_flight = False, False, []

    def _build(self, unit: Unit, device) -> None:
        """Move the unit's parameters into its flat buffer (their `.data` becomes a view of it)."""
        unit.full = torch.zeros(unit.padded, dtype=torch.float32, device=device)
        for p in unit.params:
            offset = unit.offsets[id(p)]
            unit.full[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = unit.full[offset:offset + p.numel()].view_as(p)
        lo = self.group_rank * unit.shard_size
        unit.shard = unit.full[lo:lo + unit.shard_size]
        if self.stage == 3:
            unit.shard = unit.shard.clone()

    # -- stage 3: whole parameters only while in use -----------------------------------------
    def _gather(self, unit: Unit) -> None:
        """Post the all-gather of `unit` (nothing if it is whole or on its way)."""
        if unit.gathered or unit.gather_work is not None:
            return
        unit.full.untyped_storage().resize_(unit.padded * unit.full.element_size())
        unit.gather_work = all_gather_into(unit.full, unit.shard, self.group, async_op=True)
        self.trace.mark("gather_launch", unit=unit.index)

    def _wait_gathered(self, unit: Unit) -> None:
        self._gather(unit)
        if unit.gather_work is not None:
            with self.trace.span("gather_wait", unit=unit.index):
                unit.gather_work.wait()
            unit.gather_work, unit.gathered = None, True

    def _free(self, unit: Unit) -> None:
        if unit.gather_work is not None:   # a prefetch nobody used: let it land first
            self._wait_gathered(unit)
        unit.full.untyped_storage().resize_(0)
        unit.gathered = False

    def _use(self, unit: Unit, step: int) -> None:
        """Make `unit` whole now, and post the gathers of the `prefetch` units that run next (`step` is +1 in
        forward, -1 in backward)."""
        self._wait_gathered(unit)
        for k in range(1, self.prefetch + 1):
            if 0 <= unit.index + step * k < len(self.units):
                self._gather(self.units[unit.index + step * k])

    def _before_forward(self, unit: Unit) -> None:
        if self.in_backward:   # a recomputed forward (activation checkpointing): already whole
            self._wait_gathered(unit)
        else:
            self._use(unit, +1)

    def _after_forward(self, unit: Unit, out) -> None:
        if self.in_backward:
            return
        if isinstance(out, torch.Tensor) and out.requires_grad:
            unit.pending_backwards += 1
            out.register_hook(lambda grad, unit=unit: self._before_backward_of(unit))
        if self.reshard_after_forward or unit.pending_backwards == 0:
            self._free(unit)

    def _before_backward_of(self, unit: Unit) -> None:
        """Stage 3, as `unit`'s backward starts (its output's gradient is complete, so the units after it are
        done): reduce-scatter those, then make `unit` whole and prefetch. Tied to the modules' order, not to
        when gradients arrive, so that the gathers and reduce-scatters are issued in the same order on every
        rank even when a rank's gradients come in another order or not at all."""
        self._launch_ready(flush=True, stop=unit.index + 1)
        self._use(unit, -1)

    # -- gradients: reduce-scattered unit by unit, every micro-batch --------------------------------
    def before_backward(self) -> None:
        """Call right before each backward through this chunk."""
        for unit in self.units:
            unit.num_ready = 0
        self._next_launch, self.armed, self.in_backward = len(self.units) - 1, True, True

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        unit = self.unit_of[id(p)]
        if not self.armed:
            raise RuntimeError("a sharded parameter got a gradient outside the pipeline's backward")
        if unit.index > self._next_launch:   # stage 3 reduced it when the module before it began its backward
            raise RuntimeError(f"a gradient of unit {unit.index} came after its reduce-scatter: a parameter used "
                               "outside its module cannot be sharded by ZeRO-3")
        unit.num_ready += 1
        if self.stage == 2:   # stage 3 launches by module order (_before_backward_of)
            self._launch_ready(flush=False)

    @torch.no_grad()
    def _launch_ready(self, flush: bool, stop: int = 0) -> None:
        """Reduce-scatter complete units in backward order, down to unit `stop` (all of them with `flush`: a
        gradient that never came counts as zeros)."""
        while self._next_launch >= stop:
            unit = self.units[self._next_launch]
            if not flush and unit.num_ready < len(unit.params):
                return
            self._after_backward_of(unit)   # its backward is done: its parameters can go before its gradients
            while self.in_flight:   # one reduce-scatter in flight: its copies (gloo's too) live until it lands
                self._land(*self.in_flight.pop())
            flat = torch.zeros(unit.padded, dtype=torch.float32, device=self.shard_grads.device)
            for p in unit.params:
                if p.grad is not None:
                    flat[unit.offsets[id(p)]:unit.offsets[id(p)] + p.numel()].copy_(p.grad.reshape(-1))
                    p.grad = None
            summed = torch.empty_like(unit.shard_grad)
            work = reduce_scatter_into(summed, flat, self.group, async_op=True)
            self.trace.mark("reduce_scatter_launch", unit=unit.index)
            self.in_flight.append((unit, work, summed, flat))
            self._next_launch -= 1

    def _land(self, unit: Unit, work, summed: torch.Tensor, flat: torch.Tensor) -> None:
        """Wait for a unit's reduce-scatter and add its sum into the unit's gradient shard."""
        with self.trace.span("reduce_scatter_wait", unit=unit.index):
            work.wait()
        unit.shard_grad.add_(summed)

    def _after_backward_of(self, unit: Unit) -> None:
        if self.stage == 3:
            unit.pending_backwards = max(unit.pending_backwards - 1, 0)
            if self.reshard_after_forward or unit.pending_backwards == 0:
                self._free(unit)

    @torch.no_grad()
    def after_backward(self) -> None:
        """Call right after each backward through this chunk: the rest of the units go, and every
        reduce-scatter of the micro-batch is added into `shard_grads`."""
        self._launch_ready(flush=True)
        while self.in_flight:
            self._land(*self.in_flight.pop())
        self.armed, self.in_backward = False, False

    @torch.no_grad()
    def finish(self) -> None:
        """The step's backwards are done: average the summed shards."""
        self.shard_grads.div_(self.group_size)

    def zero_grad(self) -> None:
        self.shard_grads.zero_()
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def gather_parameters(self) -> list:
        """Stage 2, after the update: post the all-gather of every unit's updated shard into its whole
        buffer; returns the works to wait on. Stage 3 updated its shards in place: nothing to do."""
        if self.stage == 3:
            return []
        return [all_gather_into(unit.full, unit.shard, self.group, async_op=True) for unit in self.units]

    def shard_pieces(self, piece_type) -> list:
        """`piece_type(param, start, end, value, grad)` for the part of each parameter in this rank's shard."""
        pieces = []
        for unit in self.units:
            lo = self.group_rank * unit.shard_size
            for p in unit.params:
                offset = unit.offsets[id(p)]
                a, b = max(lo, offset), min(lo + unit.shard_size, offset + p.numel())
                if a < b:
                    pieces.append(piece_type(p, a - offset, b - offset, unit.shard[a - lo:b - lo],
                                             unit.shard_grad[a - lo:b - lo]))
        return pieces

    def persistent_bytes(self) -> tuple[int, int]:
        """(parameter, gradient) bytes held between steps."""
        values = sum((u.shard_size if self.stage == 3 else u.padded) for u in self.units) * 4
        return values, self.shard_grads.numel() * 4

