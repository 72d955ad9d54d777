"""Measured peak memory per rank against the estimate, for a matrix of layouts and ZeRO stages.

    python scripts/bench_memory.py                              # model=small, the default matrix
    python scripts/bench_memory.py --steps 3 --csv memory.csv dp2tp1pp1:optimizer.zero_stage=1
    python scripts/bench_memory.py dp1cp2tp1pp1 dp2cp2tp1pp1:optimizer.zero_stage=1 dp1cp2tp2pp1   # context parallel

Each case is `python train.py model=small <case overrides>` for a few steps (its own run folder
in a temporary directory); per rank it prints the measured peak above the rank's runtime baseline
(summary.json: peak_memory_mb_per_rank - baseline_memory_mb), the estimate for that rank
(nanoexp/memory.py, the same as scripts/estimate_memory.py), and the analytic model-state bytes
(parameters + gradients + AdamW moments, 16 B a parameter without ZeRO). A case is
`layout[:override,override...]`. Every case runs with `logging.exact_cpu_memory=true` (glibc returns
freed memory, so the peak tracks the live tensors, which is what the estimate counts); add
`logging.exact_cpu_memory=false` to a case to see the default allocator's peak.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile

from nanoexp.config import compose
from nanoexp.memory import MB, estimate, total
from nanoexp.model.build import model_shape
from nanoexp.parallel.layout import Layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CASES = [
    "dp1tp1pp1", "dp1tp1pp1:parallelism.recompute_layer=true",
    "dp2tp1pp1:optimizer.zero_stage=0", "dp2tp1pp1:optimizer.zero_stage=1",
    "dp4tp1pp1:optimizer.zero_stage=0", "dp4tp1pp1:optimizer.zero_stage=1",
    "dp1tp2pp1", "dp1tp2pp1:parallelism.recompute_layer=true",
    "dp1tp1pp2:parallelism.pp_engine=afab", "dp1tp1pp2:parallelism.pp_engine=1f1b",
    "dp1tp1pp2:parallelism.pp_engine=1f1b,parallelism.recompute_layer=true",
]


def case_overrides(case: str, model: str, steps: int) -> list[str]:
    layout, _, extra = case.partition(":")
    return [f"model={model}", f"parallelism={layout}", f"tokens.train_steps={steps}", "tokens.val_check_interval=0",
            "tokens.limit_val_batches=1", "optimizer.learning_rate_scheduler.lr_warmup_steps=1",
            "checkpoint.save_final_state=false", "logging.tensorboard=false",
            *([] if "exact_cpu_memory" in extra else ["logging.exact_cpu_memory=true"]),
            *[o for o in extra.split(",") if o]]


def run_case(case: str, args) -> list[dict]:
    """One row per rank: measured peak above baseline, estimate, model-state bytes (MB)."""
    overrides = case_overrides(case, args.model, args.steps)
    with tempfile.TemporaryDirectory() as run_dir:
        result = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *overrides,
                                 f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=args.timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{case} failed:\n{result.stderr[-2000:]}")
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
    cfg, rows = compose(overrides), []
    shape, layout = model_shape(cfg), Layout.from_config(cfg)
    for rank, peak in enumerate(summary["peak_memory_mb_per_rank"]):
        parts = estimate(cfg, shape, layout.position(rank)[0])
        state = parts["parameters"] + parts["gradients"] + parts["optimizer"]
        rows.append({"case": case, "rank": rank, "measured_mb": peak - summary["baseline_memory_mb"],
                     "estimate_mb": total(parts) / MB, "model_state_mb": state / MB,
                     "activations_mb": parts["activations"] / MB, "baseline_mb": summary["baseline_memory_mb"]})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", default=DEFAULT_CASES)
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per case (the peak comes from step 2 on)")
    parser.add_argument("--csv", help="also write the rows here")
    parser.add_argument("--timeout", type=float, default=1200)
    args = parser.parse_args(argv)
    columns = ["case", "rank", "measured_mb", "estimate_mb", "model_state_mb", "activations_mb", "baseline_mb"]
    print(f"{'case':<62}{'rank':>5}{'measured':>10}{'estimate':>10}{'est/meas':>9}{'state':>8}{'activ':>8}{'base':>7}"
          "  (MB above the runtime baseline)")
    rows = []
    for case in args.cases:
        for row in run_case(case, args):
            rows.append(row)
            print(f"{row['case']:<62}{row['rank']:>5}{row['measured_mb']:>10.0f}{row['estimate_mb']:>10.0f}"
                  f"{row['estimate_mb'] / row['measured_mb']:>9.2f}{row['model_state_mb']:>8.0f}"
                  f"{row['activations_mb']:>8.0f}{row['baseline_mb']:>7.0f}", flush=True)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
