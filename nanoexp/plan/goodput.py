"""Goodput: the share of a job's time that trains steps it keeps, when its GPUs fail.

Failures come at the rate the Llama 3 405B run saw: 419 unexpected interruptions in 54 days on 16,384 H100s
(Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4), one per 54 x 24 x 16,384 / 419 = 50,677
GPU-hours, so a job of n GPUs fails every 50,677 / n hours on average (a failure anywhere stops it).
Restart from a checkpoint (every failure stops every rank): each save stalls training `save_s`, each failure costs
the restart (`restart_s`: new processes, process groups, reading the checkpoint) and on average half an interval of
steps trained again. The interval that loses least is Young's (1974) sqrt(2 x save_s x MTBF), with Daly's (2006)
first correction, - save_s; goodput = 1 - save_s / interval - (interval / 2 + restart_s) / MTBF.
Replica groups (fault_tolerance=torchft): a failure stops every group only while the lighthouse notices it and the
step in flight is trained again (`stall_s`); the failed group (1/R of the throughput) is out until it has restarted
and copied a live peer's state (`rejoin_s`). goodput = 1 - (stall_s + rejoin_s / R) / MTBF (checkpoints, for a
failure of every group at once, are rare enough to be written seldom: their stall is left out). A layout with one
group (ZeRO over all of its data parallelism) has no live peer to copy from: its goodput is the restart's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

LLAMA3_GPU_HOURS_PER_FAILURE = 54 * 24 * 16_384 / 419   # 50,677: Llama 3's 405B pre-training, section 3.3.4
# Assumptions, stated here and in docs/fault-tolerance.md:
RESTART_S = 600.0             # a restart after a failure: rescheduling, process start, communicators (10 minutes)
HOST_COPY_BYTES_PER_S = 25e9  # an asynchronous save's stall: its copy to the host (PCIe Gen5 x16, ~40 % of 64 GB/s)
READ_BYTES_PER_S = 2e9        # reading a checkpoint shard back, per GPU (a parallel file system's share)
HEARTBEAT_S = 2.0             # the lighthouse notices a dead group (nanoexp's lighthouse: 2 s)


@dataclass(frozen=True)
class Goodput:
    failures_per_day: float
    save_stall_s: float
    checkpoint_interval_s: float   # Young-Daly
    restart: float                 # goodput restarting from checkpoints every checkpoint_interval_s
    replica_groups: float          # goodput with replica groups


def job_mtbf_s(gpus: int, gpu_hours_per_failure: float = LLAMA3_GPU_HOURS_PER_FAILURE) -> float:
    """Mean time between failures of a job on `gpus` GPUs, in seconds."""
    return gpu_hours_per_failure * 3600 / gpus


def young_daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """The checkpoint interval that loses least time: sqrt(2 save_s MTBF) - save_s (at least one save's time)."""
    return max(math.sqrt(2 * save_s * mtbf_s) - save_s, save_s) if save_s > 0 else 0.0


def restart_goodput(save_s: float, restart_s: float, mtbf_s: float, interval_s: float | None = None) -> float:
    """Useful share of time restarting from checkpoints saved every `interval_s` (default: Young-Daly's)."""
    interval = young_daly_interval_s(save_s, mtbf_s) if interval_s is None else interval_s
    lost = (save_s / interval if interval else 0.0) + (interval / 2 + restart_s) / mtbf_s
    return max(0.0, 1.0 - lost)


def replica_goodput(stall_s: float, rejoin_s: float, groups: int, mtbf_s: float) -> float:
    """Useful share of time with `groups` replica groups (at least 2: one group has no live peer to copy from, and
    restarts from its checkpoint): every failure stalls all `stall_s` and the failed group's share for `rejoin_s`."""
    return max(0.0, 1.0 - (stall_s + rejoin_s / groups) / mtbf_s)


def goodput(gpus: int, save_s: float, restart_s: float, stall_s: float, rejoin_s: float, groups: int,
            gpu_hours_per_failure: float = LLAMA3_GPU_HOURS_PER_FAILURE) -> Goodput:
    mtbf = job_mtbf_s(gpus, gpu_hours_per_failure)
    restart = restart_goodput(save_s, restart_s, mtbf)
    replicas = replica_goodput(stall_s, rejoin_s, groups, mtbf) if groups > 1 else restart
    return Goodput(86_400 / mtbf, save_s, young_daly_interval_s(save_s, mtbf), restart, replicas)


def checkpoint_shard_bytes(parameters: int, p) -> float:
    """The busiest writer's share of a checkpoint of a layout `p` (cost.Prediction): float32 weights and AdamW's two
    moments (12 bytes a parameter) of its tp x pp slice, the moments (ZeRO-1/2) or all (ZeRO-3) split over the ZeRO
    group (dp, or dp_shard under hybrid sharding)."""
    piece, zero_group = parameters / (p.tp * p.pp), p.dp_shard or p.dp
    if p.zero_stage == 0:
        return 12 * piece
    return (4 * piece if p.zero_stage < 3 else 4 * piece / zero_group) + 8 * piece / zero_group


def replica_groups(p) -> int:
    """Groups a layout splits into under fault_tolerance: each data-parallel replica (hybrid sharding's replicas;
    with ZeRO over all of dp, one group)."""
    if p.dp_shard is not None:
        return p.dp // p.dp_shard
    return p.dp if p.zero_stage == 0 else 1


def layout_goodput(p, parameters: int, gpus: int, hw, gpu_hours_per_failure: float = LLAMA3_GPU_HOURS_PER_FAILURE,
                   restart_s: float = RESTART_S) -> Goodput:
    """Goodput of layout `p` on `gpus` GPUs of `hw` (hardware.Hardware): the save stall its shard's copy to the host
    predicts, the restart plus reading the shard back, and with replica groups a failure's stall (the heartbeat and
    the step trained again) and a group's rejoin (a restart and the copy of a live group's state over the network)."""
    shard = checkpoint_shard_bytes(parameters, p)
    save_s, read_s = shard / HOST_COPY_BYTES_PER_S, shard / READ_BYTES_PER_S
    copy_s = 12 * parameters / (p.tp * p.pp) / (hw.inter_gbps * 1e9)   # a rank's whole state from its live peer
    return goodput(gpus, save_s, restart_s + read_s, HEARTBEAT_S + p.step_time_s, restart_s + copy_s,
                   replica_groups(p), gpu_hours_per_failure)
