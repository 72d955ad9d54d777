"""ParallelContext: the one object that owns the rank grid and every process group. Ranks sit on a (pp, dp, cp, tp)
grid with tp innermost (`Layout.rank_at`), so a tensor-parallel group is neighbours (on GPUs, one node) with the
context-parallel ring next to them. Gradients are averaged, and ZeRO shards, over dp x cp (`dp_cp_group`); expert
parallelism cuts each dp x cp group into ep groups of consecutive ranks (`ep_group`), and the ranks at the same
place in every ep group hold the same experts (`edp_group`). With hybrid sharding (`Layout.dp_shard`) ZeRO shards
over `shard_group` (dp_shard x cp ranks) and all-reduces each shard over `replica_group` (the ranks at the same
place in every shard group); the experts shard over `expert_shard_group` (the edp ranks inside one shard group)
and share the replica group (`zero_axes`). A parallel layer holds only its dimension's `Axis`;
nothing else creates groups, and with one process none is created. Under fault_tolerance=torchft this world is one
of several replica groups: `join_replica_groups` makes torchft's Manager and its cross-group process group
(`replica_groups`, nanoexp/parallel/replicas.py)."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from itertools import product
from typing import Any

import os
import socket

import torch
import torch.distributed as dist

from nanoexp.parallel.layout import Layout
from nanoexp.model.placement import placement


def launcher_env() -> dict | None:
    """Rank, world size and local rank given by torchrun or SLURM, or None when run directly."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return {"rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"]),
                "local_rank": int(env.get("LOCAL_RANK", 0))}
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return {"rank": int(env["SLURM_PROCID"]), "world_size": int(env["SLURM_NTASKS"]),
                "local_rank": int(env.get("SLURM_LOCALID", 0))}
    return None


@dataclass(frozen=True)
class Axis:
    """One dimension of the rank grid as this rank sees it: its process group (None with one rank), its size and
    this rank's place in it. What a parallel layer holds instead of the whole context."""
    group: Any = None
    size: int = 1
    rank: int = 0


