"""The SLURM task count of a sweep, and where each job of a sweep keeps its checkpoints.

hydra-submitit-launcher submits a sweep as one SLURM job array, and a job array has one shape
(nodes x tasks per node) for all its jobs. A nanoexp job needs exactly dp*cp*tp*pp tasks (each SLURM task
is one rank), so before anything is submitted every job's config is composed and its world size read
(Layout.world_size): `slurm_tasks_per_node` then derives the task count (when `hydra.launcher.tasks_per_node`
is null) or checks it, and refuses a sweep that mixes world sizes, naming the jobs of each size.

Checkpoints: each job of a sweep has its own folder, so that no job resumes from (or completes with) another's;
see `place_job_checkpoints`.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

from omegaconf import OmegaConf

from nanoexp.config import ConfigError


def slurm_tasks_per_node(world_sizes: Sequence[int], nodes: int, tasks_per_node: Optional[int],
                         first_job: int = 0) -> int:
    """The tasks per node for a job array whose jobs need `world_sizes` processes (job k is sweep job
    first_job + k). Raises ConfigError naming hydra.launcher.tasks_per_node / nodes when no single
    value gives every job tasks_per_node * nodes == dp*cp*tp*pp."""
    sizes = sorted(set(world_sizes))
    if len(sizes) > 1:
        groups = "; ".join(f"world size {size}: jobs {[first_job + i for i, s in enumerate(world_sizes) if s == size]}"
                           for size in sizes)
        raise ConfigError(
            "a SLURM sweep is one job array with one task count, but this sweep mixes world sizes "
            f"(dp*cp*tp*pp) ({groups}): sweep layouts of one world size, or run one sweep per world size")
    world = sizes[0]
    if nodes < 1:
        raise ConfigError(f"hydra.launcher.nodes={nodes}: must be a positive integer")
    if tasks_per_node is None:
        if world % nodes:
            raise ConfigError(f"hydra.launcher.nodes={nodes} does not divide the world size dp*cp*tp*pp={world}: "
                              "every node runs the same number of ranks")
        return world // nodes
    if tasks_per_node * nodes != world:
        raise ConfigError(
            f"hydra.launcher.tasks_per_node={tasks_per_node} x hydra.launcher.nodes={nodes} = "
            f"{tasks_per_node * nodes} tasks, but dp*cp*tp*pp = {world}: each SLURM task is one rank, so set "
            f"hydra.launcher.tasks_per_node={world // nodes if world % nodes == 0 else '<dp*cp*tp*pp/nodes>'} "
            "(or null to derive it)")
    return tasks_per_node


def place_job_checkpoints(cfg, run_dir: str, sweep_dir: str | None) -> None:
    """In a multirun (`sweep_dir` set), a checkpoint.checkpoints_path written as a path is the sweep's: this job
    keeps its checkpoints in its own folder below it, `<path>/<the job's run folder within the sweep folder>`
    (its job number by default), the same folder when the job is requeued or the sweep relaunched. A path that
    interpolates Hydra's job values (`${hydra:job.num}`, `${hydra:job.override_dirname}`) places each job's
    checkpoints itself and is used as written; null is `<run folder>/checkpoints`, the job's own already."""
    written = OmegaConf.to_container(cfg.checkpoint, resolve=False).get("checkpoints_path")
    if sweep_dir is None or written is None or "${hydra:" in str(written).replace(" ", ""):
        return
    job = os.path.relpath(os.path.abspath(run_dir), os.path.abspath(sweep_dir))
    if job.startswith(".."):   # a run folder outside the sweep folder (hydra.sweep.subdir absolute)
        job = os.path.basename(os.path.normpath(run_dir))
    cfg.checkpoint.checkpoints_path = os.path.join(str(cfg.checkpoint.checkpoints_path), job)
