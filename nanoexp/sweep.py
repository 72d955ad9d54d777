"""Sweep jobs: the SLURM task count of a sweep, and the state a job leaves for sweep reports.

hydra-submitit-launcher submits a sweep as one SLURM job array, and a job array has one shape
(nodes x tasks per node) for all its jobs. A nanoexp job needs exactly dp*tp*pp tasks (each SLURM task
is one rank), so before anything is submitted every job's config is composed and its world size read:
`slurm_tasks_per_node` then derives the task count (when `hydra.launcher.tasks_per_node` is null) or
checks it, and refuses a sweep that mixes world sizes, naming the jobs of each size.

A job that failed or was stopped by a signal must not look finished: `record_failure` writes the reason
into summary.json, `stopped_by_signal` tells nanoexp.run to exit without a result.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from nanoexp.config import ConfigError
from nanoexp.launch import launcher_env


def world_size(cfg) -> int:
    """Processes one run of this config needs: dp * cp * tp * pp."""
    p = cfg.parallelism
    return int(p.dp) * int(p.get("cp", 1)) * int(p.tp) * int(p.pp)


def slurm_tasks_per_node(world_sizes: Sequence[int], nodes: int, tasks_per_node: Optional[int],
                         first_job: int = 0) -> int:
    """The tasks per node for a job array whose jobs need `world_sizes` processes (job k is sweep job
    first_job + k). Raises ConfigError naming hydra.launcher.tasks_per_node / nodes when no single
    value gives every job tasks_per_node * nodes == dp*tp*pp."""
    sizes = sorted(set(world_sizes))
    if len(sizes) > 1:
        groups = "; ".join(f"world size {size}: jobs {[first_job + i for i, s in enumerate(world_sizes) if s == size]}"
                           for size in sizes)
        raise ConfigError(
            "a SLURM sweep is one job array with one task count, but this sweep mixes world sizes "
            f"(dp*tp*pp) ({groups}): sweep layouts of one world size, or run one sweep per world size")
    world = sizes[0]
    if nodes < 1:
        raise ConfigError(f"hydra.launcher.nodes={nodes}: must be a positive integer")
    if tasks_per_node is None:
        if world % nodes:
            raise ConfigError(f"hydra.launcher.nodes={nodes} does not divide the world size dp*tp*pp={world}: "
                              "every node runs the same number of ranks")
        return world // nodes
    if tasks_per_node * nodes != world:
        raise ConfigError(
            f"hydra.launcher.tasks_per_node={tasks_per_node} x hydra.launcher.nodes={nodes} = "
            f"{tasks_per_node * nodes} tasks, but dp*tp*pp = {world}: each SLURM task is one rank, so set "
            f"hydra.launcher.tasks_per_node={world // nodes if world % nodes == 0 else '<dp*tp*pp/nodes>'} "
            "(or null to derive it)")
    return tasks_per_node


def record_failure(run_dir: str, error: BaseException) -> None:
    """Make the run folder's summary.json say `failed` and why, whatever raised (a bad config before
    training, a failed local rank, the trainer itself), keeping the metrics a trainer may have written.
    Only global rank 0 writes it, as for every shared file of a run."""
    env = launcher_env()
    if env is not None and env["rank"] != 0:
        return
    path = os.path.join(run_dir, "summary.json")
    summary = {}
    if os.path.exists(path):
        with open(path) as f:
            summary = json.load(f)
        if summary.get("status") == "failed" and summary.get("error"):
            return   # the trainer recorded the first error; this one only repeats it
    summary.update(status="failed", error=f"{type(error).__name__}: {error}")
    os.makedirs(run_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)


def stopped_by_signal(run_dir: str) -> bool:
    """Whether global rank 0's trainer left this run `stopped` (SIGTERM/SIGUSR2: checkpointed before the
    end). Other ranks answer False: they cannot know when rank 0's summary.json is written."""
    env = launcher_env()
    path = os.path.join(run_dir, "summary.json")
    if (env is not None and env["rank"] != 0) or not os.path.exists(path):
        return False
    with open(path) as f:
        return json.load(f).get("status") == "stopped"