class ParallelContext:
    """This rank's place in `layout` and the process groups it belongs to, on `device`."""

    def __init__(self, layout: Layout = Layout(), device: torch.device | None = None,
                 collective_timeout_s: float = 600.0):
        self.layout = layout
        self.device = device or torch.device("cpu")
        self.collective_timeout_s = collective_timeout_s   # groups made here do not inherit the world's timeout
        self.dp, self.cp, self.tp, self.pp = layout.dp, layout.cp, layout.tp, layout.pp
        self.world_size, self.dp_cp = layout.world_size, layout.dp_cp
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        actual = dist.get_world_size() if dist.is_initialized() else 1
        if actual != self.world_size:
            raise ValueError(f"world size {actual} != dp*cp*tp*pp = {self.dp}*{self.cp}*{self.tp}*{self.pp}")
        self.backend = dist.get_backend() if dist.is_initialized() else None
        self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank = layout.position(self.rank)
        self.dp_cp_rank = self.dp_rank * self.cp + self.cp_rank   # rank order within dp_cp_group
        self.ep, self.edp = layout.ep, layout.edp
        self.ep_rank, self.edp_rank = layout.expert_position(self.dp_cp_rank)
        self.replicas, self.shard_size = layout.replicas, layout.shard_size
        self.replica_index, self.shard_rank = layout.shard_position(self.dp_cp_rank)
        self.expert_shard_size, self.expert_shard_rank = self.shard_size // self.ep, self.shard_rank // self.ep
        self.dp_group = self.tp_group = self.pp_group = self.cp_group = self.dp_cp_group = None
        self.shard_group = self.replica_group = self.expert_shard_group = None   # hybrid sharding only
        self.ep_group = self.edp_group = None   # None also when of one rank
        self.model_parallel_group = self.embedding_group = None
        # Every group this rank belongs to, by torch's group name: (its description, its global ranks). The flight
        # recorder's dumps carry the names; the stall diagnosis reads the rest here.
        self.group_table: dict[str, tuple[str, list[int]]] = {"0": ("world", list(range(self.world_size)))}
        self.replica_groups = None   # fault_tolerance=torchft: a ReplicaGroups once joined
        if self.world_size > 1:
            self._build_groups()

    def axis(self, name: str) -> Axis:
        """The group, size and rank of dimension `name`: "tp", "cp", "ep", "dp", "pp"."""
        return Axis(getattr(self, f"{name}_group"), getattr(self, name), getattr(self, f"{name}_rank"))

    def _build_groups(self):
        # Every rank must call new_group for every group, in the same order; the cp and ep groups exist
        # only when cp > 1 and ep > 1.
        P, D, C, T = range(self.pp), range(self.dp), range(self.cp), range(self.tp)
        rank, keep = self.layout.rank_at, self._maybe_keep
        for p, d, c in product(P, D, C):
            keep("tp_group", [rank(p, d, c, t) for t in T])
        for p, c, t in product(P, C, T):
            keep("dp_group", [rank(p, d, c, t) for d in D])
        for d, c, t in product(D, C, T):
            keep("pp_group", [rank(p, d, c, t) for p in P])
        # Model-parallel group (tp x pp of one replica and cp rank): where a gradient norm or a
        # loss is summed, since every parameter lives exactly once in it.
        for d, c in product(D, C):
            keep("model_parallel_group", [rank(p, d, c, t) for p in P for t in T])
        # Tied embeddings: the copies' gradients meet here (Layout.tied_stages).
        for d, c, t in product(D, C, T):
            keep("embedding_group", [rank(p, d, c, t) for p in self.layout.tied_stages])
        if self.cp == 1:
            self.dp_cp_group = self.dp_group
        else:
            for p, d, t in product(P, D, T):
                keep("cp_group", [rank(p, d, c, t) for c in C])
            for p, t in product(P, T):
                keep("dp_cp_group", [rank(p, d, c, t) for d in D for c in C])
        for p, t in product(P, T):
            dp_cp = [rank(p, d, c, t) for d in D for c in C]   # in dp_cp_rank order
            for start in range(0, self.dp_cp, self.ep) if self.ep > 1 else ():
                keep("ep_group", dp_cp[start:start + self.ep])
            for ep_rank in range(self.ep) if self.ep > 1 and self.edp > 1 else ():
                keep("edp_group", dp_cp[ep_rank::self.ep])
            if self.replicas > 1:
                self._build_hybrid_groups(dp_cp)

    def _build_hybrid_groups(self, dp_cp: list[int]):
        """Of one pp stage and tp rank (`dp_cp`: its ranks in dp_cp_rank order): the shard groups (blocks of
        shard_size consecutive ones), the replica groups (the same place in every block), and the experts' shard
        groups (one ep rank's ranks inside a block: validation makes ep divide the block, so an ep group never
        leaves it and the experts' replicas are the replica group)."""
        size, keep = self.shard_size, self._maybe_keep
        for start in range(0, self.dp_cp, size) if size > 1 else ():
            keep("shard_group", dp_cp[start:start + size])
            for ep_rank in range(self.ep) if self.ep > 1 and self.expert_shard_size > 1 else ():
                keep("expert_shard_group", dp_cp[start + ep_rank:start + size:self.ep])
        for shard_rank in range(size):
            keep("replica_group", dp_cp[shard_rank::size])

    def _maybe_keep(self, name: str, ranks: list[int]):
        description = self.describe_group(name, ranks)
        group = dist.new_group(ranks, timeout=timedelta(seconds=self.collective_timeout_s), group_desc=description)
        if self.rank in ranks:
            setattr(self, name, group)
            self.group_table[group.group_name] = (description, ranks)

    def join_replica_groups(self, ft, step: int) -> None:
        """Become a rank of replica group `ft.group` (fault_tolerance): a TCP store of this group (on its rank 0,
        reachable from the other groups), torchft's cross-group process group and its Manager at committed step
        `step`. Called once the model is built, so that a restarted group is in no quorum before it can train."""
        from nanoexp.parallel.replicas import ReplicaGroups, StateTransport, import_torchft
        torchft = import_torchft()
        store = dist.TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False) if self.rank == 0 else None
        address = [socket.gethostname(), store.port if store else 0]
        if self.world_size > 1:
            dist.broadcast_object_list(address, src=0)
        timeout, quorum_timeout = timedelta(seconds=ft.timeout_s), timedelta(seconds=ft.quorum_timeout_s)
        kind = torchft.ProcessGroupNCCL if self.device.type == "cuda" else torchft.ProcessGroupGloo
        group = kind(timeout=timeout)
        manager = torchft.Manager(group, None, None, min_replica_size=ft.min_replicas, use_async_quorum=False,
                          timeout=timeout, quorum_timeout=quorum_timeout, connect_timeout=quorum_timeout,
                          rank=self.rank, world_size=self.world_size, store_addr=address[0], store_port=address[1],
                          lighthouse_addr=ft.lighthouse, replica_id=f"nanoexp_group_{ft.group:04d}",
                          hostname=address[0], init_sync=False, checkpoint_transport=StateTransport(ft.timeout_s))
        manager.load_state_dict({"step": step, "batches_committed": 0})
        self.replica_groups = ReplicaGroups(manager, ft.group, ft.replica_groups, ft.quorum_timeout_s, group)
        self._replica_store = store   # the group's store lives as long as the context

    def describe_group(self, name: str, ranks: list[int]) -> str:
        """A group as the layout names it: "tp group of pp stage 1, dp rank 0" (the coordinates its ranks share)."""
        positions = [self.layout.position(rank) for rank in ranks]
        shared = [f"{label} {positions[0][i]}" for i, (label, size) in enumerate(
            (("pp stage", self.pp), ("dp rank", self.dp), ("cp rank", self.cp), ("tp rank", self.tp)))
            if size > 1 and len({p[i] for p in positions}) == 1]
        kind = name.removesuffix("_group").replace("_", " ").replace("model parallel", "model-parallel")
        return f"{kind} group" + (f" of {', '.join(shared)}" if shared else "")

    def zero_axes(self, expert: bool) -> tuple[Axis, Axis]:
        """(shard, replica): the ranks ZeRO shards a parameter over, and the ranks holding the same shard (an
        Axis of one rank without hybrid sharding). Routed experts (`expert`) shard over edp, or over the edp
        ranks inside one shard group."""
        if self.replicas == 1:
            shard = Axis(self.edp_group, self.edp, self.edp_rank) if expert else Axis(
                self.dp_cp_group, self.dp_cp, self.dp_cp_rank)
            return shard, Axis()
        shard = Axis(self.expert_shard_group, self.expert_shard_size, self.expert_shard_rank) if expert else Axis(
            self.shard_group, self.shard_size, self.shard_rank)
        return shard, Axis(self.replica_group, self.replicas, self.replica_index)

    def replica_rank(self, param) -> int:
        """This rank's place among the ranks that hold `param` whole and identical (0: the one that writes it
        to checkpoints and counts it): an expert's edp group, any other parameter's dp x cp group."""
        return self.edp_rank if placement(param).expert else self.dp_cp_rank

    # -- pipeline position ---------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the last virtual stage (the head and the loss): the last rank, or rank 0 under
        V placement (zbv)."""
        return self.pp_rank == self.layout.head_rank
