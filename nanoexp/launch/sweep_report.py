"""The results of a sweep folder as a table: one row per job, also those that failed, were killed or never started.

Used at the end of every multirun (launch/hydra_callbacks.py prints the table) and by scripts/summarize_sweep.py,
which adds the CSV (`write_csv`), the best learning rate per width when the jobs try several (`lr_sweep`,
`best_lr_table`) and the plots (nanoexp/launch/sweep_plots.py).
- Jobs are the job folders (`<dir>/<n>/` with `.hydra/`) and, for submitit sweeps, every submitted job
  (`<dir>/.submitit/<array>_<n>/`: array task n is sweep job n; a one-job sweep has no array).
- `state` is `completed`, `failed`, `stopped` (checkpointed on a signal, not yet resumed) or a queued or running
  SLURM job's SLURM state; `reason` says why a job is not completed: its summary.json's error, else submitit's, else
  what `sacct` says.
- A `+plan=topK` sweep (nanoexp/plan/sweep.py) leaves each job's predicted step in `<dir>/plan.json`: `plan_table`
  puts it beside the measured one.
- `overrides` shows only those whose values differ between the jobs (what the sweep varies). Rows stay in job order;
  `rank` is a job's place by a metric (eval loss by default), so the order never depends on the last digits.
"""
from __future__ import annotations

import csv
import glob
import math
import os
import re
import shutil
import subprocess

import yaml

from nanoexp.parallel.layout import Layout
from nanoexp.observe.metrics import read_metrics
from nanoexp.observe.summary import PLAN_FILE, machine_was_busy, read_json, read_summary

RECOMPUTE_OF = {True: "full", False: "none"}   # a plan written before the modes: recompute on or off

COLUMNS = ["job", "rank", "overrides", "layout", "lr", "final_loss", "eval_loss", "tokens_per_sec", "mfu",
           "peak_memory_mb", "load", "state", "reason"]
# One format per column (None: as is).
FORMATS = {"rank": "{:d}", "lr": "{:.3g}", "final_loss": "{:.4f}", "eval_loss": "{:.4f}", "tokens_per_sec": "{:,.0f}",
           "mfu": "{:.2%}", "peak_memory_mb": "{:,.0f}"}
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
    """The table row (with all of the job's overrides) and the metrics records of sweep job `number`."""
    folder = os.path.join(sweep_dir, str(number))
    row = {"job": number, "overrides": []}
    hydra_dir = os.path.join(folder, ".hydra")
    if os.path.isdir(hydra_dir):
        row["overrides"] = read_yaml(os.path.join(hydra_dir, "overrides.yaml")) or []
        cfg = read_yaml(os.path.join(hydra_dir, "config.yaml"))
        p = cfg["parallelism"]
        row["layout"] = Layout(dp=p["dp"], cp=p.get("cp", 1), tp=p["tp"], pp=p["pp"], ep=p.get("ep", 1)).name
        row["lr"] = cfg["optimizer"]["learning_rate_scheduler"]["learning_rate"]
        row["width"] = cfg["model"]["model_config"]["hidden_size"]   # for learning-rate transfer plots
        row["parametrization"] = cfg["model"].get("parametrization", "standard")
        row["optimizer"] = cfg["optimizer"].get("optimizer_factory", {}).get("name", "adamW")
    records = read_metrics(folder)
    summary = read_summary(folder) or {}
    for key in ("final_loss", "eval_loss", "tokens_per_sec", "mfu", "peak_memory_mb"):
        row[key] = summary.get(key)
    row.update({key: value for key, value in summary.items() if is_task_score(key)})   # eval/<task>/<metric>
    row["health"] = health_findings(summary)
    load, row["busy"] = summary.get("machine_load"), machine_was_busy(summary)
    row["load"] = f"{load['start']:.1f}/{load['end']:.1f}{' busy' if row['busy'] else ''}" if load else None
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


