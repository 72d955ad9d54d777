"""Summarize a Hydra sweep folder: one row per job, a CSV, and plots.

    python scripts/summarize_sweep.py outputs/multirun/<date>/<time> [--out DIR] [--no-plots]

Promises:
- Every job of the sweep has a row, including jobs that failed, were killed, or never started:
  job folders (`<dir>/<n>/` with `.hydra/`) and, for submitit sweeps, every submitted job
  (`<dir>/.submitit/<array>_<n>/`: array task n is sweep job n; a one-job sweep has no array).
- `state` is `completed`, `failed`, `stopped` (checkpointed on a signal, not yet resumed) or, for a
  SLURM job that is still queued or running, its SLURM state; `reason` says why a job is not
  completed: the error in its summary.json, else the error submitit recorded, else what `sacct` says.
- Writes `<out>/summary.csv`, and with matplotlib `<out>/loss_curves.png` (the training loss of
  every job on one chart; failed jobs dashed) and `<out>/tokens_per_sec.png` (one bar per job).
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import yaml

COLUMNS = ["job", "overrides", "layout", "lr", "final_loss", "eval_loss", "tokens_per_sec", "mfu",
           "peak_memory_mb", "state", "reason"]
SLURM_DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE")


def read_yaml(path: str):
    with open(path) as f:
        return yaml.safe_load(f)


def submitit_jobs(sweep_dir: str) -> dict[int, str]:
    """Sweep job number -> submitit job id: "<array>_<n>" for task n of a job array, the plain id for a
    one-job sweep (submitted without an array). A later submission of the same number wins."""
    jobs = {}
    pickles = glob.glob(os.path.join(sweep_dir, ".submitit", "*", "*_submitted.pkl"))
    for path in sorted(pickles, key=os.path.getmtime):
        match = re.fullmatch(r"(\d+)(?:_(\d+))?", os.path.basename(os.path.dirname(path)))
        if match:
            jobs[int(match.group(2) or 0)] = match.group(0)
    return jobs


def submitit_error(sweep_dir: str, job_id: str) -> str | None:
    """The last exception line in submitit's stderr log of task 0, or None. Read from the text log:
    submitit's result file is a pickle, and this project never unpickles files."""
    path = os.path.join(sweep_dir, ".submitit", job_id, f"{job_id}_0_log.err")
    if not os.path.exists(path):
        return None
    with open(path, errors="replace") as f:
        errors = [line.strip() for line in f if re.match(r"[\w.]*(Error|Exception|Exit)\b.*", line)]
    return errors[-1] if errors else None


def slurm_state(job_id: str) -> str | None:
    """SLURM's state of a job ("COMPLETED", "FAILED", "RUNNING", ...) from sacct, or None without sacct."""
    if shutil.which("sacct") is None:
        return None
    result = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State,ExitCode", "-j", job_id],
                            capture_output=True, text=True, timeout=30)
    rows = [line for line in result.stdout.splitlines() if line.strip()]
    if result.returncode != 0 or not rows:
        return None
    state, exit_code = rows[-1].split("|")
    return f"{state.split()[0]} (exit code {exit_code})"


def job_row(sweep_dir: str, number: int, job_id: str | None) -> tuple[dict, list[dict]]:
    """The table row and the metrics records of sweep job `number`."""
    folder = os.path.join(sweep_dir, str(number))
    row = {"job": number}
    hydra_dir = os.path.join(folder, ".hydra")
    if os.path.isdir(hydra_dir):
        row["overrides"] = " ".join(read_yaml(os.path.join(hydra_dir, "overrides.yaml")) or [])
        cfg = read_yaml(os.path.join(hydra_dir, "config.yaml"))
        p = cfg["parallelism"]
        row["layout"] = f"dp{p['dp']}tp{p['tp']}pp{p['pp']}"
        row["lr"] = cfg["optimizer"]["learning_rate_scheduler"]["learning_rate"]
    records = []
    if os.path.exists(os.path.join(folder, "metrics.jsonl")):
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
    summary = {}
    if os.path.exists(os.path.join(folder, "summary.json")):
        with open(os.path.join(folder, "summary.json")) as f:
            summary = json.load(f)
    for key in ("final_loss", "eval_loss", "tokens_per_sec", "mfu", "peak_memory_mb"):
        row[key] = summary.get(key)
    row["state"], row["reason"] = job_state(sweep_dir, folder, summary, job_id)
    return row, records


