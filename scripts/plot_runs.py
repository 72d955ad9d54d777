"""Plot the loss curves of a few runs and their difference to the first run: how a number format, an optimizer or a
layout changes training, where the curves themselves would lie on top of each other.

    python scripts/plot_runs.py RUN_DIR [RUN_DIR ...] [--labels A B ...] [--out loss_vs_first.png]

Top panel: each run's training loss (lines) and eval losses (large markers), from its metrics.jsonl. Bottom panel:
each run's loss minus the first run's at the steps both logged (lines), and the same for the eval losses
(markers). Prints each run's final training loss, eval losses and tokens/s (summary.json).
"""
from __future__ import annotations

import argparse
import json
import os

from nanoexp.observe.metrics import read_metrics


def read(run_dir: str) -> tuple[dict[int, float], dict[int, float], dict]:
    """(step -> training loss, step -> eval loss, summary) of a run folder."""
    train, evals = {}, {}
    for record in read_metrics(run_dir):
        if "loss" in record:
            train[record["step"]] = record["loss"]
        if "eval_loss" in record:
            evals[record["step"]] = record["eval_loss"]
    summary_path = os.path.join(run_dir, "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    return train, evals, summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run folders (the first is the reference)")
    parser.add_argument("--labels", nargs="+", help="one name per run (default: the folder names)")
    parser.add_argument("--out", default="loss_vs_first.png")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    labels = args.labels or [os.path.basename(os.path.normpath(run)) for run in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"--labels: {len(labels)} names for {len(args.runs)} runs")
    runs = [read(run) for run in args.runs]

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=(3, 2))
    (first_train, first_eval, _), markers = runs[0], "osD^vx"
    for i, ((train, evals, summary), label) in enumerate(zip(runs, labels)):
        line, = top.plot(list(train), list(train.values()), label=label, linewidth=1)
        colour, marker = line.get_color(), markers[i % len(markers)]
        top.plot(list(evals), list(evals.values()), linestyle="none", marker=marker, markersize=8,
                 markerfacecolor="none", color=colour)
        shared = [s for s in train if s in first_train]
        bottom.plot(shared, [train[s] - first_train[s] for s in shared], color=colour, linewidth=1)
        shared_eval = [s for s in evals if s in first_eval]
        bottom.plot(shared_eval, [evals[s] - first_eval[s] for s in shared_eval], linestyle="none", marker=marker,
                    markersize=8, markerfacecolor="none", color=colour)
        eval_text = ", ".join(f"{s}: {v:.4f}" for s, v in evals.items()) or "-"
        tokens = summary.get("tokens_per_sec")
        print(f"{label}: final loss {summary.get('final_loss', list(train.values())[-1]):.4f}, eval losses {eval_text}, "
              f"tokens/s {tokens and f'{tokens:,.0f}'}")
    top.set(ylabel="loss (nats/token)", title=args.title or "training loss (lines), eval loss (markers)")
    top.legend(fontsize="small")
    bottom.axhline(0, color="grey", linewidth=0.5)
    bottom.set(xlabel="optimizer step", ylabel=f"minus {labels[0]}'s loss")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
