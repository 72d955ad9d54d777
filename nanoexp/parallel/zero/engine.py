"""ZeRO 0-3 in one engine: a chunk's parameters in flat float32 buffers (units.Unit) whose gradients are averaged over
the ranks holding the same weights (dp x cp; for routed experts, edp), and, from stage 1, sharded so that each rank
updates its 1/d. The stage picks each unit's path, a file each: accumulated (autograd sums the micro-batches into a
whole buffer, reduced once, in the last backward), scattered (ZeRO-2/3: reduce-scattered after every backward into
the rank's gradient shard) and, at ZeRO-3, gathered (the parameters whole only while their module runs).
Collectives are posted in unit or module order, never in gradient-arrival order, as NCCL requires. Design and
measurements: docs/zero.md."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoexp.parallel.collectives import all_gather_into
from nanoexp.parallel.zero.accumulated import AccumulatedGradients, plan_accumulated
from nanoexp.parallel.zero.gathered import GatheredParameters
from nanoexp.parallel.zero.scattered import ScatteredGradients, plan_scattered
from nanoexp.parallel.zero.units import GatherFormat, Unit, ZeroStage
from nanoexp.instruments.trace import NO_TRACE


@dataclass(frozen=True)
class ZeroOptions:
    """The ZeRO settings every engine of a rank shares (docs/zero.md; build_runtime reads them from the config): the
    size of stage 0-2's units, ZeRO-3's prefetch and whether a module's weights are freed after its forward, whether
    a reduce-scatter stays in flight during the next unit's backward, how ZeRO-3 gathers a number format's weights
    (None: float32), and whether the pipeline runs each backward as B and W (zb_h1: reductions follow the W steps)."""
    bucket_cap_mb: float = 25.0
    prefetch: int = 1
    reshard_after_forward: bool = True
    overlap_reduce_scatter: bool = True
    gather_format: GatherFormat | None = None
    split_backward: bool = False


class ZeroEngine:
    """One chunk's parameters over one group (`axis`: its group, size and this rank) at ZeRO `stage`.

    `units`: (module, its parameters) in forward order (a plain list of parameters is one unit without a module:
    enough below stage 3). `categories` (GradientSync's ParameterCategories) says which parameters are
    `always_accumulated` (whole at any stage), `reduced_in_finish` (not by the backward's hooks: after a tp sum)
    and `all_reduced_whole` (a unit of their own, all-reduced even when sharded). Gradients are summed over the
    group, then with `replicas` (hybrid sharding: an Axis of the ranks holding the same shard) over those once a
    step, and divided by `average_over`.

    It builds the units and the paths that run them in a step (GradientSync drives them): `accumulated`,
    `scattered` (ZeRO-2/3, else None) and `gathered` (ZeRO-3, else None). After the update: `gather_parameters`."""

    def __init__(self, units, axis, stage: int, categories, options: ZeroOptions = ZeroOptions(),
                 average_over: int | None = None, replicas=None, trace=NO_TRACE):
        self.group, self.size, self.rank = axis.group, axis.size, axis.rank
        self.enabled = self.group is not None and self.size > 1
        self.stage = ZeroStage(stage if self.enabled else min(stage, 1))   # one rank: nothing to reduce or gather
        self.replicas = replicas if replicas is not None and replicas.size > 1 else None
        units = [(module, [p for p in params if p.requires_grad]) for module, params in units]
        accumulated, scattered = self._plan(units, categories, options)
        device = next((p.device for _, params in units for p in params), torch.device("cpu"))
        for unit in accumulated + scattered:
            unit.build(device, own_shard=self.stage.shards_parameters and not unit.accumulate)
        average_over = average_over or self.size
        self.accumulated = AccumulatedGradients(accumulated, self.group, self.enabled, average_over, self.replicas,
                                                trace)
        self.scattered = self.gathered = None
        if self.stage.shards_gradients:
            self.scattered = ScatteredGradients(scattered, self.group, average_over, self.replicas, trace,
                                                options.overlap_reduce_scatter, options.split_backward)
        if self.stage.shards_parameters:
            self.gathered = GatheredParameters(self.scattered, self.group, options.prefetch,
                                               options.reshard_after_forward, trace)
        self.accumulated.zero_grad()
        if self.scattered is not None:
            self.scattered.pieces()   # before zero_grad frees the gradient shards
            self.scattered.zero_grad()

    def _plan(self, units, categories, options: ZeroOptions) -> tuple[list[Unit], list[Unit]]:
        """(accumulated, scattered) units: stages 0-1 accumulate every parameter; stages 2-3 those always
        accumulated, the rest scattered."""
        whole = {id(p) for p in categories.always_accumulated}
        params = list({id(p): p for _, unit in units for p in unit
                       if not self.stage.shards_gradients or id(p) in whole}.values())
        accumulated = plan_accumulated(params, self.size, self.rank, self.stage.shards_state,
                                       categories.reduced_in_finish, categories.all_reduced_whole,
                                       options.bucket_cap_mb)
        if not self.stage.shards_gradients:
            return accumulated, []
        units = [(module, [p for p in params if id(p) not in whole]) for module, params in units]
        return accumulated, plan_scattered(units, self.stage, self.size, self.rank, options.bucket_cap_mb,
                                           options.gather_format)

    def gather_parameters(self, units: list[Unit]) -> list:
        """After the update of the shards: post the all-gather of each unit's updated shard into its whole
        buffer (ZeRO-3's scattered units are gathered when next used); returns the works to wait on."""
        if not self.enabled:
            return []
        return [all_gather_into(unit.values, unit.shard, self.group, async_op=True) for unit in units
                if unit.sharded and not (self.stage.shards_parameters and not unit.accumulate)]

    # -- what the optimizer, checkpoints and the memory report read ------------------------------------------
    @property
    def first_copy(self) -> bool:
        """Whether this rank's pieces are the first copy of them, the one norms count and checkpoints write: a
        shard is the only copy unless replicas hold it too (replica 0's is first); unsharded (stage 0), rank 0's."""
        if not self.stage.shards_state:
            return self.rank == 0
        return self.replicas is None or self.replicas.rank == 0

    def held_as_shards(self) -> set[int]:
        """Stage 3: the ids of the parameters held only as shard pieces."""
        return {id(p) for unit in self.gathered.units for p in unit.params} if self.gathered is not None else set()

    def buffer_bytes(self) -> tuple[int, int]:
        """(parameter, gradient) bytes of the buffers: the parameters held between steps, the gradients from
        backward to the update (ZeRO-2/3 free their gradient shards between steps)."""
        accumulated, scattered = self.accumulated.units, self.scattered.units if self.scattered is not None else []
        values = sum(u.shard_size if self.stage.shards_parameters else u.padded for u in scattered)
        values += sum(u.padded for u in accumulated)
        return 4 * values, 4 * (sum(u.padded for u in accumulated) + sum(u.shard_size for u in scattered))