def job_state(sweep_dir: str, folder: str, summary: dict, job_id: str | None) -> tuple[str, str]:
    if summary.get("status") == "completed":
        return "completed", ""
    if summary.get("status") == "failed":
        return "failed", summary.get("error") or "failed (no error recorded)"
    if job_id is not None:
        error = submitit_error(sweep_dir, job_id)
        if error:
            return "failed", error
        state = slurm_state(job_id)
        if state and not state.startswith(SLURM_DONE):
            return state.split()[0].lower(), f"SLURM job {job_id} is {state}"
        if state:
            if summary.get("status") == "stopped":
                return "stopped", f"checkpointed on a signal; SLURM job {job_id} ended {state}"
            return "failed", f"SLURM job {job_id} ended {state} without a result (killed from outside?)"
    if summary.get("status") == "stopped":
        return "stopped", "checkpointed on a signal; run it again to resume"
    if not os.path.isdir(folder):
        return "failed", "never started: no job folder"
    return "failed", "no summary.json: the job was killed (or is still running)"


def collect(sweep_dir: str) -> tuple[list[dict], dict[int, list[dict]]]:
    job_ids = submitit_jobs(sweep_dir)
    numbers = {int(name) for name in os.listdir(sweep_dir)
               if name.isdigit() and os.path.isdir(os.path.join(sweep_dir, name, ".hydra"))}
    rows, curves = [], {}
    for number in sorted(numbers | set(job_ids)):
        row, records = job_row(sweep_dir, number, job_ids.get(number))
        rows.append(row)
        curves[number] = records
    return rows, curves


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print_table(rows: list[dict]) -> None:
    cells = [[fmt(row.get(c)) for c in COLUMNS] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(COLUMNS)]
    print("  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c) for c in COLUMNS})


def plot(rows: list[dict], curves: dict[int, list[dict]], out: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for row in rows:
        points = [(r["step"], r["loss"]) for r in curves[row["job"]] if "loss" in r]
        if points:
            steps, losses = zip(*points)
            ax.plot(steps, losses, linestyle="-" if row["state"] == "completed" else "--",
                    label=f"#{row['job']} {row.get('overrides', '')} ({row['state']})")
    ax.set(xlabel="step", ylabel="training loss (nats/token)", title="loss curves")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss_curves.png"), dpi=100)
    plt.close(fig)

    done = [row for row in rows if row.get("tokens_per_sec")]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([f"#{r['job']} {r.get('layout', '?')}" for r in done], [r["tokens_per_sec"] for r in done])
    ax.set(ylabel="tokens/s (all ranks)", title="throughput per layout")
    ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "tokens_per_sec.png"), dpi=100)
    plt.close(fig)
    return ["loss_curves.png", "tokens_per_sec.png"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_dir", help="a Hydra sweep folder, e.g. outputs/multirun/<date>/<time>")
    parser.add_argument("--out", help="where summary.csv and the plots go (default: the sweep folder)")
    parser.add_argument("--no-plots", action="store_true", help="only the table and the CSV")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.sweep_dir):
        parser.error(f"{args.sweep_dir}: no such folder")
    out = args.out or args.sweep_dir
    os.makedirs(out, exist_ok=True)
    rows, curves = collect(args.sweep_dir)
    if not rows:
        print(f"{args.sweep_dir}: no jobs found (no <n>/.hydra folders, no .submitit jobs)", file=sys.stderr)
        return 1
    print_table(rows)
    write_csv(rows, os.path.join(out, "summary.csv"))
    written = ["summary.csv"]
    if not args.no_plots:
        try:
            written += plot(rows, curves, out)
        except ImportError:
            print("matplotlib is not installed (pip install -e '.[plots]'): no plots", file=sys.stderr)
    failed = sum(row["state"] == "failed" for row in rows)
    print(f"{len(rows)} jobs, {failed} failed; wrote {', '.join(written)} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
