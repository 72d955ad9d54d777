"""Goodput: the share of a job's time that trains steps it keeps, when its GPUs fail.

Failures come at the rate the Llama 3 405B run saw: 419 unexpected interruptions in 54 days on 16,384 H100s
(Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4), one per 54 x 24 x 16,384 / 419 = 50,700
GPU-hours, so a job of n GPUs fails every 50,700 / n hours on average (a failure anywhere stops it).

Restart from a checkpoint (every failure stops every rank): each save stalls training `save_s`, each failure costs
the restart (`restart_s`: new processes, process groups, reading the checkpoint) and on average half an interval of
steps trained again. The interval that loses least is Young's (1974) sqrt(2 x save_s x MTBF), with Daly's (2006)
first correction, - save_s; goodput = 1 - save_s / interval - (interval / 2 + restart_s) / MTBF.

Replica groups (fault_tolerance=torchft): a failure stops every group only while the lighthouse notices it and the
step in flight is trained again (`stall_s`); the failed group (1/R of the throughput) is out until it has restarted
and copied a live peer's state (`rejoin_s`). goodput = 1 - (stall_s + rejoin_s / R) / MTBF (checkpoints, for a
failure of every group at once, are rare enough to be written seldom: their stall is left out).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

LLAMA3_GPU_HOURS_PER_FAILURE = 54 * 24 * 16_384 / 419   # 50,678: Llama 3's 405B pre-training, section 3.3.4


@dataclass(frozen=True)
class Goodput:
    failures_per_day: float
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
    """Useful share of time with `groups` replica groups: every failure stalls all `stall_s` and the failed
    group's share for `rejoin_s`."""
    return max(0.0, 1.0 - (stall_s + rejoin_s / groups) / mtbf_s)


def goodput(gpus: int, save_s: float, restart_s: float, stall_s: float, rejoin_s: float, groups: int,
            gpu_hours_per_failure: float = LLAMA3_GPU_HOURS_PER_FAILURE) -> Goodput:
    mtbf = job_mtbf_s(gpus, gpu_hours_per_failure)
    return Goodput(86_400 / mtbf, young_daly_interval_s(save_s, mtbf), restart_goodput(save_s, restart_s, mtbf),
                   replica_goodput(stall_s, rejoin_s, groups, mtbf))
