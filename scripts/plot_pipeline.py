"""Draw a run's pipeline timeline and measure its bubble (train with logging.pipeline_trace=true).

    python scripts/plot_pipeline.py RUN [--step N] [--out FILE.png]

One row per pipeline stage (the ranks of data-parallel replica 0, tensor-parallel rank 0):
forwards in blue, backwards in green and the zero-bubble schedules' W steps in orange, one shade per chunk, the micro-batch number inside,
as in the GPipe / 1F1B / Megatron-LM figures; posting point-to-point batches and waiting for a received
tensor as thin grey bars under each row; data-parallel gradient buckets as a red triangle when their
all-reduce was launched and a red bar while it was waited on.

Prints the measured bubble fraction (median over the steps after the first, which pays for
warm-up) next to the theoretical (p-1)/(m+p-1) of 1F1B and (p-1)/(v·m+p-1) of interleaved
1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM"), the run's own schedule's figure from the step's measured F, B and W times
(nanoexp/verify/pipeline_bubble.py), and when each gradient bucket was launched relative to the end of the
last backward.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

from nanoexp.instruments.trace import TRACE_DIR
from nanoexp.verify.trace_analysis import (COMPUTE, bucket_overlap, measured_bubble, predicted_bubble, read_trace,
                                           theoretical_bubble)


def one_pipeline(metas, events):
    """Keep dp replica 0, tp rank 0: one rank per stage, all holding the same schedule."""
    metas = sorted((m for m in metas if m["dp_rank"] == 0 and m["tp_rank"] == 0), key=lambda m: m["pp_rank"])
    ranks = {m["rank"] for m in metas}
    return metas, [e for e in events if e["rank"] in ranks]


def draw(path, metas, events, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    v = metas[0]["virtual_stages"]
    t0 = min(e["start"] for e in events)
    ms = lambda t: (t - t0) * 1e3  # noqa: E731
    span = ms(max(e["end"] for e in events))
    fig, ax = plt.subplots(figsize=(14, 0.9 * len(metas) + 1.6))
    for row, meta in enumerate(metas):
        mine = [e for e in events if e["rank"] == meta["rank"]]
        for e in mine:
            left, width = ms(e["start"]), ms(e["end"]) - ms(e["start"])
            if e["kind"] in COMPUTE:
                shade = 0.45 + 0.4 * (e.get("chunk") or 0) / max(v - 1, 1)
                color = {"forward": plt.cm.Blues, "backward": plt.cm.Greens, "weight": plt.cm.Oranges}[e["kind"]](shade)
                ax.barh(row, width, left=left, height=0.6, color=color, edgecolor="black", linewidth=0.3)
                if width > span / 150:
                    ax.text(left + width / 2, row, str(e["mb"]), ha="center", va="center", fontsize=7)
            elif e["kind"] == "allreduce_launch":
                ax.plot(left, row - 0.42, marker="v", color="red", markersize=6)
            elif e["kind"] == "allreduce_wait":
                ax.barh(row - 0.36, max(width, span / 1000), left=left, height=0.08, color="red")
            else:   # point-to-point communication
                ax.barh(row + 0.38, width, left=left, height=0.08, color="grey")
    ax.set_yticks(range(len(metas)), [f"stage {m['pp_rank']} (rank {m['rank']})" for m in metas])
    ax.invert_yaxis()
    ax.set_xlabel("time since the step's first event (ms)")
    ax.set_title(title, fontsize=10, loc="left", pad=20)   # above the legend
    handles = [plt.Rectangle((0, 0), 1, 1, color=plt.cm.Blues(0.6)), plt.Rectangle((0, 0), 1, 1, color=plt.cm.Greens(0.6)),
               plt.Rectangle((0, 0), 1, 1, color=plt.cm.Oranges(0.6)), plt.Rectangle((0, 0), 1, 1, color="grey"),
               plt.Line2D([], [], color="red", marker="v", linestyle="")]
    ax.legend(handles, ["forward (darker: later chunk)", "backward (B where W is split off)", "W (weight gradients)",
                        "send / receive", "DP bucket all-reduce"],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=5, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", help="the run folder (holds pipeline_trace/)")
    parser.add_argument("--step", type=int, default=None, help="step to draw (default: the last traced)")
    parser.add_argument("--out", default=None, help=f"PNG path (default: RUN/{TRACE_DIR}/timeline_step<N>.png)")
    args = parser.parse_args(argv)

    try:
        metas, events = one_pipeline(*read_trace(args.run))
    except FileNotFoundError as error:
        parser.error(str(error))
    steps = sorted({e["step"] for e in events})
    step = args.step if args.step is not None else steps[-1]
    if step not in steps:
        parser.error(f"step {step} was not traced (traced: {steps[0]}..{steps[-1]})")
    p, v, engine = metas[0]["pp"], metas[0]["virtual_stages"], metas[0]["engine"]
    num_micro = len({e["mb"] for e in events if e["step"] == step and e["kind"] == "forward"})
    measured = {s: measured_bubble([e for e in events if e["step"] == s]) for s in steps}
    steady = [s for s in steps if s > steps[0]] or steps
    median = statistics.median(measured[s] for s in steady)
    one_f_one_b, interleaved = theoretical_bubble(p, num_micro), theoretical_bubble(p, num_micro, v)
    step_events = [e for e in events if e["step"] == step]
    predicted = predicted_bubble(step_events, engine, p, v, num_micro)

    print(f"pipeline: {engine}, p={p} stages, m={num_micro} micro-batches, v={v} chunk(s) per rank")
    print(f"bubble fraction, measured:  {median:.3f} (median over steps {steady[0]}..{steady[-1]}; "
          f"step {step}: {measured[step]:.3f}); communication counts as idle")
    print(f"bubble fraction, theory:    1F1B (p-1)/(m+p-1) = {one_f_one_b:.3f}   "
          f"interleaved (p-1)/(v*m+p-1) = {interleaved:.3f}   (Narayanan et al. 2021)")
    print(f"bubble fraction, {engine} with step {step}'s F/B/W times: {predicted['dependencies']:.3f} by its order, "
          f"{predicted['nccl']:.3f} under NCCL's rules (nanoexp/verify/pipeline_bubble.py)")
    overlap = bucket_overlap([e for e in step_events if e["rank"] == metas[0]["rank"]])
    if overlap:
        print(f"DP gradient buckets (step {step}, rank {metas[0]['rank']}), ms relative to the end of its last backward:")
        print("  chunk  bucket  launched  in backward  wait from  wait")
        for row in overlap:
            wait = "-" if row["wait"] is None else f"{row['wait_start'] * 1e3:+9.2f}  {row['wait'] * 1e3:6.2f}"
            print(f"  {row['chunk']!s:5}  {row['bucket']:6}  {row['launch'] * 1e3:+8.2f}  "
                  f"{'yes' if row['in_backward'] else 'no':11}  {wait}")

    out = args.out or os.path.join(args.run, TRACE_DIR, f"timeline_step{step}.png")
    title = (f"{engine}: p={p}, m={num_micro}, v={v}, step {step} | bubble measured {measured[step]:.3f}, "
             f"predicted {predicted['dependencies']:.3f}")
    draw(out, metas, step_events, title)
    print(f"timeline: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
