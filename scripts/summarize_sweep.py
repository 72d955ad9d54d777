"""Summarize a Hydra sweep folder: the table of its jobs, a CSV, and plots.

    python scripts/summarize_sweep.py outputs/multirun/<date>/<time> [--out DIR] [--no-plots]

Promises:
- Every job of the sweep has a row, including jobs that failed, were killed, or never started, with
  the overrides that differ between jobs, the layout, the peak LR, losses, speed, memory, its state and
  why it is not completed (see nanoexp/launch/sweep_report.py, which also prints this table at the end of
  every multirun).
- Writes `<out>/summary.csv`, and with matplotlib `<out>/loss_curves.png` (training loss of every
  job, eval losses as large markers, each job its own colour, line style and marker; failed jobs
  dashed; the legend shows only the overrides that differ) and `<out>/tokens_per_sec.png`.
- When the jobs try more than one learning rate, prints the best learning rate (lowest eval loss) per
  parametrization and width, and writes `<out>/lr_transfer.png`: eval loss against learning rate (log-2
  axis), one curve per width, one panel per parametrization (the µTransfer picture; every finite point inside
  the axes, the best learning rate of each width a star, jobs without an eval loss, e.g. diverged, crosses on
  the panel's top edge; the title names only the markers drawn).
- `--rank-by eval/<task>/<metric>` (a downstream task's score, from the runs' summary.json; see
  docs/evaluation.md) orders the table by that score, best first, adds it as a column, and picks the best
  learning rate and draws lr_transfer.png by it (higher is better for a task's score); the default ranks by
  eval loss (lower is better). The CSV has every task score any job has.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import math
import os
import sys

from nanoexp.launch.sweep_report import COLUMNS, busy_note, collect, is_task_score, lower_is_better, ranked, table


def write_csv(rows: list[dict], path: str) -> None:
    columns = COLUMNS + sorted({key for row in rows for key in row if is_task_score(key)})
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c) for c in columns})


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


def lr_sweep(rows: list[dict], metric: str = "eval_loss") -> dict[tuple[str, int], list[tuple[float, float | None]]]:
    """{(parametrization, width): [(lr, the metric or None), ...] sorted by lr}, or {} if one lr was tried."""
    if len({row.get("lr") for row in rows if row.get("lr")}) < 2:
        return {}
    curves: dict = {}
    for row in rows:
        if row.get("lr"):
            curves.setdefault((row["parametrization"], row["width"]), []).append((row["lr"], row.get(metric)))
    order = sorted(curves, key=lambda key: (key[0] != "standard", key))   # standard first, then by width
    return {key: sorted(curves[key]) for key in order}


def best(points: list[tuple[float, float | None]], metric: str) -> tuple[float | None, float | None]:
    """(value, lr) of the best finite point: the lowest loss, or the highest task score."""
    done = [(value, lr) for lr, value in points if value is not None and math.isfinite(value)]
    if not done:
        return None, None
    return min(done) if lower_is_better(metric) else max(done, key=lambda point: (point[0], -point[1]))


def best_lr_table(curves: dict, metric: str = "eval_loss") -> str:
    name = metric.replace("_", " ") if metric == "eval_loss" else metric
    lines = [f"{'parametrization':<16}{'width':>6}{'best lr':>18}{name:>11}   {name} at each lr (- : none)"]
    for (parametrization, width), points in curves.items():
        value, lr = best(points, metric)
        chosen = f"{lr:.4g} (2^{math.log2(lr):.3g})" if lr else "-"
        each = " ".join("-" if v is None else f"{v:.3f}" for _, v in points)
        lines.append(f"{parametrization:<16}{width:>6}{chosen:>18}{value if value is None else f'{value:.4f}':>11}"
                     f"   {each}")
    return "\n".join(lines)


def plot_lr_transfer(curves: dict, out: str, metric: str = "eval_loss") -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys(p for p, _ in curves))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), sharey=True, squeeze=False)
    colours = plt.get_cmap("plasma")
    widths = sorted({w for _, w in curves})
    stars = crosses = 0
    for ax, parametrization in zip(axes[0], panels):
        for i, width in enumerate(widths):
            points = curves.get((parametrization, width), [])
            colour = colours(i / max(len(widths), 2))
            done = [(lr, loss) for lr, loss in points if loss is not None and math.isfinite(loss)]
            if done:
                ax.plot(*zip(*done), marker="o", color=colour, label=f"width {width}")
                value, lr = best(points, metric)
                ax.plot(lr, value, marker="*", markersize=16, color=colour, markeredgecolor="black", linestyle="none",
                        zorder=3)
                stars += 1
            for lr in [lr for lr, loss in points if loss is None or not math.isfinite(loss)]:
                ax.plot(lr, 1.0, marker="x", color=colour, transform=ax.get_xaxis_transform(), clip_on=False)
                crosses += 1
        ax.set_xscale("log", base=2)
        ax.set(title=f"{parametrization}", xlabel="learning rate (log2; µP: the base width's)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[0][0].set_ylabel("eval loss (nats/token)" if metric == "eval_loss" else metric)
    values = [v for points in curves.values() for _, v in points if v is not None and math.isfinite(v)]
    if values:   # every finite point inside the panels (shared y axis)
        pad = 0.05 * (max(values) - min(values)) or 0.02
        axes[0][0].set_ylim(min(values) - pad, max(values) + pad)
    # The title explains only the markers drawn.
    keys = ([f"star: best ({'lowest' if lower_is_better(metric) else 'highest'}) per width"] if stars else []) + \
        ([f"x at the top: no {'eval loss' if metric == 'eval_loss' else 'score'} (failed or diverged)"] if crosses else [])
    fig.suptitle(f"{'Eval loss' if metric == 'eval_loss' else metric} against learning rate per width"
                 + (f" ({'; '.join(keys)})" if keys else ""))
    fig.tight_layout()
    fig.savefig(os.path.join(out, "lr_transfer.png"), dpi=90)
    plt.close(fig)
    return "lr_transfer.png"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_dir", help="a Hydra sweep folder, e.g. outputs/multirun/<date>/<time>")
    parser.add_argument("--out", help="where summary.csv and the plots go (default: the sweep folder)")
    parser.add_argument("--no-plots", action="store_true", help="only the table and the CSV")
    parser.add_argument("--rank-by", default="eval_loss", help="eval_loss (default, lower is better) or a task's "
                        "score eval/<task>/<metric> (higher is better), e.g. eval/shakespeare_choice/acc")
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
    rows = ranked(rows, metric)
    print(table(rows, COLUMNS if metric in COLUMNS else COLUMNS[:-2] + [metric] + COLUMNS[-2:]))
    if busy_note(rows):
        print(busy_note(rows))
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
