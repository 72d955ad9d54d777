"""ZeRO 0-3 in one engine: a chunk's parameters in flat float32 buffers whose gradients are averaged over the ranks
holding the same weights (dp x cp; for routed experts, edp), and, from stage 1, sharded so that each rank updates
its 1/d. The stage picks a unit's lane: "accumulate" (autograd sums the micro-batches into a whole buffer, reduced
once in the last backward) or "every_backward" (reduce-scattered after each backward into the rank's gradient
shard; at stage 3 the parameters are gathered only while their module runs). Collectives are posted in unit or
module order, never in gradient-arrival order, as NCCL requires. Design and measurements: docs/zero.md."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from nanoexp.parallel.buckets import bucket_full, size_buckets
from nanoexp.parallel.collectives import all_gather_into, all_reduce_each, reduce_scatter_into
from nanoexp.parallel.units import GatherFormat, ShardPiece, Stage, Unit
from nanoexp.instruments.trace import NO_TRACE


class Sharding:
    """One chunk's parameters over one group (`group`, `size` ranks, this one `rank`), at `stage`.

    `units`: (module, its parameters) in forward order (a plain list of parameters is one unit without a
    module: enough below stage 3). `kept_whole`: parameters that stay whole and accumulate at any stage (held
    twice in a replica: summed over another group first); `deferred`: parameters whose reduction starts only in
    `finish()` (after a tp sum); `alone`: parameters all-reduced whole in a unit of their own even when sharded.
    Gradients are summed over the group and divided by `average_over` (default: the group's size); with `replicas`
    (hybrid sharding: an Axis of the ranks holding the same shard, ParallelContext.zero_axes) each summed shard is
    then summed over them, once a step in `finish_*()`, before the division. Stage 3 gathers
    a unit whose parameters `gather_format` all takes in that format (units.GatherFormat), others in float32. With
    `split_backward` (zb_h1) the before/after calls come around each W step and B's gradients wait for the next.

    The step: `before_backward(last)` / `after_backward()` around each backward through the chunk, `finish()`
    after the last, the optimizer on `shard_pieces()`, `gather_parameters()`, `zero_grad()`.
    """

    def __init__(self, units, group, size: int, rank: int, stage: int, bucket_cap_mb: float = 25.0,
                 kept_whole=(), deferred=(), alone=(), prefetch: int = 1, reshard_after_forward: bool = True,
                 trace=NO_TRACE, average_over: int | None = None, overlap_reduce_scatter: bool = True,
                 gather_format: GatherFormat | None = None, split_backward: bool = False, replicas=None):
        self.group, self.size, self.rank, self.gather_format = group, size, rank, gather_format
        self.split_backward = split_backward   # B and W apart (zb_h1): reductions follow the W steps
        self.overlap_reduce_scatter = overlap_reduce_scatter
        self.enabled = group is not None and size > 1
        self.stage = Stage(stage if self.enabled else min(stage, 1))   # one rank: nothing to reduce or gather
        self.prefetch, self.reshard_after_forward, self.trace = prefetch, reshard_after_forward, trace
        self.average_over = average_over or size
        self.replicas = replicas if replicas is not None and replicas.size > 1 else None
        units = [(module, [p for p in params if p.requires_grad]) for module, params in units]
        self.accumulated = self._plan_accumulated(units, kept_whole, deferred, alone, bucket_cap_mb)
        self.scattered = self._plan_scattered(units, kept_whole, bucket_cap_mb)
        device = next((p.device for _, params in units for p in params), torch.device("cpu"))
        for unit in self.accumulated + self.scattered:
            unit.build(device, own_shard=self.stage.shards_parameters and not unit.accumulate)
        for unit in self.scattered:   # each its own storage, held from its first landing to zero_grad (as FSDP2)
            unit.shard_grad = torch.zeros(unit.shard_size, dtype=torch.float32, device=device)
        self.unit_of = {id(p): unit for unit in self.accumulated + self.scattered for p in unit.params}
        self.params = [p for unit in self.accumulated + self.scattered for p in unit.params]
        for p in self.params:
            if self.enabled or not self.unit_of[id(p)].accumulate:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        if self.stage.shards_parameters:
            for unit in self.scattered:
                self._free(unit)
                unit.module.register_forward_pre_hook(lambda module, args, unit=unit: self._before_forward(unit))
                unit.module.register_forward_hook(lambda module, args, out, unit=unit: self._after_forward(unit, out))
        self._ready, self.in_backward, self.in_flight = None, False, []
        self.in_input_backward, self._whole_for_b = False, []   # split backward: a B step, the units it gathered   # _ready: the last backward's gradients in
        self.scattered_pieces()   # before zero_grad frees the gradient shards
        self.zero_grad()

    # -- planning -------------------------------------------------------------------------------------
    def _plan_accumulated(self, units, kept_whole, deferred, alone, cap_mb) -> list[Unit]:
        """Accumulate units of about cap_mb, in reverse order (backward makes the last layers' gradients first,
        so the first unit fills earliest), deferred ones last; an `alone` parameter gets a unit of its own where
        the order reaches it. Stages 0-1: every parameter; stages 2-3: those kept whole."""
        kept = {id(p) for p in kept_whole}
        params = list({id(p): p for _, unit in units for p in unit
                       if not self.stage.shards_gradients or id(p) in kept}.values())
        deferred_ids, alone_ids, out = {id(p) for p in deferred}, {id(p) for p in alone}, []
        sharded = self.stage.shards_state
        for later in (False, True):
            current = []
            for p in (p for p in reversed(params) if (id(p) in deferred_ids) == later):
                if id(p) in alone_ids or (current and bucket_full(current, p, cap_mb)):
                    if current:
                        out.append(Unit(len(out), None, current, self.size, self.rank, sharded, True, later))
                    current = []
                if id(p) in alone_ids:
                    out.append(Unit(len(out), None, [p], self.size, self.rank, sharded, True, later, alone=True))
                else:
                    current.append(p)
            if current:
                out.append(Unit(len(out), None, current, self.size, self.rank, sharded, True, later))
        return out

    def _plan_scattered(self, units, kept_whole, cap_mb) -> list[Unit]:
        """Stage 3: one unit per module that runs as one block (the embedding, a layer, the norm, the head);
        stage 2, where nothing is gathered: consecutive parameters in buckets of about cap_mb."""
        if not self.stage.shards_gradients:
            return []
        kept = {id(p) for p in kept_whole}
        units = [(module, [p for p in params if id(p) not in kept]) for module, params in units]
        if self.stage.number == 2:
            units = [(None, bucket) for bucket in size_buckets([p for _, params in units for p in params], cap_mb)]
        units = [(module, params) for module, params in units if params]
        return [Unit(i, module, params, self.size, self.rank, True, False, wire=self._wire(params))
                for i, (module, params) in enumerate(units)]

    def _wire(self, params):
        """The gather format of a stage-3 unit whose parameters it all takes, else None (float32)."""
        fmt = self.gather_format
        takes = fmt is not None and self.stage.shards_parameters and all(map(fmt.takes, params))
        return fmt if takes else None

    # -- gradients ------------------------------------------------------------------------------------
    def before_backward(self, last: bool) -> None:
        """Call right before each backward through the chunk; `last`: its last of the step (from then on each
        accumulate unit starts its reduction as soon as its gradients are final)."""
        if self.scattered:
            for unit in self.scattered:
                unit.num_ready = 0
            self._next_scattered, self.in_backward = len(self.scattered) - 1, True
        if last and self.enabled:
            for unit in self.accumulated:
                unit.num_ready, unit.handle = 0, None
            self._ready, self._next_accumulated = set(), 0

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        unit = self.unit_of[id(p)]
        if unit.accumulate:
            if self._ready is None or unit.deferred:   # accumulating, or reduced by finish() whenever it comes
                return
            if id(p) in self._ready:   # its unit may already be on the wire: a second gradient would be lost
                raise RuntimeError("a parameter received two gradients in the last backward of the step")
            self._ready.add(id(p))
            unit.num_ready += 1
            self._launch_accumulated(from_hook=True)
            return
        if not self.in_backward:
            if self.split_backward:   # a B step's (norms, embedding): kept in .grad for the next W's reduce-scatter
                return
            raise RuntimeError("a sharded parameter got a gradient outside the pipeline's backward")
        if unit.index > self._next_scattered:   # stage 3 reduced it when the module before it began its backward
            raise RuntimeError(f"a gradient of unit {unit.index} came after its reduce-scatter: a parameter used "
                               "outside its module cannot be sharded by ZeRO-3")
        unit.num_ready += 1
        if not self.stage.shards_parameters or self.split_backward:   # stage 3 in B and W: by W's order
            self._launch_scattered(flush=False)

    def _launch_accumulated(self, from_hook: bool) -> None:
        """Start the reductions of complete accumulate units, strictly in unit order; hooks never start a
        deferred one."""
        while self._next_accumulated < len(self.accumulated):
            unit = self.accumulated[self._next_accumulated]
            if unit.num_ready < len(unit.params) or (from_hook and unit.deferred):
                return
            if unit.sharded and not unit.alone:
                unit.handle = reduce_scatter_into(unit.shard_grad, unit.grads, self.group, async_op=True)
            else:
                unit.handle = dist.all_reduce(unit.grads, group=self.group, async_op=True)
            self.trace.mark("allreduce_launch", bucket=unit.index, in_backward=from_hook)
            self._next_accumulated += 1

    @torch.no_grad()
    def _launch_scattered(self, flush: bool, stop: int = 0) -> None:
        """Reduce-scatter complete every_backward units in backward order, down to unit `stop` (all of them with
        `flush`: a gradient that never came counts as zeros); with `overlap_reduce_scatter` one stays in flight
        during the next unit's backward, without it each is waited for at once."""
        while self._next_scattered >= stop:
            unit = self.scattered[self._next_scattered]
            if not flush and unit.num_ready < len(unit.params):
                return
            if not self.split_backward:   # a W needs no weights: B freed them
                self._after_backward_of(unit)   # its backward is done: its parameters can go before its gradients
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
            if not self.overlap_reduce_scatter:
                self._land(*self.in_flight.pop())
            self._next_scattered -= 1

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
        """Call right after each backward through the chunk: the rest of the every_backward units go, and their
        reduce-scatters are added into the gradient shards."""
        if not self.scattered:
            return
        self._launch_scattered(flush=True)
        while self.in_flight:
            self._land(*self.in_flight.pop())
        self.in_backward = False

    @torch.no_grad()
    def finish_accumulated(self) -> None:
        """The step's backwards are done: start the accumulate units not started yet (deferred ones, gradients
        that never arrived), wait for all, and average."""
        if not self.accumulated:
            return
        if not self.enabled:
            if self.average_over > 1:
                for unit in self.accumulated:
                    unit.grads.div_(self.average_over)
            return
        if self._ready is None:
            raise RuntimeError("finish() without a last backward: no gradients were collected")
        for unit in self.accumulated:
            unit.num_ready = len(unit.params)
        self._launch_accumulated(from_hook=False)
        for unit in self.accumulated:
            with self.trace.span("allreduce_wait", bucket=unit.index):
                unit.handle.wait()
            unit.handle = None
        summed = [unit.grads if unit.alone else unit.shard_grad for unit in self.accumulated]
        self._across_replicas(summed)
        for grads in summed:
            grads.div_(self.average_over)
        self._ready = None

    def _across_replicas(self, shards: list[torch.Tensor]) -> None:
        """Hybrid sharding: sum each shard (summed over the shard group) over the replicas holding it, all posted
        before any is waited for, in unit order on every rank."""
        if self.replicas is None:
            return
        with self.trace.span("replica_all_reduce_wait"):
            all_reduce_each(shards, self.replicas.group)

    @torch.no_grad()
    def finish_scattered(self) -> None:
        """The step's backwards are done: sum the gradient shards across replicas (once a step: the same sum as
        after every micro-batch's reduce-scatter, for 1/m of the bytes), and average them."""
        self._across_replicas([unit.shard_grad for unit in self.scattered])
        for unit in self.scattered:
            unit.shard_grad.div_(self.average_over)

    def final_gradients(self) -> list[torch.Tensor]:
        """After `finish_*()`: the tensors holding this rank's averaged gradients (a unit reduced whole: its whole
        buffer; else this rank's shard)."""
        return [unit.grads if unit.alone else unit.shard_grad for unit in self.accumulated] + [
            unit.shard_grad for unit in self.scattered]

    def zero_grad(self) -> None:
        """Zero every gradient: an accumulate unit's `.grad` views of its buffer in place (re-attached if
        replaced); a sharded unit's gradient shard is freed until its next reduce-scatter lands."""
        for unit in self.accumulated:
            unit.grads.zero_()
            for p in unit.params:
                if p.grad is None or p.grad.data_ptr() != unit.view(unit.grads, p).data_ptr():
                    p.grad = unit.view(unit.grads, p)
        for unit in self.scattered:
            unit.shard_grad.untyped_storage().resize_(0)
            for p in unit.params:
                p.grad = None

    # -- parameters -----------------------------------------------------------------------------------
    def gather_parameters(self, units: list[Unit]) -> list:
        """After the update of the shards: post the all-gather of each unit's updated shard into its whole
        buffer (stage 3's every_backward units are gathered when next used); returns the works to wait on."""
        if not self.enabled:
            return []
        return [all_gather_into(unit.values, unit.shard, self.group, async_op=True) for unit in units
                if unit.sharded and not (self.stage.shards_parameters and not unit.accumulate)]

    def _gather(self, unit: Unit) -> None:
        """Post the all-gather of `unit` (nothing if it is whole or on its way)."""
        if unit.gathered or unit.gather_work is not None:
            return
        whole, shard = (unit.values, unit.shard) if unit.wire is None else (unit.wire_values,
                                                                          unit.wire.encode(unit, self.group))
        whole.untyped_storage().resize_(unit.padded * whole.element_size())
        unit.gather_work = all_gather_into(whole, shard, self.group, async_op=True)
        unit.wire_shard = shard   # kept until the gather lands
        self.trace.mark("gather_launch", unit=unit.index)

    def _wait_gathered(self, unit: Unit) -> None:
        self._gather(unit)
        if unit.gather_work is not None:
            with self.trace.span("gather_wait", unit=unit.index):
                unit.gather_work.wait()
            unit.gather_work, unit.gathered, unit.wire_shard = None, True, None
            if unit.wire is not None:
                unit.wire.decode(unit)

    def _free(self, unit: Unit) -> None:
        if unit.gather_work is not None:   # a prefetch nobody used: let it land first
            self._wait_gathered(unit)
        if unit.wire is not None:
            unit.wire.release(unit)
            unit.wire_values.untyped_storage().resize_(0)
        unit.values.untyped_storage().resize_(0)
        unit.gathered = False

    def _use(self, unit: Unit, step: int) -> None:
        """Make `unit` whole now, and post the gathers of the `prefetch` units that run next (`step`: +1 in
        forward, -1 in backward)."""
        self._wait_gathered(unit)
        for k in range(1, self.prefetch + 1):
            if 0 <= unit.index + step * k < len(self.scattered):
                self._gather(self.scattered[unit.index + step * k])

    # -- a backward split into B and W (split_backward, stage 3) ------------------------------------------
    def before_input_backward(self) -> None:
        """A B step: it gathers each unit's weights as its backward starts and frees them after; the gradients
        wait in .grad for the reduce-scatters of the next W (which needs the weights of no unit)."""
        self.in_input_backward = True

    def after_input_backward(self) -> None:
        while self._whole_for_b:
            self._after_backward_of(self._whole_for_b.pop())
        self.in_input_backward = False

    def _before_forward(self, unit: Unit) -> None:
        if self.in_backward or self.in_input_backward:   # a recomputed forward (activation checkpointing): already whole
            self._wait_gathered(unit)
        else:
            self._use(unit, +1)

    def _after_forward(self, unit: Unit, out) -> None:
        if self.in_backward or self.in_input_backward:
            return
        if isinstance(out, torch.Tensor) and out.requires_grad:
            unit.pending_backwards += 1
            out.register_hook(lambda grad, unit=unit: self._before_backward_of(unit))
        if self.reshard_after_forward or unit.pending_backwards == 0:
            self._free(unit)

    def _before_backward_of(self, unit: Unit) -> None:
        """Stage 3, as `unit`'s backward starts (its output's gradient is complete, so the units after it are
        done): reduce-scatter those, then make `unit` whole and prefetch. In a B step: free those instead (their
        gradients go in W)."""
        if self.in_input_backward:
            while self._whole_for_b and self._whole_for_b[-1].index > unit.index:
                self._after_backward_of(self._whole_for_b.pop())
            self._whole_for_b.append(unit)
        else:
            self._launch_scattered(flush=True, stop=unit.index + 1)
        self._use(unit, -1)

    def _after_backward_of(self, unit: Unit) -> None:
        if self.stage.shards_parameters:
            unit.pending_backwards = max(unit.pending_backwards - 1, 0)
            if self.reshard_after_forward or unit.pending_backwards == 0:
                self._free(unit)

    # -- what the optimizer and the memory report read -------------------------------------------------
    def accumulated_pieces(self) -> list[ShardPiece]:
        return [piece for unit in self.accumulated for piece in unit.pieces()]

    def scattered_pieces(self) -> list[ShardPiece]:
        return [piece for unit in self.scattered for piece in unit.pieces()]

    @property
    def first_copy(self) -> bool:
        """Whether this rank's pieces are the first copy of them, the one norms count and checkpoints write: a
        shard is the only copy unless replicas hold it too (replica 0's is first); unsharded (stage 0), rank 0's."""
        if not self.stage.shards_state:
            return self.rank == 0
        return self.replicas is None or self.replicas.rank == 0

    def held_as_shards(self) -> set[int]:
        """Stage 3: the ids of the parameters held only as shard pieces."""
        return {id(p) for unit in self.scattered for p in unit.params} if self.stage.shards_parameters else set()

    def buffer_bytes(self) -> tuple[int, int]:
        """(parameter, gradient) bytes of the buffers: the parameters held between steps, the gradients from
        backward to the update (ZeRO-2/3 free their gradient shards between steps)."""
        values = sum(u.shard_size if self.stage.shards_parameters else u.padded for u in self.scattered)
        values += sum(u.padded for u in self.accumulated)
        return 4 * values, 4 * (sum(u.padded for u in self.accumulated) + sum(u.shard_size for u in self.scattered))

