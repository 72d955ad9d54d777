"""Hydra callbacks (registered in conf/config.yaml under hydra.callbacks).

- `RunFolderGuard`: refuses a single run whose folder a live run owns before Hydra writes into it (its
  `.hydra/` and train.log), and remembers whether the folder existed before Hydra made it, so that a run
  refused at validation can remove the folder it created (and never one that held anything).
- `SweepReport`: when a multirun ends (also when a job failed, which makes Hydra raise), prints the
  table of the sweep's jobs and the command that plots them.
"""
from __future__ import annotations

import atexit
import os
import sys

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

_created: dict[str, str] = {}   # run folder -> the outermost folder Hydra had to create for it


def created_for_run(run_dir: str) -> str | None:
    """The outermost folder that did not exist before this run and holds `run_dir` (the run folder
    itself, or e.g. `outputs/<date>` for the first run of a day); None if the run folder existed."""
    return _created.get(os.path.abspath(run_dir))


class RunFolderGuard(Callback):
    def on_run_start(self, config, **kwargs) -> None:
        run_dir = OmegaConf.select(config, "hydra.run.dir")   # `now` is cached: the job sees the same path
        if not run_dir:
            return
        refuse_if_owned(run_dir)
        if os.path.exists(run_dir):
            return
        outermost = os.path.abspath(run_dir)
        while not os.path.exists(os.path.dirname(outermost)):
            outermost = os.path.dirname(outermost)
        _created[os.path.abspath(run_dir)] = outermost


def refuse_if_owned(run_dir: str) -> None:
    from nanoexp.parallel.context import launcher_env
    from nanoexp.launch.run_lock import busy_message, owner_of
    env = launcher_env()
    if env is not None and env["rank"] != 0:   # such ranks write into rank 0's folder (train.py)
        return
    held = owner_of(run_dir)
    if held is not None:
        print(f"nanoexp: {busy_message(os.path.realpath(run_dir), held[1], held[0])}", file=sys.stderr)
        sys.exit(2)


class SweepReport(Callback):
    def on_multirun_start(self, config, **kwargs) -> None:
        # Hydra raises out of the sweep when a job failed and skips on_multirun_end: print at exit.
        atexit.register(print_sweep_report, OmegaConf.select(config, "hydra.sweep.dir"))


def print_sweep_report(sweep_dir: str) -> None:
    from nanoexp.launch.sweep_report import busy_note, collect, health_note, plan_table, table

    if not sweep_dir or not os.path.isdir(sweep_dir):
        return
    rows, _ = collect(sweep_dir)
    if not rows:
        return
    columns = ["job", "overrides", "state", "final_loss", "eval_loss", "tokens_per_sec", "load"]
    failed = sum(row["state"] == "failed" for row in rows)
    print(f"\nsweep {os.path.abspath(sweep_dir)}: {len(rows)} jobs, {failed} failed\n{table(rows, columns)}")
    for note in (busy_note(rows), health_note(rows)):
        if note:
            print(note)
    if plan_table(sweep_dir, rows):
        print(plan_table(sweep_dir, rows))
    for row in rows:
        if row["state"] != "completed":
            print(f"  job {row['job']} {row['state']}: {row['reason']}")
    print(f"plots and CSV: python scripts/summarize_sweep.py {sweep_dir}", flush=True)
