"""The µP coordinate check: do activations keep their size as the model widens?

    python benchmarks/mup_coord_check.py [--out DIR] [--widths 64 128 256 512] [--steps 6] [--seeds 2]

Trains each width (head dimension fixed at --head-dim, intermediate size 3 x width, µP's base width
the smallest) for a few Adam steps at a constant learning rate under both parametrizations, on the
built-in corpus, and records before each update the root mean square of each kind of activation:
the embedding output, the attention and MLP block outputs (averaged over layers) and the logits.
Under µP they should stay put as the width grows; under the standard parametrization the blocks'
outputs and the logits grow with the width (Yang et al. 2022, "Tensor Programs V", section 4).

Writes DIR/coord_check.csv (parametrization, width, step, activation, rms: the mean over seeds) and
DIR/coord_check.png (one row of panels per parametrization, one panel per activation, RMS against
width on log axes, one line per step), and prints each activation's RMS at the last step per width.
The defaults take about a minute on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

import torch

from nanoexp.config import compose
from nanoexp.data import build_datasets
from nanoexp.data.loader import TrainBatches
from nanoexp.runtime.build import build_model
from nanoexp.optim.schedule import set_lr
from nanoexp.runtime.optim import build_optimizer
from nanoexp.parallel.context import ParallelContext

ACTIVATIONS = ("embedding", "attention", "mlp", "logits")
TITLES = {"embedding": "embedding output", "attention": "attention output", "mlp": "MLP output", "logits": "logits"}
PARAMETRIZATIONS = ("standard", "mup")


def width_overrides(width: int, head_dim: int) -> list[str]:
    """A model `width` wide: heads of head_dim, as many KV heads as heads, an MLP three times as wide."""
    heads = width // head_dim
    m = "model.model_config."
    return [f"{m}hidden_size={width}", f"{m}num_attention_heads={heads}", f"{m}num_key_value_heads={heads}",
            f"{m}intermediate_size={3 * width}"]


def record_rms(model, sums: dict[str, list[float]]):
    """Forward hooks adding each block output's RMS to sums[activation]; returns the handles."""
    def hook(activation):
        return lambda module, inputs, output: sums[activation].append(output.detach().pow(2).mean().sqrt().item())

    handles = [model.model.embed_tokens.register_forward_hook(hook("embedding"))]
    for layer in model.model.layers.values():
        handles.append(layer.self_attn.register_forward_hook(hook("attention")))
        handles.append(layer.mlp.register_forward_hook(hook("mlp")))
    return handles


def train_and_measure(cfg, steps: int, lr: float) -> list[dict[str, float]]:
    """Per step: the RMS of each activation during the forward of that step's batch (step 1: at init)."""
    ctx = ParallelContext()
    torch.manual_seed(cfg.general.seed)
    model = build_model(cfg, ctx)
    optimizer = build_optimizer(cfg, model)
    train_set, _, _ = build_datasets(cfg)
    batches = TrainBatches(train_set, cfg.tokens.global_batch_size, cfg.tokens.global_batch_size, 0, 1,
                           cfg.general.seed, prefetch=False)
    sums: dict[str, list[float]] = {a: [] for a in ACTIVATIONS}
    handles = record_rms(model, sums)
    per_step = []
    for _ in range(steps):
        (batch,) = batches.next_step()
        logits = model(input_ids=batch["input_ids"])    # one process: the whole vocabulary
        sums["logits"].append(logits.detach().pow(2).mean().sqrt().item())
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        per_step.append({a: sum(values) / len(values) for a, values in sums.items()})
        for values in sums.values():
            values.clear()
        set_lr(optimizer, lr)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for handle in handles:
        handle.remove()
    batches.close()
    return per_step


def coord_check(widths: list[int], steps: int, lr: float, seeds: int, head_dim: int = 16, layers: int = 4,
                extra: list[str] = ()) -> list[dict]:
    """Rows {parametrization, width, step, activation, rms}, the RMS averaged over `seeds` seeds."""
    rows = []
    for parametrization in PARAMETRIZATIONS:
        for width in widths:
            runs = []
            for seed in range(seeds):
                cfg = compose(width_overrides(width, head_dim) + [
                    f"model.parametrization={parametrization}", f"model.mup.base_width={min(widths)}",
                    f"model.model_config.num_hidden_layers={layers}", f"general.seed={seed}",
                    "optimizer.clip_grad=null", "data.prefetch=false", *extra])
                runs.append(train_and_measure(cfg, steps, lr))
            for step in range(steps):
                for activation in ACTIVATIONS:
                    rms = sum(run[step][activation] for run in runs) / seeds
                    rows.append({"parametrization": parametrization, "width": width, "step": step + 1,
                                 "activation": activation, "rms": rms})
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted({r["step"] for r in rows})
    widths = sorted({r["width"] for r in rows})
    fig, axes = plt.subplots(len(PARAMETRIZATIONS), len(ACTIVATIONS), figsize=(14, 6.5), sharex=True, sharey="col")
    colours = plt.get_cmap("viridis")
    for row_axes, parametrization in zip(axes, PARAMETRIZATIONS):
        for ax, activation in zip(row_axes, ACTIVATIONS):
            for step in steps:
                rms = {r["width"]: r["rms"] for r in rows if (r["parametrization"], r["activation"], r["step"])
                       == (parametrization, activation, step)}
                ax.plot(widths, [rms[w] for w in widths], marker="o", markersize=3,
                        color=colours(step / (len(steps) + 1)), label=f"step {step}")
            ax.set(xscale="log", yscale="log", title=f"{parametrization}: {TITLES[activation]}")
            ax.set_xticks(widths, [str(w) for w in widths])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.grid(alpha=0.3)
        row_axes[0].set_ylabel("RMS of activations")
    for ax in axes[-1]:
        ax.set_xlabel("width (hidden size)")
    axes[0][-1].legend(fontsize="small", title="before update")
    fig.suptitle("Coordinate check: activation RMS against width (flat lines = width-independent, µP's promise)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="coord_check", help="folder for coord_check.png and coord_check.csv")
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--steps", type=int, default=6, help="Adam steps per run (the last one measured at step N)")
    parser.add_argument("--lr", type=float, default=1e-2, help="constant learning rate (µP: at the base width)")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("overrides", nargs="*", help="more train.py overrides (e.g. tokens.sequence_length=64)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = coord_check(args.widths, args.steps, args.lr, args.seeds, args.head_dim, args.layers,
                       ["tokens.sequence_length=64", "tokens.global_batch_size=16", *args.overrides])
    with open(os.path.join(args.out, "coord_check.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["parametrization", "width", "step", "activation", "rms"])
        writer.writeheader()
        writer.writerows(rows)
    last = max(r["step"] for r in rows)
    print(f"RMS at step {last} (after {last - 1} updates), by width:")
    print(f"{'parametrization':<16}{'activation':<11}" + "".join(f"{w:>9}" for w in args.widths) + "  largest/smallest")
    for parametrization in PARAMETRIZATIONS:
        for activation in ACTIVATIONS:
            rms = [r["rms"] for r in rows if (r["parametrization"], r["activation"], r["step"])
                   == (parametrization, activation, last)]
            print(f"{parametrization:<16}{activation:<11}" + "".join(f"{v:>9.3g}" for v in rms)
                  + f"  {rms[-1] / rms[0]:.2f}")
    try:
        plot(rows, os.path.join(args.out, "coord_check.png"))
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[plots]'): no plot", file=sys.stderr)
    print(f"wrote {os.path.join(args.out, 'coord_check.csv')} and coord_check.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
