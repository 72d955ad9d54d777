"""The downstream tasks' curves of a run: every eval/<task>/<metric> of its metrics.jsonl against the step.

    python scripts/plot_downstream.py outputs/<date>/<time> [--out docs/evaluation_curve.png] [--title T]

One panel per task, one line per metric, its stderr as a band; the chance level of the shipped multiple-choice
task (25 %) dotted. Each metric of a panel has its own line style and marker (the first a large hollow one, the
next smaller and filled), so metrics that coincide (acc and acc_norm when the choices are equally long) stay
visible, and the legend says where one equals an earlier one. Prints the values at each evaluation, and the seconds each evaluation took (`eval/seconds`)
beside the mean training step time.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics

from nanoexp.observe.metrics import read_metrics

CHANCE = {"shakespeare_choice": 0.25}   # four choices


def curves(records: list[dict]) -> dict[str, dict[str, list[tuple[int, float, float]]]]:
    """{task: {metric: [(step, value, stderr), ...]}} from the records that hold downstream scores."""
    out: dict = {}
    for record in (r for r in records if "eval/seconds" in r):
        for key, value in record.items():
            if key.count("/") == 2 and not key.endswith("_stderr"):
                _, task, metric = key.split("/")
                out.setdefault(task, {}).setdefault(metric, []).append(
                    (record["step"], value, record.get(f"{key}_stderr") or 0.0))
    return out


# (marker, line style, marker size, hollow) per metric of a panel: a later metric's marker sits inside an earlier one's.
STYLES = [("o", "-", 10, True), ("s", "--", 5, False), ("^", ":", 5, False), ("v", "-.", 5, False)]


def coincidence(points: list[tuple[int, float, float]], earlier: dict[str, list[tuple[int, float, float]]]) -> str:
    """' (= acc at every step)' or ' (= acc at steps 60, 120)' for the first earlier metric it equals somewhere."""
    for name, other in earlier.items():
        theirs = {step: value for step, value, _ in other}
        same = [step for step, value, _ in points if step in theirs and abs(theirs[step] - value) < 1e-9]
        if same:
            where = "every step" if len(same) == len(points) else "step " + ", ".join(map(str, same))
            return f" (= {name} at {where})"
    return ""


def plot(tasks: dict, out: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 3.8), squeeze=False)
    for ax, (task, metrics) in zip(axes[0], tasks.items()):
        drawn: dict = {}
        for (metric, points), (marker, style, size, hollow) in zip(metrics.items(), itertools.cycle(STYLES)):
            steps, values, errors = zip(*points)
            line, = ax.plot(steps, values, marker=marker, linestyle=style, markersize=size, markeredgewidth=1.5,
                            label=metric + coincidence(points, drawn))
            if hollow:
                line.set_markerfacecolor("none")
            ax.fill_between(steps, [v - e for v, e in zip(values, errors)], [v + e for v, e in zip(values, errors)],
                            alpha=0.2, color=line.get_color())
            drawn[metric] = points
        if task in CHANCE:
            ax.axhline(CHANCE[task], linestyle=":", color="grey", label="chance")
        ax.set(title=task, xlabel="step", ylabel="score (fraction of documents, ± stderr band)", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--out", default="evaluation_curve.png")
    parser.add_argument("--title", help="the figure's title (default: the run folder's name)")
    args = parser.parse_args()
    records = read_metrics(args.run_dir)
    tasks = curves(records)
    if not tasks:
        parser.error(f"{args.run_dir}/metrics.jsonl has no downstream scores (run with eval=shakespeare)")
    for task, metrics in tasks.items():
        for metric, points in metrics.items():
            print(f"{task}/{metric}: " + ", ".join(f"step {s} {v:.4f} ± {e:.4f}" for s, v, e in points))
    evals = [r["eval/seconds"] for r in records if "eval/seconds" in r]
    steps = [r["step_time_sec"] for r in records if "step_time_sec" in r]
    print(f"each evaluation took {min(evals):.1f}-{max(evals):.1f} s; a training step {statistics.median(steps):.3f} s "
          f"(median of the {len(steps)} logged)")
    plot(tasks, args.out, args.title or f"downstream tasks during training "
                                        f"({os.path.basename(os.path.normpath(args.run_dir))})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
