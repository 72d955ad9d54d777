"""Balancing a mixture of experts at work: runs of one model with different `model.moe.balance`, plotted step by step.

    python scripts/plot_moe_balance.py                                # 300-step moe_tiny runs -> docs/moe_balance.png
    python scripts/plot_moe_balance.py --model qwen3_moe_tiny --balances aux_loss,bias \
        --out docs/moe_balance_bias.png                              # the routing bias against the aux loss
    python scripts/plot_moe_balance.py --steps 60 --out /tmp/b.png    # a quick look
    python scripts/plot_moe_balance.py --run-dir outputs/moe_balance  # reuse the runs already there

Each run is `python train.py model=<model> tokens.train_steps=<steps>` plus its balance's overrides (`BALANCES`:
aux_loss keeps the model's aux_loss_coef; bias and none set it to 0), logging every step, in <run-dir>/<balance>/
(Hydra's run folder, `hydra.run.dir`). A run folder whose metrics.jsonl already reaches the last step is read, not
run again (--rerun runs it afresh). The figure has one panel per MoE layer, its load imbalance
(`moe_load_imbalance/layer_n`: the busiest expert's tokens over the mean, 1 = even) against the step, and one of
`moe_aux_loss` (summed over the MoE layers, before the coefficient; 1 per layer when the load is even), each curve a
10-step running mean over the logged values (drawn faintly). A table of the logged values at a few steps, each
layer's mean and largest imbalance over the last sixth of the run, and each run's eval losses are printed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

from nanoexp.observe.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMBALANCE = "moe_load_imbalance/layer_"


BALANCES = {   # --balances: each run's overrides
    "aux_loss": ["model.moe.balance=aux_loss"],
    "bias": ["model.moe.balance=bias", "model.moe.aux_loss_coef=0"],
    "none": ["model.moe.balance=none", "model.moe.aux_loss_coef=0"],
}


def finished(records: list[dict], steps: int) -> bool:
    """A run of exactly `steps` steps (a longer one's learning-rate schedule differs) that got to its end."""
    trained = [r["step"] for r in records if "loss" in r]
    return bool(trained) and max(trained) == steps


def train(folder: str, model: str, steps: int, balance: list[str], extra: list[str]) -> None:
    """One run of train.py into `folder` (made afresh), logging every step."""
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    python = [sys.executable, "train.py"]
    command = [*python, f"model={model}", f"tokens.train_steps={steps}", *balance,
               "logging.iteration_step_info_interval=1", "checkpoint.save_final_state=false",
               f"hydra.run.dir={folder}", *extra]
    print("running: train.py", " ".join(command[len(python):]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    rows = [(r["step"], r[key]) for r in records if key in r]
    return [s for s, _ in rows], [v for _, v in rows]


def running_mean(values: list[float], window: int = 10) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(runs: dict[str, list[dict]], out: str, model: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = next(iter(runs.values()))
    layers = sorted({int(k[len(IMBALANCE):]) for r in first for k in r if k.startswith(IMBALANCE)})
    keys = [(f"{IMBALANCE}{n}", f"load imbalance, layer {n} (max / mean)") for n in layers]
    keys.append(("moe_aux_loss", f"aux loss, summed over {len(layers)} MoE layers"))
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), constrained_layout=True)
    for ax, (key, title) in zip(axes, keys):
        for (label, records), color in zip(runs.items(), ("tab:blue", "tab:orange", "tab:green", "tab:red")):
            steps, values = series(records, key)
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(steps, running_mean(values), color=color, linewidth=1.8, label=label)
        floor = len(layers) if key == "moe_aux_loss" else 1.0
        ax.axhline(floor, color="gray", linestyle=":", linewidth=1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=9)
    fig.suptitle(f"{model}: {', '.join(runs)} (10-step running means; dotted: even load)", fontsize=10)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def report(runs: dict[str, list[dict]], steps: int) -> None:
    """The logged values at steps 1 and every third of the run, and each run's eval losses."""
    marks = sorted({1, *(round(steps * i / 3) for i in (1, 2, 3))})
    for label, records in runs.items():
        by_step = {r["step"]: r for r in records if "loss" in r}
        layers = sorted({k for r in records for k in r if k.startswith(IMBALANCE)})
        print(f"{label}:")
        for s in marks:
            r = by_step.get(s)
            if r:
                loads = " / ".join(f"{r[k]:.2f}" for k in layers)
                print(f"  step {s:>4}: loss {r['loss']:.4f}, aux {r['moe_aux_loss']:.3f}, imbalance {loads}")
        last = [by_step[s] for s in sorted(by_step) if s > steps - steps // 6]
        tail = ", ".join(f"{k[len(IMBALANCE):]}: {sum(r[k] for r in last) / len(last):.3f} (max "
                         f"{max(r[k] for r in last):.3f})" for k in layers) if last else "-"
        print(f"  imbalance by layer over steps {steps - steps // 6 + 1}-{steps}, mean (max): {tail}")
        evals = ", ".join(f"{r['eval_loss']:.4f} (step {r['step']})" for r in records if "eval_loss" in r)
        print(f"  eval loss: {evals or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps of each run")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "moe_balance.png"), help="the figure")
    parser.add_argument("--run-dir", default=os.path.join(ROOT, "outputs", "moe_balance"),
                        help="where the runs go (and are reused from)")
    parser.add_argument("--model", default="moe_tiny")
    parser.add_argument("--balances", default="aux_loss,none", help=f"comma-separated, of {', '.join(BALANCES)}")
    parser.add_argument("--rerun", action="store_true", help="run again even when a finished run is there")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    runs = {}
    for balance in args.balances.split(","):
        if balance not in BALANCES:
            parser.error(f"--balances: {balance} is not one of {', '.join(BALANCES)}")
        folder = os.path.abspath(os.path.join(args.run_dir, balance))
        if args.rerun or not finished(read_metrics(folder), args.steps):
            train(folder, args.model, args.steps, BALANCES[balance], args.overrides)
        else:
            print(f"reusing {folder}")
        runs[f"balance={balance}"] = [r for r in read_metrics(folder) if r["step"] <= args.steps]
    report(runs, args.steps)
    plot(runs, args.out, args.model)


if __name__ == "__main__":
    main()
