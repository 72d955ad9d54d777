"""summary.json: what a run ended with. Global rank 0's trainer writes it (also when a step raises); the
launching process reads it for its last line, sweeps for their tables, SLURM requeues by its status.

`status` is completed, stopped (a stop signal: checkpointed before the end) or failed (with `error`). A run
that failed or was stopped must never look finished: `record_failure` writes the reason whatever raised (a
bad config before training, a failed local rank, the trainer itself), `stopped_by_signal` tells the launcher
to exit without a result.
"""
from __future__ import annotations

import json
import os

from nanoexp.parallel.context import launcher_env

SUMMARY_FILE = "summary.json"
PLAN_FILE = "plan.json"   # a +plan=topK sweep's predictions, by job (nanoexp/plan/sweep.py writes it)


def read_json(path: str) -> dict | None:
    """A JSON file nanoexp wrote (summary.json, a sweep's plan), or None where there is none."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def read_summary(run_dir: str) -> dict | None:
    return read_json(os.path.join(run_dir, SUMMARY_FILE))


def write_summary(run_dir: str, summary: dict) -> None:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, SUMMARY_FILE), "w") as f:
        json.dump(summary, f, indent=2)


def whole_run(run_dir: str, summary: dict, leg: dict, resumed: bool) -> dict:
    """`summary` covering the whole run, not only this leg (one start of it): `legs` lists each leg's steps, wall
    time, tokens trained and tokens/s, the earlier ones taken from the summary.json a leg of the same run (the
    same run_id) left in this folder; `wall_seconds` sums them. `tokens_per_sec` stays the last leg's, over the
    steps in `tokens_per_sec_steps`. A leg killed before it wrote summary.json is missing."""
    earlier = read_summary(run_dir) if resumed else None
    legs = earlier.get("legs", []) if earlier and earlier.get("run_id") == summary.get("run_id") else []
    legs = legs + [leg]
    return {**summary, "legs": legs, "wall_seconds": sum(leg["wall_seconds"] for leg in legs)}


def memory_fields(ranks: list[dict]) -> dict:
    """summary.json's memory fields and hosts from every rank's {"peak", "baseline", "memory", "host"} (in global
    rank order): `hosts` lists each host once, in the order of its first rank."""
    return {"peak_memory_mb": max(r["peak"] for r in ranks), "peak_memory_mb_per_rank": [r["peak"] for r in ranks],
            "baseline_memory_mb": max(r["baseline"] for r in ranks), "memory": [r["memory"] for r in ranks],
            "hosts": list(dict.fromkeys(r["host"] for r in ranks))}


def _is_writer() -> bool:
    """Only global rank 0 writes a run's shared files (and only it knows when summary.json is written)."""
    env = launcher_env()
    return env is None or env["rank"] == 0


def record_machine_load(run_dir: str, start: float, end: float, processes: int) -> None:
    """Add the machine's 1-minute load average before the run's workers started and when they ended, its cores
    and the run's own processes on it: throughput measured on a machine busy with other work is not comparable
    (nanoexp.launch.sweep_report flags such jobs)."""
    summary = read_summary(run_dir) if _is_writer() else None
    if summary is None:
        return
    summary["machine_load"] = {"start": start, "end": end, "cpus": os.cpu_count(), "processes": processes}
    write_summary(run_dir, summary)


def machine_was_busy(summary: dict) -> bool:
    """Whether other work kept the machine's cores busy during the run: its load average before the run, or at
    its end beyond the run's own processes, reached the number of cores."""
    load = summary.get("machine_load")
    if not load:
        return False
    return max(load["start"], load["end"] - load["processes"]) >= load["cpus"]


def record_failure(run_dir: str, error: BaseException) -> None:
    """Make the run folder's summary.json say `failed` and why, keeping the metrics a trainer may have written."""
    if not _is_writer():
        return
    summary = read_summary(run_dir) or {}
    if summary.get("status") == "failed" and summary.get("error"):
        return   # the trainer recorded the first error; this one only repeats it
    summary.update(status="failed", error=f"{type(error).__name__}: {error}")
    write_summary(run_dir, summary)


def stopped_by_signal(run_dir: str) -> bool:
    """Whether global rank 0's trainer left this run `stopped`. Other ranks answer False: they cannot know
    when rank 0's summary.json is written."""
    summary = read_summary(run_dir) if _is_writer() else None
    return summary is not None and summary.get("status") == "stopped"
