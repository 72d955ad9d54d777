"""GradientSync: the one owner of gradient synchronisation. After `finish()` every gradient the update reads is
final: averaged over the dp x cp ranks that hold the same weights, summed where one replica holds a parameter
twice (sequence-parallel norms over tp, a tied embedding's two pipeline copies over the embedding group). It sorts
the parameters that need more than the average (`ParameterCategories`, with its table) and gives each chunk a ZeRO
engine (zero/engine.py) over dp x cp, and under expert parallelism one for the routed experts over edp, divided by
dp x cp; under hybrid sharding (parallelism.dp_shard) over the shard group and the experts' shard group, each shard
then summed across the replicas. The rules and why: docs/zero.md."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from nanoexp.model.placement import counted_here, placement
from nanoexp.parallel.zero.engine import ZeroEngine, ZeroOptions
from nanoexp.parallel.zero.units import ShardPiece
from nanoexp.instruments.trace import NO_TRACE


@dataclass
class ParameterCategories:
    """This rank's parameters whose gradients need more than their engine's dp x cp average, by why. Every other
    parameter is plain: its engine reduces it in the backward (zero/accumulated.py or zero/scattered.py `reduce`).

    | category              | what it holds                                   | reduced by, when                       |
    |-----------------------|-------------------------------------------------|----------------------------------------|
    | sequence_parallel     | norms under sequence parallelism (partial on tp)| summed over tp by finish(), then engine|
    | tied_across_stages    | a tied embedding's ends on first and last stage | engine, alone; finish() sums the ends  |
    | used_twice            | used by two modules of this rank (a tied head)  | engine, as the last backward ends      |
    | tied_across_chunks    | used by two chunks of this rank (zbv's V)       | the first chunk's engine, by finish()  |
    | outside_gather_format | ZeRO-3 in FP8: a module's parameters not in FP8 | engine, as the last backward ends      |

    What the engines read: all but tied_across_chunks (itself used twice) are `always_accumulated` (whole at every
    stage, one reduction a step), sequence_parallel and tied_across_chunks are `reduced_in_finish`, and
    tied_across_stages is `all_reduced_whole` (the two ends then stay identical to the bit: docs/zero.md)."""
    sequence_parallel: list[nn.Parameter]
    tied_across_stages: list[nn.Parameter]
    used_twice: list[nn.Parameter]
    tied_across_chunks: list[nn.Parameter]
    outside_gather_format: list[nn.Parameter]

    @classmethod
    def of(cls, chunks, gather_format=None) -> ParameterCategories:
        """Sort the parameters of `chunks` (per chunk its units, (module, parameters)); `gather_format`: ZeRO-3's
        (model.fp8.gather_in_fp8), a unit travels in one format."""
        uses = [p for chunk in chunks for _module, unit in chunk for p in unit]   # a tied head twice
        params, count, users = list({id(p): p for p in uses}.values()), Counter(map(id, uses)), chunks_using(chunks)
        takes = gather_format.takes if gather_format is not None else None
        outside = [p for chunk in held_by_first_chunk(chunks) for _module, unit in chunk
                   if takes and any(map(takes, unit)) for p in unit if not takes(p)]
        return cls(sequence_parallel=[p for p in params if placement(p).sequence_parallel],
                   tied_across_stages=[p for p in params if placement(p).tied_across_stages],
                   used_twice=[p for p in params if count[id(p)] > 1],
                   tied_across_chunks=[p for p in params if len(set(users[id(p)])) > 1],
                   outside_gather_format=outside)

    @property
    def always_accumulated(self) -> list[nn.Parameter]:
        return self.sequence_parallel + self.tied_across_stages + self.used_twice + self.outside_gather_format

    @property
    def reduced_in_finish(self) -> list[nn.Parameter]:
        return self.sequence_parallel + self.tied_across_chunks

    @property
    def all_reduced_whole(self) -> list[nn.Parameter]:
        return self.tied_across_stages


def chunks_using(chunks) -> dict[int, list[int]]:
    """The chunks that use each parameter (by id), in chunk order."""
    users: dict[int, list[int]] = {}
    for c, chunk in enumerate(chunks):
        for p in (p for _module, unit in chunk for p in unit):
            users.setdefault(id(p), []).append(c)
    return users


def held_by_first_chunk(chunks):
    """`chunks` with a parameter two chunks use (zbv: the embedding in chunk 0, the head in chunk 1) kept in the
    first's units only: its engine holds it and reduces it after the step's last backward, whichever that is."""
    users = chunks_using(chunks)
    return [[(module, [p for p in unit if users[id(p)][0] == c]) for module, unit in chunk]
            for c, chunk in enumerate(chunks)]


class GradientSync:
    """The gradients of this rank's model shard, from the pipeline's backward to the update.

        sync = GradientSync(model.units_by_chunk(), ctx, stage=cfg.optimizer.zero_stage)
        engine.run(..., grad_sync=sync)   # before_backward / after_backward around each chunk's backward
        sync.finish()                     # SP and tied sums, every gradient averaged over dp x cp
        clip by sync.norm_inputs(); optimizer.step(); sync.zero_grad()

    `chunks[c]` are the units of chunk c of the model, (module, its parameters) in forward order (a plain list
    of parameters is one unit without a module: enough below stage 3). With dp x cp = 1 there is nothing to
    shard: stages 2 and 3 run as stage 1. `options`: the engines' settings (zero/engine.py ZeroOptions).
    """

    def __init__(self, chunks: list[list[tuple[nn.Module, list[nn.Parameter]]]], ctx, stage: int = 0,
                 options: ZeroOptions = ZeroOptions(), trace=NO_TRACE):
        self.ctx, self.stage = ctx, stage if ctx.dp_cp > 1 else min(stage, 1)
        self.shard = self.stage >= 1
        chunks = [chunk if chunk and isinstance(chunk[0], tuple) else [(None, list(chunk))] for chunk in chunks]
        self.categories = ParameterCategories.of(chunks, options.gather_format if self.stage == 3 else None)
        self.engines, self.expert_engines = [], []
        for c, chunk in enumerate(held_by_first_chunk(chunks)):
            expert = [(module, [p for p in unit if placement(p).expert]) for module, unit in chunk]
            other = [(module, [p for p in unit if not placement(p).expert]) for module, unit in chunk]
            self.engines.append(self._engine(other, False, options, trace.bind(chunk=c)))
            if ctx.ep > 1:   # routed experts: summed over the edp ranks that hold them, averaged over dp x cp
                self.expert_engines.append(self._engine(expert, True, options, trace.bind(chunk=c, experts=True)))
        self.by_chunk = [[engine, *self.expert_engines[c:c + 1]] for c, engine in enumerate(self.engines)]
        self.all_engines = self.engines + self.expert_engines   # in the order every rank finishes them

    def _engine(self, units, expert: bool, options: ZeroOptions, trace) -> ZeroEngine:
        """The engine of `units` over ZeRO's groups (ParallelContext.zero_axes), averaging over dp x cp. A shard
        group of one rank under hybrid sharding shards nothing: stage 0 over the replicas, each holding all."""
        shard, replica = self.ctx.zero_axes(expert)
        if shard.size == 1 and replica.size > 1:
            return ZeroEngine(units, replica, 0, self.categories, options, self.ctx.dp_cp, trace=trace)
        return ZeroEngine(units, shard, self.stage, self.categories, options, self.ctx.dp_cp, replica, trace)

    # -- the step, driving each engine's paths (zero/accumulated.py, scattered.py, gathered.py) ---------------
    def before_backward(self, chunk: int, last: bool) -> None:
        """Call right before each backward through chunk `chunk`; `last`: its last of the step (from then on each
        accumulated unit is reduced as soon as its gradients are final)."""
        for engine in self.by_chunk[chunk]:
            if engine.scattered is not None:
                engine.scattered.before_backward()
            if last:
                engine.accumulated.before_last_backward()

    def after_backward(self, chunk: int, last: bool) -> None:
        """Call right after each backward through chunk `chunk`: its reduce-scatters (ZeRO-2/3) land."""
        for engine in self.by_chunk[chunk]:
            if engine.scattered is not None:
                engine.scattered.after_backward()

    def before_input_backward(self, chunk: int) -> None:
        """Call right before a B step (the input's gradient alone, the weights' waiting for W) through `chunk`:
        ZeRO-3 gathers the weights B multiplies by."""
        for engine in self.by_chunk[chunk]:
            if engine.gathered is not None:
                engine.gathered.before_input_backward()

    def after_input_backward(self, chunk: int) -> None:
        for engine in self.by_chunk[chunk]:
            if engine.gathered is not None:
                engine.gathered.after_input_backward()

    def finish(self) -> None:
        """Every gradient final (ParameterCategories' table): the sequence-parallel sums over tp, each engine's
        paths averaged, then the tied ends summed over the embedding group, in this order on every rank."""
        ctx, categories = self.ctx, self.categories
        if ctx.tp > 1:
            all_reduce_grads(categories.sequence_parallel, ctx.tp_group)   # partial on each tp rank: summed first
        for engine in self.all_engines:
            engine.accumulated.reduce(rest=True)   # what the last backward's hooks did not post
            engine.accumulated.finish()            # every reduction waited for, then the average
        for engine in self.all_engines:
            if engine.scattered is not None:   # reduce-scattered in every backward (ScatteredGradients.reduce)
                engine.scattered.finish()
        all_reduce_grads(categories.tied_across_stages, ctx.embedding_group)   # the two ends summed

    def zero_grad(self) -> None:
        for engine in self.all_engines:
            engine.accumulated.zero_grad()
            if engine.scattered is not None:
                engine.scattered.zero_grad()

    # -- what the optimizer reads ------------------------------------------------------------
    def held_as_shards(self) -> set[int]:
        """ZeRO-3: the ids of the parameters held only as `shard_pieces()` (over the ranks; a rank may hold
        no piece of one); their whole values are gathered for their module's forward and backward, then freed."""
        return set().union(*(engine.held_as_shards() for engine in self.all_engines))

    def shard_pieces(self) -> list[ShardPiece]:
        """ZeRO: the parts of parameters this rank updates, with their averaged gradients."""
        return self._pieces(self.all_engines)

    def first_copy_pieces(self) -> list[ShardPiece]:
        """The shard pieces of which this rank holds the first copy (ZeroEngine.first_copy): what the gradient
        norm counts and checkpoints write; all of them without hybrid sharding."""
        return self._pieces([engine for engine in self.all_engines if engine.first_copy])

    @staticmethod
    def _pieces(engines: list[ZeroEngine]) -> list[ShardPiece]:
        """The shard pieces of `engines`: every accumulated one, then every scattered one (the optimizer's order)."""
        return ([piece for engine in engines for piece in engine.accumulated.pieces()]
                + [piece for engine in engines if engine.scattered is not None for piece in engine.scattered.pieces()])

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """ZeRO-1 and 2, after the update of the shard pieces: every rank gets every updated parameter."""
        works = [work for engine in self.all_engines for work in engine.gather_parameters(engine.accumulated.units)]
        works += [work for engine in self.all_engines if engine.scattered is not None
                  for work in engine.gather_parameters(engine.scattered.units)]
        for work in works:
            work.wait()

    def norm_inputs(self, params: list[nn.Parameter]) -> tuple[list, list, object]:
        """What clipping reads: the gradients the update uses, those of them that count in the global norm
        (each element of the model once), and the group their squares are summed over. ZeRO: this rank's
        shard pieces, summed over every rank, each piece counted on its first copy (under hybrid sharding the
        replicas hold the same pieces: replica 0 counts them, `first_copy_pieces`); else
        every parameter's gradient (already identical across dp x cp), summed over the replica's
        model-parallel group; with expert parallelism, whose experts differ between the ep ranks, over every
        rank, each element counted on the first rank that holds it (ParallelContext.replica_rank)."""
        ctx = self.ctx
        if self.shard:
            grads = [piece.grad for piece in self.shard_pieces()]
            counted = [piece.grad for piece in self.first_copy_pieces() if counted_here(piece.param, ctx.tp_rank)]
            return grads, counted, dist.group.WORLD if ctx.world_size > 1 else None
        used = [(p.grad, p) for p in params if p.grad is not None]
        if ctx.ep > 1:
            counted = [g for g, p in used if counted_here(p, ctx.tp_rank) and ctx.replica_rank(p) == 0]
            return [g for g, _ in used], counted, dist.group.WORLD
        group = ctx.model_parallel_group if ctx.tp * ctx.pp > 1 else None
        return [g for g, _ in used], [g for g, p in used if counted_here(p, ctx.tp_rank)], group

    def buffer_bytes(self) -> tuple[int, int]:
        """(parameter, gradient) bytes of the buffers (ZeroEngine.buffer_bytes)."""
        sizes = [engine.buffer_bytes() for engine in self.all_engines]
        return sum(v for v, _ in sizes), sum(g for _, g in sizes)


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