def differing_overrides(rows: list[dict]) -> None:
    """Replace each row's override list by the overrides whose key has different values across jobs."""
    values: dict[str, set] = {}
    for row in rows:
        for override in row["overrides"]:
            key, _, value = override.partition("=")
            values.setdefault(key, set()).add(value)
    varying = {key for key, vals in values.items()
               if len(vals) > 1 or any(key not in dict(o.partition("=")[::2] for o in r["overrides"]) for r in rows)}
    for row in rows:
        row["overrides"] = " ".join(o for o in row["overrides"] if o.partition("=")[0] in varying)


def collect(sweep_dir: str) -> tuple[list[dict], dict[int, list[dict]]]:
    """Every job's row (overrides reduced to what differs) and metrics records, by job number."""
    job_ids = submitit_jobs(sweep_dir)
    numbers = {int(name) for name in os.listdir(sweep_dir)
               if name.isdigit() and os.path.isdir(os.path.join(sweep_dir, name, ".hydra"))}
    rows, curves = [], {}
    for number in sorted(numbers | set(job_ids)):
        row, records = job_row(sweep_dir, number, job_ids.get(number))
        rows.append(row)
        curves[number] = records
    differing_overrides(rows)
    return rows, curves


def is_task_score(key: str) -> bool:
    """A downstream task's score in summary.json (eval/<task>/<metric>, not its stderr)."""
    return key.startswith("eval/") and key.count("/") == 2 and not key.endswith("_stderr")


def lower_is_better(metric: str) -> bool:
    """eval_loss (and any loss or perplexity): lower is better; a task's score (accuracy, exact match): higher."""
    return not is_task_score(metric) or any(word in metric for word in ("loss", "perplexity", "bits_per"))


def add_rank(rows: list[dict], metric: str) -> None:
    """Set each row's `rank` by `metric`: 1 for the best, equal values sharing a place, None without a finite value."""
    def value(row):
        v = row.get(metric)
        return v if isinstance(v, (int, float)) and math.isfinite(v) else None
    values = [value(row) for row in rows if value(row) is not None]
    for row in rows:
        v = value(row)
        better = [u for u in values if (u < v if lower_is_better(metric) else u > v)] if v is not None else None
        row["rank"] = None if v is None else len(better) + 1


def rank_note(metric: str) -> str:
    """The line that says what the rank column ranks by."""
    return f"rank: by {metric}, {'lowest' if lower_is_better(metric) else 'highest'} first (rows in job order)"


def busy_note(rows: list[dict]) -> str | None:
    """The line under a table whose jobs did not have the machine to themselves, naming them."""
    busy = [row["job"] for row in rows if row.get("busy")]
    if not busy:
        return None
    return (f"jobs {busy} ran while other work kept the machine's cores busy (load average before/after the job "
            "in column load): their tokens/s and MFU are not comparable with the others'")


def health_findings(summary: dict) -> str | None:
    """What summary.json's `health` found, counted by kind ("stragglers 1, spikes 2"); None: nothing."""
    found = [f"{kind} {len(entries)}" for kind, entries in (summary.get("health") or {}).items() if entries]
    return ", ".join(found) or None


def health_note(rows: list[dict]) -> str | None:
    """The line under a table naming the jobs whose runs found a straggler, a loss spike or a replay mismatch."""
    found = [f"job {row['job']}: {row['health']}" for row in rows if row.get("health")]
    return f"health findings (summary.json's health): {'; '.join(found)}" if found else None


def cell(column: str, value) -> str:
    if value is None or value == "":
        return "-"
    fmt = FORMATS.get(column)
    return fmt.format(value) if fmt and isinstance(value, (int, float)) else str(value)


def table(rows: list[dict], columns: list[str] = COLUMNS) -> str:
    """The rows as an aligned text table, numbers right-aligned, one format per column."""
    cells = [[cell(c, row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    numeric = [c in FORMATS or c == "job" for c in columns]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(columns)] + [line(r) for r in cells])


def write_csv(rows: list[dict], path: str) -> None:
    columns = COLUMNS + sorted({key for row in rows for key in row if is_task_score(key)})
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c) for c in columns})


