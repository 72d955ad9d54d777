"""Summarize a Hydra sweep folder: the table of its jobs, a CSV, and plots.

    python scripts/summarize_sweep.py outputs/multirun/<date>/<time> [--out DIR] [--no-plots]

Promises:
- Every job of the sweep has a row, including jobs that failed, were killed, or never started, with
  the overrides that differ between jobs, the layout, the peak LR, losses, speed, memory, its state and
  why it is not completed (see nanoexp/launch/sweep_report.py, which also prints this table at the end of
  every multirun; the plots are nanoexp/launch/sweep_plots.py's).
- Writes `<out>/summary.csv`, and with matplotlib `<out>/loss_curves.png` (training loss of every
  job, eval losses as large markers, each job its own colour, line style and marker; failed jobs
  dashed; the legend shows only the overrides that differ) and `<out>/tokens_per_sec.png`.
- When the jobs try more than one learning rate, prints the best learning rate (lowest eval loss) per
  parametrization and width, and writes `<out>/lr_transfer.png`: eval loss against learning rate (log-2
  axis), one curve per width, one panel per parametrization (the µTransfer picture; every finite point inside
  the axes, the best learning rate of each width a star, jobs without an eval loss, e.g. diverged, crosses on
  the panel's top edge; the title names only the markers drawn).
- For a `+plan=topK` sweep, the planner's predicted step time and tokens/s beside the measured ones, with their
  ratio (sweep_report.plan_table, docs/planning.md).
- Rows in job order; the `rank` column is each job's place by eval loss (lowest first), or with `--rank-by
  eval/<task>/<metric>` by a downstream task's score (highest first; from the runs' summary.json, see
  docs/evaluation.md), which is then also a column and picks the best learning rate and lr_transfer.png's values.
  A line under the table names the ranking. The CSV has every task score any job has.
"""
from __future__ import annotations

import argparse
import os
import sys

from nanoexp.launch.sweep_plots import plot, plot_lr_transfer
from nanoexp.launch.sweep_report import (COLUMNS, add_rank, best_lr_table, busy_note, collect, health_note, lr_sweep,
                                         plan_table, rank_note, table, write_csv)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_dir", help="a Hydra sweep folder, e.g. outputs/multirun/<date>/<time>")
    parser.add_argument("--out", help="where summary.csv and the plots go (default: the sweep folder)")
    parser.add_argument("--no-plots", action="store_true", help="only the table and the CSV")
    parser.add_argument("--rank-by", default="eval_loss", help="what the rank column ranks by: eval_loss (default, "
                        "lowest first) or a task's score eval/<task>/<metric> (highest first), e.g. "
                        "eval/shakespeare_choice/acc")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.sweep_dir):
        parser.error(f"{args.sweep_dir}: no such folder")
    out = args.out or args.sweep_dir
    os.makedirs(out, exist_ok=True)
    rows, curves = collect(args.sweep_dir)
    if not rows:
        print(f"{args.sweep_dir}: no jobs found (no <n>/.hydra folders, no .submitit jobs)", file=sys.stderr)
        return 1
    metric = args.rank_by
    if metric != "eval_loss" and not any(metric in row for row in rows):
        parser.error(f"--rank-by {metric}: no job recorded it (summary.json keys eval/<task>/<metric>)")
    add_rank(rows, metric)
    print(table(rows, COLUMNS if metric in COLUMNS else COLUMNS[:-2] + [metric] + COLUMNS[-2:]))
    print(rank_note(metric))
    for note in (busy_note(rows), health_note(rows)):
        if note:
            print(note)
    if plan_table(args.sweep_dir, rows):
        print(plan_table(args.sweep_dir, rows))
    write_csv(rows, os.path.join(out, "summary.csv"))
    written = ["summary.csv"]
    transfer = lr_sweep(rows, metric)
    if transfer:
        print(f"\nbest learning rate per width ({metric}):\n" + best_lr_table(transfer, metric))
    if not args.no_plots:
        try:
            written += plot(rows, curves, out) + ([plot_lr_transfer(transfer, out, metric)] if transfer else [])
        except ImportError:
            print("matplotlib is not installed (pip install -e '.[plots]'): no plots", file=sys.stderr)
    failed = sum(row["state"] == "failed" for row in rows)
    print(f"{len(rows)} jobs, {failed} failed; wrote {', '.join(written)} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
