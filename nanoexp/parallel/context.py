"""ParallelContext: the one object that owns the rank grid and every process group.

Ranks are laid out on a (pp, dp, tp) grid with tp innermost, so that the ranks of one
tensor-parallel group are neighbours (on GPUs: the same node, the fastest links):

    global_rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

Everything else asks this object for its group, rank or neighbour; nothing else creates
process groups. With one process no group is created and every collective is skipped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class ParallelContext:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    collective_timeout_s: float = 600.0   # groups made here do not inherit the world's timeout

    def __post_init__(self):
        self.world_size = self.dp * self.tp * self.pp
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        actual = dist.get_world_size() if dist.is_initialized() else 1
        if actual != self.world_size:
            raise ValueError(
                f"world size {actual} != dp*tp*pp = {self.dp}*{self.tp}*{self.pp}")
        self.backend = dist.get_backend() if dist.is_initialized() else None
        self.pp_rank, rest = divmod(self.rank, self.dp * self.tp)
        self.dp_rank, self.tp_rank = divmod(rest, self.tp)
        self.dp_group = self.tp_group = self.pp_group = None
        self.model_parallel_group = self.embedding_group = None
        if self.world_size > 1:
            self._build_groups()

    # -- grid helpers ------------------------------------------------------------------
    def global_rank(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.dp * self.tp + dp_rank * self.tp + tp_rank

    def _build_groups(self):
        # Every rank must call new_group for every group, in the same order.
        grid = [[[self.global_rank(p, d, t) for t in range(self.tp)]
                 for d in range(self.dp)] for p in range(self.pp)]
        for p in range(self.pp):
            for d in range(self.dp):
                self._maybe_keep("tp_group", grid[p][d])
        for p in range(self.pp):
            for t in range(self.tp):
                self._maybe_keep("dp_group", [grid[p][d][t] for d in range(self.dp)])
        for d in range(self.dp):
            for t in range(self.tp):
                self._maybe_keep("pp_group", [grid[p][d][t] for p in range(self.pp)])
        # Model-parallel group (tp x pp of one replica): where a gradient norm or a loss is
        # summed, since every parameter lives exactly once in it.
        for d in range(self.dp):
            self._maybe_keep("model_parallel_group",
                             [grid[p][d][t] for p in range(self.pp) for t in range(self.tp)])
        # Tied embeddings live on the first and the last stage: their gradients meet here.
        for d in range(self.dp):
            for t in range(self.tp):
                ends = sorted({grid[0][d][t], grid[-1][d][t]})
                self._maybe_keep("embedding_group", ends)

    def _maybe_keep(self, name: str, ranks: list[int]):
        group = dist.new_group(ranks, timeout=timedelta(seconds=self.collective_timeout_s))
        if self.rank in ranks:
            setattr(self, name, group)
            setattr(self, name + "_ranks", ranks)

    # -- pipeline neighbours -------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (None on the first stage)."""
        return None if self.is_first_stage else self.global_rank(self.pp_rank - 1, self.dp_rank, self.tp_rank)

    @property
    def next_rank(self) -> int | None:
        """Global rank of the next pipeline stage (None on the last stage)."""
        return None if self.is_last_stage else self.global_rank(self.pp_rank + 1, self.dp_rank, self.tp_rank)

    @property
    def layout(self) -> str:
        return f"dp{self.dp}tp{self.tp}pp{self.pp}"
