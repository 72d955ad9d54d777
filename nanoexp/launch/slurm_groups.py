"""Replica groups as SLURM jobs: `python train.py -m hydra/launcher=slurm fault_tolerance=torchft ...` with
fault_tolerance.group null. The sweep's job of such a run is one SLURM task (hydra_plugins/nanoexp_launchers.py):
it starts the lighthouse on its node (launch_replica_groups), then submits the R groups as one submitit job array
with the launcher's resources (hydra.launcher: partition, nodes, gpus, time limit, setup, ...), each group a job of
dp*cp*tp*pp tasks, one rank each, which trains with fault_tolerance.group=g and this node's lighthouse. It watches
them through sacct and submits a group whose job ended without completing again, by the local rule
(GroupProcesses.watch); when it ends, also by a stop signal or scancel, it cancels the group jobs still queued or
running. submitit's files for the groups go beside the sweep's, in <sweep>/.submitit/groups_<job>/, never into
a run folder.
"""
from __future__ import annotations

import logging
import os

from nanoexp.launch.replica_groups import GroupProcesses, group_config, group_folder
from nanoexp.launch.sweep import slurm_tasks_per_node
from nanoexp.launch.sweep_report import SLURM_DONE
from nanoexp.parallel.layout import Layout

log = logging.getLogger("nanoexp")
# hydra.launcher keys that are not sbatch options, and those submitit takes without its "slurm_" prefix
NOT_OPTIONS = ("_target_", "submitit_folder", "max_num_timeout")
UNPREFIXED = ("timeout_min", "nodes", "tasks_per_node", "gpus_per_node", "cpus_per_task", "mem_gb", "name",
              "stderr_to_stdout")


def group_executor(launcher: dict, world: int, folder: str):
    """A submitit executor that submits jobs as hydra.launcher=slurm (`launcher`, resolved) would, with the
    tasks a group of `world` ranks needs over the launcher's nodes."""
    import submitit

    executor = submitit.AutoExecutor(folder=folder, cluster="slurm",
                                     slurm_max_num_timeout=launcher.get("max_num_timeout", 3))
    options = {key: value for key, value in launcher.items() if key not in NOT_OPTIONS}
    options["tasks_per_node"] = slurm_tasks_per_node([world], launcher["nodes"], launcher.get("tasks_per_node"))
    executor.update_parameters(**{key if key in UNPREFIXED else f"slurm_{key}": value
                                  for key, value in options.items()})
    return executor


def groups_folder(launcher: dict, run_dir: str, sweep_dir: str) -> str:
    """<sweep>/.submitit/groups_<the run's folder in the sweep>/%j: beside the sweep's own submitit folders, and
    out of their pattern (<sweep>/.submitit/<job id>/), which the sweep's report reads."""
    job = os.path.relpath(os.path.abspath(run_dir), os.path.abspath(sweep_dir)).replace(os.sep, "_")
    root = os.path.dirname(launcher["submitit_folder"].rstrip(os.sep)) if "%j" in launcher["submitit_folder"] \
        else launcher["submitit_folder"]
    return os.path.join(root, f"groups_{job}", "%j")


class SlurmGroups(GroupProcesses):
    """The R groups of a run as SLURM jobs (see the module docstring); construct with `SlurmGroups.on(...)`."""
    poll_s = 2.0   # one sacct call per look
    launcher: dict = {}
    folder = ""

    @classmethod
    def on(cls, launcher: dict, run_dir: str, sweep_dir: str) -> type:
        """This class bound to the launcher's settings (for launch_replica_groups, which constructs it)."""
        return type(cls.__name__, (cls,), {"launcher": launcher, "folder": groups_folder(launcher, run_dir,
                                                                                         sweep_dir)})

    def start_all(self, groups: list[int]) -> list:
        self.executor = group_executor(self.launcher, Layout.from_config(self.cfg).world_size, self.folder)
        jobs = self.executor.map_array(self.train_group, [self.config(g) for g in groups],
                                       [group_folder(self.run_dir, g) for g in groups])
        log.info("replica groups submitted as SLURM jobs %s", ", ".join(job.job_id for job in jobs))
        return jobs

    def start(self, group: int):
        job = self.executor.submit(self.train_group, self.config(group), group_folder(self.run_dir, group))
        log.info("replica group %d submitted again as SLURM job %s", group, job.job_id)
        return job

    def config(self, group: int):
        return group_config(self.cfg, self.run_dir, group, self.lighthouse)

    def look(self) -> None:
        next(iter(self.running.values())).watcher.update()   # one sacct call for every job of the run

    def exit_code(self, job) -> int | None:
        """None while the job is queued or runs (sacct, as submitit's watcher read it in look()); 0 when it
        completed, 1 when it ended otherwise (failed, cancelled, timed out, node failure)."""
        state = job.watcher.get_state(job.job_id, mode="cache")
        if not state.startswith(SLURM_DONE):
            return None
        if state != "COMPLETED":
            log.warning("replica group job %s ended %s", job.job_id, state)
        return 0 if state == "COMPLETED" else 1

    def stop(self) -> None:
        """Cancel the group jobs still queued or running (nothing of the run is left behind)."""
        for job in self.running.values():
            job.cancel(check=False)
