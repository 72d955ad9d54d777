"""The downstream tasks' curves of a run: every eval/<task>/<metric> of its metrics.jsonl against the step.

    python scripts/plot_downstream.py outputs/<date>/<time> [--out docs/evaluation_curve.png] [--title T]

One panel per task, one line per metric, its stderr as a band; the chance level of the shipped multiple-choice
task (25 %) dotted. Prints the values at each evaluation, and the seconds each evaluation took (`eval/seconds`)
beside the mean training step time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

CHANCE = {"shakespeare_choice": 0.25}   # four choices


def read_records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


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


def plot(tasks: dict, out: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 3.8), squeeze=False)
    for ax, (task, metrics) in zip(axes[0], tasks.items()):
        for metric, points in metrics.items():
            steps, values, errors = zip(*points)
            ax.plot(steps, values, marker="o", label=metric)
            ax.fill_between(steps, [v - e for v, e in zip(values, errors)], [v + e for v, e in zip(values, errors)],
                            alpha=0.2)
        if task in CHANCE:
            ax.axhline(CHANCE[task], linestyle=":", color="grey", label="chance")
        ax.set(title=task, xlabel="step", ylim=(0, 1))
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
    records = read_records(args.run_dir)
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
