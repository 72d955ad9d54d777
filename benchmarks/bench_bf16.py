"""bf16 parity: how far each layout's bf16 losses are from one bf16 process's.

    python benchmarks/bench_bf16.py                       # every file in conf/parallelism/
    python benchmarks/bench_bf16.py dp2tp2pp2 dp2tp2pp1:parallelism.tp_mode=reduce_scatter \
        dp2tp1pp2:parallelism.pp_engine=interleaved_1f1b,parallelism.pp_virtual_stages=2 [--steps 8] [--set KEY=VALUE ...]

Each layout (a file of conf/parallelism/, optionally ":" and comma-separated overrides for it) trains
`--steps` optimizer steps with model.dtype=bfloat16 (bf16 autocast, float32 master weights and
gradients) through nanoexp.run, as `python train.py` would, on local forked gloo workers; so does the
reference, one process with the same seed, data and global batch. Reported per layout: the largest
relative difference |loss - reference| / reference over the steps, the first step's, and the wall time.
tests/test_bf16_parity.py holds a subset of layouts to 2e-3.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a file: the repository root

from nanoexp.config import CONF_DIR, compose  # noqa: E402
from nanoexp.observe.metrics import read_metrics  # noqa: E402


def train_losses(overrides: list[str]) -> list[float]:
    from nanoexp.run import run
    cfg = compose(overrides)
    with tempfile.TemporaryDirectory() as run_dir:
        run(cfg, run_dir)
        return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def main() -> None:
    layouts = sorted(name[:-5] for name in os.listdir(os.path.join(CONF_DIR, "parallelism")) if name.endswith(".yaml"))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("layouts", nargs="*", default=layouts, help="conf/parallelism file[:key=value,...]")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--set", nargs="*", default=[], help="Hydra overrides for every run (and the reference)")
    args = parser.parse_args()
    common = ["model.dtype=bfloat16", f"tokens.train_steps={args.steps}", "tokens.val_check_interval=0",
              f"optimizer.learning_rate_scheduler.lr_warmup_steps={min(2, args.steps)}",
              "logging.iteration_step_info_interval=1", "logging.tensorboard=false", "data.prefetch=false", *args.set]
    reference = train_losses(common + ["parallelism=dp1tp1pp1"])
    print(f"bf16, {args.steps} steps, reference one process: losses {reference[0]:.4f} -> {reference[-1]:.4f}",
          flush=True)
    names = {spec: spec.replace("parallelism.", "") for spec in args.layouts}   # shorter, still unambiguous
    width = max(len(name) for name in names.values())
    print(f"{'layout':<{width}} {'max rel diff':>12} {'step 1':>9} {'wall s':>7}")
    for spec in args.layouts:
        layout, _, extra = spec.partition(":")
        start = time.perf_counter()
        losses = train_losses(common + [f"parallelism={layout}", *[o for o in extra.split(",") if o]])
        assert len(losses) == len(reference) == args.steps, (len(losses), len(reference))
        rel = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
        print(f"{names[spec]:<{width}} {max(rel):>12.1e} {rel[0]:>9.1e} {time.perf_counter() - start:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