def lr_sweep(rows: list[dict], metric: str = "eval_loss") -> dict[tuple[str, int], list[tuple[float, float | None]]]:
    """{(parametrization, width): [(lr, the metric or None), ...] sorted by lr, one point per rate}, or {} if one lr
    was tried. Jobs that share a rate (other layouts, seeds) give the mean of their finite values: the loss of a
    rate, not of a layout. When the jobs try several optimizers, each is a parametrization of its own ("standard,
    muon")."""
    if len({row.get("lr") for row in rows if row.get("lr")}) < 2:
        return {}
    several = len({row.get("optimizer") for row in rows if row.get("lr")}) > 1
    values: dict = {}
    for row in rows:
        if row.get("lr"):
            name = f"{row['parametrization']}, {row['optimizer']}" if several else row["parametrization"]
            value = row.get(metric)
            finite = [value] if isinstance(value, (int, float)) and math.isfinite(value) else []
            values.setdefault((name, row["width"]), {}).setdefault(row["lr"], []).extend(finite)
    order = sorted(values, key=lambda key: (not key[0].startswith("standard"), key))   # standard first, by width
    return {key: [(lr, sum(v) / len(v) if v else None) for lr, v in sorted(values[key].items())] for key in order}


def best(points: list[tuple[float, float | None]], metric: str) -> tuple[float | None, float | None]:
    """(value, lr) of the best finite point: the lowest loss, or the highest task score."""
    done = [(value, lr) for lr, value in points if value is not None and math.isfinite(value)]
    if not done:
        return None, None
    return min(done) if lower_is_better(metric) else max(done, key=lambda point: (point[0], -point[1]))


def best_lr_table(curves: dict, metric: str = "eval_loss") -> str:
    name = metric.replace("_", " ") if metric == "eval_loss" else metric
    lines = [f"{'parametrization':<16}{'width':>6}{'best lr':>18}{name:>11}   {name} at each lr, lowest rate first "
             "(the mean of a rate's jobs; - : none)"]
    for (parametrization, width), points in curves.items():
        value, lr = best(points, metric)
        chosen = f"{lr:.4g} (2^{math.log2(lr):.3g})" if lr else "-"
        each = " ".join("-" if v is None else f"{v:.3f}" for _, v in points)
        lines.append(f"{parametrization:<16}{width:>6}{chosen:>18}{value if value is None else f'{value:.4f}':>11}"
                     f"   {each}")
    return "\n".join(lines)


def read_plan(sweep_dir: str) -> dict | None:
    """The predictions of a `+plan=topK` sweep (nanoexp/plan/sweep.py writes them), or None."""
    return read_json(os.path.join(sweep_dir, PLAN_FILE))


def plan_table(sweep_dir: str, rows: list[dict]) -> str | None:
    """Predicted beside measured step time and tokens/s (all processes) of each job that carries a prediction;
    measured/predicted > 1: slower than predicted. None for a sweep without a plan."""
    plan = read_plan(sweep_dir)
    if not plan:
        return None
    lines = [f"planned for {plan['gpus']} x {plan['gpu']} ({plan['gpus_per_node']} a node): predicted beside measured",
             (f"{'job':>4}  {'rank':>4}  {'layout':<16}{'ZeRO':>4}{'mb':>4}{'recompute':>10}  {'step s pred':>11}"
              f"{'measured':>10}{'ratio':>7}  {'tok/s pred':>11}{'measured':>10}")]
    for row in sorted(rows, key=lambda row: row["job"]):
        p = plan["jobs"].get(str(row["job"]))
        if p is None:
            continue
        measured = row.get("tokens_per_sec")
        step = p["tokens_per_step"] / measured if measured else None
        ratio = f"{step / p['step_time_s']:.2f}" if step else "-"
        lines.append(f"{row['job']:>4}  {p['rank']:>4}  {p['layout']:<16}{p['zero_stage']:>4}{p['micro_batch']:>4}"
                     f"{RECOMPUTE_OF.get(p['recompute'], p['recompute']):>10}  {p['step_time_s']:>11.4f}"
                     f"{'-' if step is None else f'{step:.4f}':>10}"
                     f"{ratio:>7}"
                     f"  {p['tokens_per_s']:>11,.0f}{'-' if not measured else f'{measured:,.0f}':>10}")
    return "\n".join(lines)
