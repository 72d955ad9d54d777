"""Layout: the parallel shape of a run, built once from the config and asked by everything else.

A run splits its work four ways: dp replicas of the model each read part of the global batch, cp ranks each hold
part of every sequence (context parallel), tp ranks each hold a slice of every large weight, and pp stages each hold
some of the layers (in `virtual_stages` chunks per rank with interleaved 1F1B). A fifth, expert parallelism, adds no
ranks: the dp x cp ranks, which read different tokens, are cut into groups of ep consecutive ones, each of which
holds a mixture's experts once, num_experts / ep on each rank. ZeRO shards over all of dp x cp, or with `dp_shard`
over shard groups of dp_shard x cp ranks, replicated dp / dp_shard times (hybrid sharding). Validation, the sweeps
and launchers, ParallelContext, model building, the memory estimate and the trainer all read these numbers here;
none recomputes them.
Where tied embeddings (model.model_config.tie_word_embeddings) live is decided here too: which stage holds which
copy (`lm_head_weight`) and which stages sum their gradients (`tied_stages`). The model declares the copies on its
parameters (placement.py), and what gradient sync sums, norms count and checkpoints store follows from those
declarations.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from nanoexp.parallel.pipeline.schedules import SCHEDULES
from nanoexp.parallel.pipeline.stages import StageMap

TP_MODES = ("all_reduce", "reduce_scatter")   # parallelism.tp_mode; reduce_scatter is sequence parallelism


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"            # parallelism.pp_engine
    virtual_stages: int = 1           # chunks of layers per pp rank (interleaved_1f1b; 2: zbv, dualpipev)
    cp_mode: str = "ring"
    sequence_parallel: bool = False   # tp_mode=reduce_scatter: activations between blocks split over tp
    ep: int = 1                       # expert parallel: ranks of dp x cp that split a mixture's experts
    dp_shard: int | None = None       # ZeRO shards over dp_shard x cp ranks, dp / dp_shard replicas (None: all dp)

    @classmethod
    def from_config(cls, cfg: Any) -> "Layout":
        """The layout of a (normalised) config."""
        p = cfg.parallelism
        return cls(dp=int(p.dp), cp=int(p.get("cp", 1)), tp=int(p.tp), pp=int(p.pp), schedule=str(p.pp_engine),
                   virtual_stages=int(p.pp_virtual_stages), cp_mode=str(p.get("cp_mode", "ring")),
                   sequence_parallel=p.tp_mode == "reduce_scatter", ep=int(p.get("ep", 1)),
                   dp_shard=None if p.get("dp_shard") is None else int(p.dp_shard))

    @property
    def world_size(self) -> int:
        """Processes a run needs: dp * cp * tp * pp."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same weights and read different tokens: gradients are averaged (and ZeRO-1
        shards its state) over dp x cp."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Expert data parallel: the ranks that hold the same experts (one in each ep group), over which the
        experts' gradients are summed: dp x cp / ep."""
        return self.dp_cp // self.ep

    def expert_position(self, dp_cp_rank: int) -> tuple[int, int]:
        """(ep_rank, edp_rank) of the rank at `dp_cp_rank` (dp_rank x cp + cp_rank) in dp x cp: ep groups are
        consecutive, so that with cp > 1 the ranks of a sample's cp ring exchange tokens first."""
        return dp_cp_rank % self.ep, dp_cp_rank // self.ep

    # -- hybrid sharding (parallelism.dp_shard; docs/zero.md#hybrid-sharding) ------------------------
    @property
    def replicas(self) -> int:
        """Copies of ZeRO's shards: dp / dp_shard (1 without dp_shard: one shard group over all of dp x cp)."""
        return max(1, self.dp // (self.dp_shard or self.dp))   # max: a dp_shard over dp, refused by validation

    @property
    def shard_size(self) -> int:
        """Ranks of a ZeRO shard group: dp_shard x cp, the dp ranks in consecutive blocks of dp_shard, each with
        its cp ranks; dp x cp without dp_shard."""
        return self.dp_cp // self.replicas

    def shard_position(self, dp_cp_rank: int) -> tuple[int, int]:
        """(replica, shard rank) of the rank at `dp_cp_rank` in dp x cp: which shard group it is in, and its place
        there. The replica group is the ranks with the same shard rank, one in each shard group."""
        return divmod(dp_cp_rank, self.shard_size)

    def shard_blocks(self) -> list[range]:
        """The global ranks of each (pp stage, replica): dp_shard·cp·tp consecutive ranks, holding one shard group
        per tp rank (tp is innermost in the grid, then cp, then dp)."""
        span = self.shard_size * self.tp
        return [range(start, start + span) for start in range(0, self.world_size, span)]

    def shard_groups_cross_nodes(self, ranks_per_node: int) -> bool:
        """Whether some shard group spans two nodes of `ranks_per_node` consecutive ranks: a block of
        shard_size·tp ranks stays inside one node when it divides the ranks per node."""
        return ranks_per_node % (self.shard_size * self.tp) != 0

    # -- the rank grid: (pp, dp, cp, tp), tp innermost (context.py says why) -------------------
    def rank_at(self, pp_rank: int, dp_rank: int, cp_rank: int, tp_rank: int) -> int:
        """The global rank at this grid position."""
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def position(self, rank: int) -> tuple[int, int, int, int]:
        """(pp_rank, dp_rank, cp_rank, tp_rank) of a global rank: the inverse of rank_at."""
        pp_rank, rest = divmod(rank, self.dp * self.cp * self.tp)
        dp_rank, rest = divmod(rest, self.cp * self.tp)
        return (pp_rank, dp_rank, *divmod(rest, self.tp))

    def dims_crossing_nodes(self, ranks_per_node: int) -> list[str]:
        """"tp" and/or "cp" when their groups span nodes of `ranks_per_node` consecutive ranks. A tp group is tp
        consecutive ranks and a cp group lies within tp·cp consecutive ones: each stays inside a node when that
        many divide the ranks per node. (dp and pp groups may cross: they talk once a step, or only to neighbours.)"""
        spans = {"tp": self.tp, "cp": self.tp * self.cp}
        return [dim for dim, span in spans.items() if getattr(self, dim) > 1 and ranks_per_node % span]

    @property
    def name(self) -> str:
        """dp2tp2pp2; cp and ep are named only when used (dp1cp2tp2pp2, dp2ep2tp1pp1), so 3D names never change."""
        return (f"dp{self.dp}" + (f"cp{self.cp}" if self.cp > 1 else "") + (f"ep{self.ep}" if self.ep > 1 else "")
                + f"tp{self.tp}pp{self.pp}")

    # -- pipeline stages ---------------------------------------------------------------------
    @property
    def stages(self) -> StageMap:
        """Which pp rank runs which virtual stage (the schedule's placement: V or a loop)."""
        placement = SCHEDULES[self.schedule].placement if self.schedule in SCHEDULES else "loop"
        return StageMap(self.pp, self.virtual_stages, placement)

    @property
    def head_rank(self) -> int:
        """The pp rank holding the last virtual stage: the final norm, the LM head, the loss (the last rank; rank 0
        under V placement)."""
        return self.stages.head_rank

    def stage_layers(self, num_layers: int, pp_rank: int) -> list[range]:
        """The global layer indices of each chunk pp rank `pp_rank` holds (one chunk without virtual stages):
        the layers are cut into pp·v contiguous, balanced virtual stages, the earlier ones one layer longer
        when the split is uneven (the last stage also carries the final norm and the LM head), and chunk c of
        pp rank r is the virtual stage `stages` places there. ValueError when a virtual stage would have no layer."""
        stages = split_layers(num_layers, self.pp * self.virtual_stages)
        return [stages[self.stages.stage(c, pp_rank)] for c in range(self.virtual_stages)]

    # -- activations -------------------------------------------------------------------------
    def local_tokens(self, sequence_length: int) -> int:
        """Tokens of each sample a rank holds: s / cp."""
        return sequence_length // self.cp

    def activation_shape(self, micro_batch_size: int, sequence_length: int, hidden_size: int) -> tuple:
        """What one pipeline stage passes to the next: [b, s/cp, h], and [b, s/cp/tp, h] under sequence
        parallelism."""
        tokens = self.local_tokens(sequence_length) // (self.tp if self.sequence_parallel else 1)
        return micro_batch_size, tokens, hidden_size

    # -- tied embeddings ---------------------------------------------------------------------
    def lm_head_weight(self, pp_rank: int, tied: bool) -> str | None:
        """What the LM head's weight is on pp rank `pp_rank`, `tied` saying whether the model ties it to the
        embedding: None (no head there), "own" (untied), "embedding" (tied on one stage: the embedding tensor
        itself) or "copy" (tied across stages: the head's rank holds a copy of the embedding's values; the two
        gradients are summed over `tied_stages`, so the copies never drift, and the copy is neither stored
        nor counted). The embedding is on rank 0, the head on `head_rank`: one rank when pp = 1 or under V
        placement."""
        if pp_rank != self.head_rank:
            return None
        if not tied:
            return "own"
        return "embedding" if self.head_rank == 0 else "copy"

    def embedding_has_copy(self, pp_rank: int, tied: bool) -> bool:
        """Whether pp rank `pp_rank`'s embedding has a copy on another rank (rank 0, tied, the head elsewhere)."""
        return tied and self.head_rank != 0 and pp_rank == 0

    @property
    def tied_stages(self) -> tuple[int, ...]:
        """The pp ranks whose embedding copies' gradients are summed: the embedding's and the head's."""
        return tuple(sorted({0, self.head_rank}))


@functools.lru_cache(maxsize=1024)   # the planner and the memory estimate ask for the same splits very often
def split_layers(num_layers: int, stages: int) -> list[range]:
    """`stages` contiguous, balanced ranges covering range(num_layers), the earlier ones one longer when the
    split is uneven. ValueError if stages < 1 or stages > num_layers (a stage without layers). The list is
    shared between callers: read it, do not change it."""
    if stages < 1 or stages > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} pipeline stages "
                         f"(every stage needs at least one layer)")
    base, extra = divmod(num_layers, stages)
    ranges, start = [], 0
    for stage in range(stages):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges
