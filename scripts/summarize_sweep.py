"""Summarize a Hydra sweep folder: the table of its jobs, a CSV, and plots.

    python scripts/summarize_sweep.py outputs/multirun/<date>/<time> [--out DIR] [--no-plots]

Promises:
- Every job of the sweep has a row, including jobs that failed, were killed, or never started, with
  the overrides that differ between jobs, the layout, the peak LR, losses, speed, memory, its state and
  why it is not completed (see nanoexp/sweep_report.py, which also prints this table at the end of
  every multirun).
- Writes `<out>/summary.csv`, and with matplotlib `<out>/loss_curves.png` (training loss of every
  job, eval losses as large markers, each job its own colour, line style and marker; failed jobs
  dashed; the legend shows only the overrides that differ) and `<out>/tokens_per_sec.png`.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import os
import sys

from nanoexp.sweep_report import COLUMNS, collect, table


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c) for c in COLUMNS})


def label(row: dict) -> str:
    return f"#{row['job']} {row.get('overrides') or row.get('layout', '')}".strip()


def plot(rows: list[dict], curves: dict[int, list[dict]], out: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    # Curves that coincide (the same run on two layouts) stay apart by style and marker.
    styles = itertools.cycle(itertools.product(["o", "s", "^", "v", "D", "x"], [":", "-.", (0, (5, 2))]))
    for row, (marker, style) in zip(rows, styles):
        records = curves[row["job"]]
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
        if not train:
            continue
        steps, losses = zip(*train)
        line, = ax.plot(steps, losses, linestyle="--" if row["state"] != "completed" else style, marker=marker,
                        markevery=max(1, len(steps) // 8), markersize=4, label=f"{label(row)} ({row['state']})")
        if evals:
            ax.plot(*zip(*evals), linestyle="none", marker=marker, markersize=9, color=line.get_color(),
                    markerfacecolor="none", label=f"{label(row)} eval")
    ax.set(xlabel="optimizer step", ylabel="loss (nats/token)", title="training loss (lines) and eval loss (large markers)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss_curves.png"), dpi=100)
    plt.close(fig)

    done = [row for row in rows if row.get("tokens_per_sec")]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([label(r) for r in done], [r["tokens_per_sec"] for r in done])
    ax.set(xlabel="job (overrides that differ)", ylabel="tokens/s (all ranks)", title="throughput per job")
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
    print(table(rows))
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
