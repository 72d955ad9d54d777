"""nanoexp's Hydra launchers: `hydra/launcher=slurm` and `hydra/launcher=local` (conf/hydra/launcher/).

Hydra only loads launchers from the `hydra_plugins` namespace, hence this file (no __init__.py here:
the folder must merge with the installed hydra_plugins). They are hydra-submitit-launcher's launchers
plus, before submission:
- both: this checkout goes first on PYTHONPATH (jobs inherit the environment), so the jobs import the
  same nanoexp and these launchers whatever folder the sweep was started from;
- SLURM: every job of the sweep is composed and `tasks_per_node` set (or checked) so that
  tasks_per_node x nodes == dp*cp*tp*pp (see nanoexp/launch/sweep.py). A sweep of replica-group runs
  (fault_tolerance=torchft, fault_tolerance.group null) is submitted as jobs of one task without GPUs: each starts
  the lighthouse and submits its groups as jobs of that shape (nanoexp/launch/slurm_groups.py).
"""
from __future__ import annotations

import os
from typing import Sequence

from hydra.core.utils import JobReturn
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher

from nanoexp.config import ConfigError
from nanoexp.parallel.layout import Layout
from nanoexp.launch.sweep import slurm_tasks_per_node


def use_this_checkout() -> None:
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (checkout, os.environ.get("PYTHONPATH")) if p)


class NanoexpSlurmLauncher(SlurmLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        loader = self.hydra_context.config_loader
        configs = [loader.load_sweep_config(self.config, list(overrides)) for overrides in job_overrides]
        self.params["tasks_per_node"] = slurm_tasks_per_node(
            [Layout.from_config(cfg).world_size for cfg in configs], self.params["nodes"],
            self.params.get("tasks_per_node"), first_job=initial_job_idx)
        if groups_jobs(configs, initial_job_idx):
            self.params.update(nodes=1, tasks_per_node=1, gpus_per_node=None)
        use_this_checkout()
        return super().launch(job_overrides, initial_job_idx)


def groups_jobs(configs, first_job: int) -> bool:
    """Whether the sweep's jobs are replica-group runs whose groups are SLURM jobs of their own (all or none)."""
    groups = [i for i, cfg in enumerate(configs, first_job)
              if cfg.fault_tolerance.method != "none" and cfg.fault_tolerance.group is None]
    if groups and len(groups) != len(configs):
        raise ConfigError(f"fault_tolerance: a SLURM sweep is one job array with one task count, but jobs {groups} "
                          "are replica-group runs (one task each, their groups submitted as jobs) and the others "
                          "are not: run one sweep of each")
    return bool(groups)


class NanoexpLocalLauncher(LocalLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        use_this_checkout()
        return super().launch(job_overrides, initial_job_idx)
