"""The plots of a sweep report (scripts/summarize_sweep.py), with matplotlib: loss_curves.png (training loss of every
job, eval losses as large markers, each job its own colour, line style and marker, failed jobs dashed),
tokens_per_sec.png, and lr_transfer.png: the metric against the learning rate (log-2 axis), one curve per width, one
panel per parametrization (the µTransfer picture; every finite point inside the axes, each width's best learning
rate a star, jobs without a value, e.g. diverged, crosses on the panel's top edge; the title names only the markers
drawn). Legends sit outside the axes and show only the overrides that differ, so they hide no point."""
from __future__ import annotations

import itertools
import math
import os

from nanoexp.launch.sweep_report import best, lower_is_better


def label(row: dict) -> str:
    """`#<job> <the overrides that differ>`, each key by its last part (learning_rate=0.01) unless two share it."""
    overrides = (row.get("overrides") or row.get("layout", "")).split()
    keys = [o.partition("=")[0] for o in overrides]
    short = [k.rsplit(".", 1)[-1] for k in keys]
    if len(set(short)) == len(short):
        overrides = [f"{s}={o.partition('=')[2]}" for s, o in zip(short, overrides)]
    return f"#{row['job']} {' '.join(overrides)}".strip()


def loss_figure(rows: list[dict], curves: dict[int, list[dict]]):
    """The training loss of every job (eval losses as large hollow markers of its colour) with one legend entry
    per job, outside the axes so that it hides no curve however many jobs there are."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    # Curves that coincide (the same run on two layouts) stay apart: each job its own marker, line style and
    # marker positions.
    styles = zip(itertools.cycle(["o", "s", "^", "v", "D", "x", "P"]), itertools.cycle([":", "-.", (0, (5, 2))]))
    for i, (row, (marker, style)) in enumerate(zip(rows, styles)):
        records = curves[row["job"]]
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
        if not train:
            continue
        steps, losses = zip(*train)
        line, = ax.plot(steps, losses, linestyle="--" if row["state"] != "completed" else style, marker=marker,
                        markevery=(i % every, every) if (every := max(1, len(steps) // 8)) else None, markersize=5,
                        label=f"{label(row)} ({row['state']})")
        if evals:
            ax.plot(*zip(*evals), linestyle="none", marker=marker, markersize=9, color=line.get_color(),
                    markerfacecolor="none")
    ax.set(xlabel="optimizer step", ylabel="loss (nats/token)",
           title="training loss (lines) and eval loss (large hollow markers)")
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return fig


def plot(rows: list[dict], curves: dict[int, list[dict]], out: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = loss_figure(rows, curves)
    fig.savefig(os.path.join(out, "loss_curves.png"), dpi=100, bbox_inches="tight")   # "tight": the legend too
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
    handles = {label: h for ax in axes[0] for h, label in zip(*ax.get_legend_handles_labels())}
    if handles:   # one legend of every width, beside the last panel
        axes[0][-1].legend(handles.values(), handles.keys(), fontsize="small", loc="upper left",
                           bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    axes[0][0].set_ylabel("eval loss (nats/token)" if metric == "eval_loss" else metric)
    values = [v for points in curves.values() for _, v in points if v is not None and math.isfinite(v)]
    if values:   # every finite point inside the panels (shared y axis)
        pad = 0.05 * (max(values) - min(values)) or 0.02
        axes[0][0].set_ylim(min(values) - pad, max(values) + pad)
    # The title explains only the markers drawn.
    keys = ([f"star: best ({'lowest' if lower_is_better(metric) else 'highest'}) per width"] if stars else []) + \
        ([f"x at the top: no {'eval loss' if metric == 'eval_loss' else 'score'} (failed or diverged)"] if crosses else [])
    title = f"{'Eval loss' if metric == 'eval_loss' else metric} against learning rate per width"
    fig.suptitle(title + (f"\n({'; '.join(keys)})" if keys and len(panels) == 1 else  # one narrow panel: 2 lines
                          f" ({'; '.join(keys)})" if keys else ""))
    fig.tight_layout()
    fig.savefig(os.path.join(out, "lr_transfer.png"), dpi=90, bbox_inches="tight")
    plt.close(fig)
    return "lr_transfer.png"
