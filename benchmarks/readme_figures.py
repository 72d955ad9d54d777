"""The README's pictures, from real runs: the default run's loss curve and the report of a small sweep.

    python benchmarks/readme_figures.py                          # runs both (the default run: 40 s - 2.5 min idle)
    python benchmarks/readme_figures.py --default-run DIR --sweep DIR   # draws from runs made before

Runs `python train.py` (the default run) and SWEEP (the README's sweep command, shortened by
`+experiment=e2e_small`'s model and batch) under outputs/readme/, then writes docs/images/default_run.png (training
and eval loss per step) and docs/images/sweep_loss_curves.png (the loss_curves.png that scripts/summarize_sweep.py
draws for the sweep). Prints each run's wall time and the machine's load before/after it (summary.json's
machine_load), the conditions the README states beside the pictures.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGES = os.path.join(ROOT, "docs", "images")
SWEEP = ["+experiment=e2e_small", "parallelism=dp2tp1pp1,dp1tp2pp1",
         "optimizer.learning_rate_scheduler.learning_rate=1e-3,1e-2", "tokens.train_steps=60",
         "tokens.val_check_interval=20", "optimizer.learning_rate_scheduler.lr_warmup_steps=6",
         "logging.iteration_step_info_interval=5"]


def train(args: list[str]) -> None:
    subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT, check=True)


def conditions(run_dir: str) -> str:
    """`<wall time> s, load <before>/<after> on <cores> cores` from a run's summary.json."""
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    load = summary.get("machine_load") or {}
    return (f"{run_dir}: {summary['status']}, eval loss {summary['eval_loss']:.4f}, {summary['wall_seconds']:.0f} s, "
            f"load {load.get('start', float('nan')):.1f}/{load.get('end', float('nan')):.1f} on {load.get('cpus')} "
            "cores (1-minute load average before/after)")


def draw_default_run(run_dir: str, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    train_loss = {r["step"]: r["loss"] for r in records if "loss" in r}     # a resumed run: the later line wins
    eval_loss = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(list(train_loss), list(train_loss.values()), linewidth=1.2, label="training loss (each logged step)")
    ax.plot(list(eval_loss), list(eval_loss.values()), linestyle="none", marker="o", markersize=7,
            markerfacecolor="none", label="eval loss (held-out Shakespeare)")
    last = max(eval_loss)
    ax.annotate(f"{eval_loss[last]:.3f}", (last, eval_loss[last]), textcoords="offset points", xytext=(-10, 10),
                ha="right")
    ax.set(xlabel="optimizer step (4,096 tokens each)", ylabel="loss (nats/token)",
           title="python train.py: the 0.54M-parameter Llama on the built-in Shakespeare")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def draw_sweep(sweep_dir: str, out: str) -> None:
    with tempfile.TemporaryDirectory() as report:
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "summarize_sweep.py"), sweep_dir, "--out",
                        report], cwd=ROOT, check=True)
        shutil.copy(os.path.join(report, "loss_curves.png"), out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--default-run", help="a finished `python train.py` run folder (default: run one)")
    parser.add_argument("--sweep", help="a finished sweep folder of SWEEP (default: run it)")
    parser.add_argument("--out", default=IMAGES, help="where the PNGs go (default docs/images)")
    args = parser.parse_args(argv)
    where = os.path.join(ROOT, "outputs", "readme")
    default_run, sweep = args.default_run, args.sweep
    if default_run is None:
        default_run = os.path.join(where, "default")
        train([f"hydra.run.dir={default_run}"])
    if sweep is None:
        sweep = os.path.join(where, "sweep")
        train(["-m", *SWEEP, f"hydra.sweep.dir={sweep}"])
    os.makedirs(args.out, exist_ok=True)
    draw_default_run(default_run, os.path.join(args.out, "default_run.png"))
    draw_sweep(sweep, os.path.join(args.out, "sweep_loss_curves.png"))
    for run_dir in [default_run] + sorted(glob.glob(os.path.join(sweep, "[0-9]*"))):
        print(conditions(run_dir))
    print(f"wrote default_run.png, sweep_loss_curves.png to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
