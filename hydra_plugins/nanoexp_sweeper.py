"""nanoexp's Hydra sweeper, `hydra/sweeper=nanoexp` (the default, conf/hydra/sweeper/nanoexp.yaml): Hydra's
basic sweeper, and `+plan=topK` runs the planner's K fastest layouts of this machine, each crossed with the other
sweep axes. The expansion is nanoexp/plan/sweep.py's; this file only hands it the jobs and composes their configs.
Without `+plan` it sweeps exactly as the basic sweeper does.
"""
from __future__ import annotations

import sys

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from omegaconf import open_dict

from nanoexp.config import ConfigError


class NanoexpSweeper(BasicSweeper):
    def __init__(self, max_batch_size: int | None = None, params: dict[str, str] | None = None,
                 gpus: int | None = None, gpus_per_node: int | None = None, gpu: str | None = None) -> None:
        super().__init__(max_batch_size, params)
        self.machine = (gpus, gpu, gpus_per_node)

    def split_arguments(self, overrides, max_batch_size: int | None) -> list[list[list[str]]]:
        """The basic sweeper's batches, each job repeated once per planned layout when `+plan=topK` is given."""
        plans = [o for o in overrides if o.get_key_element().lstrip("+~") == "plan"]
        if not plans:
            return BasicSweeper.split_arguments(overrides, max_batch_size)
        try:
            jobs, records, machine = self.planned(plans[0], [o for o in overrides if o not in plans])
        except ConfigError as error:   # one line naming the key, before any job starts (Hydra's would add a second)
            print(f"nanoexp: invalid config: {error}", file=sys.stderr)
            sys.exit(2)
        from nanoexp.plan.sweep import write_plan
        write_plan(str(self.config.hydra.sweep.dir), records, *machine)
        return list(BasicSweeper.split_overrides_to_chunks(jobs, max_batch_size))

    def planned(self, plan, others):
        from nanoexp.plan.sweep import expand, machine, top_of
        if plan.is_sweep_override() or plan.is_delete():
            raise ConfigError(f"{plan.input_line}: give one plan, e.g. +plan=top4")
        top = top_of(plan.get_value_element_as_str())
        gpus, per_node, hw = machine(*self.machine)
        jobs = BasicSweeper.split_arguments(others, None)[0]
        jobs, records = expand(jobs, top, self.compose, gpus, per_node, hw)
        return jobs, records, (gpus, per_node, hw)

    def compose(self, overrides: list[str]):
        """The job's config as train.py receives it (without Hydra's own node)."""
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg
