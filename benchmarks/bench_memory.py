"""Measured peak memory per rank against the estimate, for a matrix of layouts and ZeRO stages.

    python benchmarks/bench_memory.py                              # model=small, the default matrix
    python benchmarks/bench_memory.py --steps 3 --csv memory.csv dp2tp1pp1:optimizer.zero_stage=1
    python benchmarks/bench_memory.py dp1cp2tp1pp1 dp2cp2tp1pp1:optimizer.zero_stage=1 dp1cp2tp2pp1   # context parallel
    python benchmarks/bench_memory.py dp{2,4}tp1pp1:optimizer.zero_stage={0,1,2,3}   # ZeRO 0-3, dp 2 and 4 (8 cases)

Each case is `python train.py model=small <case overrides>` for a few steps (its own run folder
in a temporary directory); per rank it prints the measured peak above the rank's runtime baseline
(summary.json: peak_memory_mb_per_rank - baseline_memory_mb), the estimate for that rank
(nanoexp/observe/memory_estimate.py, the same as scripts/estimate_memory.py), the model state the estimate counts
(parameters + gradients + AdamW moments), the analytic model state of the ZeRO stage (N parameters held,
d = dp x cp: 16N without ZeRO, 8N + 8N/d with ZeRO-1, 4N + 12N/d with ZeRO-2, 16N/d with ZeRO-3 plus its
gathered units, the layer computing and zero3_prefetch layers ahead) and the estimated activations and
ZeRO-2/3 units in flight. A case is `layout[:override,override...]`. Every case runs with `logging.exact_cpu_memory=true` (glibc returns
freed memory, so the peak tracks the live tensors, which is what the estimate counts); add
`logging.exact_cpu_memory=false` to a case to see the default allocator's peak.

When a case with ZeRO-1, 2 or 3 has a ZeRO-0 case of the same layout and other overrides in the same command, a
second table gives, per rank, what the stage saves against ZeRO-0: measured (the difference of the peaks), the
analytic saving (of the model state above) and the estimate's, and measured / analytic (the bar: >= 0.8).
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
from nanoexp.observe.memory_estimate import MB, estimate, held_modules, held_parameters, most_consecutive, total
from nanoexp.model.shape import model_shape
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
ZERO = "optimizer.zero_stage="


def case_overrides(case: str, model: str, steps: int) -> list[str]:
    layout, _, extra = case.partition(":")
    return [f"model={model}", f"parallelism={layout}", f"tokens.train_steps={steps}", "tokens.val_check_interval=0",
            "tokens.limit_val_batches=1", "optimizer.learning_rate_scheduler.lr_warmup_steps=1",
            "checkpoint.save_final_state=false", "logging.tensorboard=false",
            *([] if "exact_cpu_memory" in extra else ["logging.exact_cpu_memory=true"]),
            *[o for o in extra.split(",") if o]]


def analytic_model_state(stage: int, params: int, d: int, gathered: int = 0) -> float:
    """Bytes of parameters, gradients and AdamW moments per rank of ZeRO `stage` over d ranks, N = `params`
    (float32): 16N, 8N + 8N/d, 4N + 12N/d, 16N/d plus ZeRO-3's `gathered` parameters in flight."""
    sharded_bytes = {0: 0, 1: 8, 2: 12, 3: 16}[stage]   # of the 16 B a parameter, those split over the d ranks
    return params * ((16 - sharded_bytes) + sharded_bytes / d) + 4 * gathered * (stage == 3)


def gathered_units(cfg, shape, layout: Layout, pp_rank: int) -> int:
    """ZeRO-3's parameters whole at once: the unit computing and the `zero3_prefetch` units after it."""
    sizes = [module.sharded for module in held_modules(shape, layout, pp_rank)]
    return most_consecutive(sizes, 1 + cfg.optimizer.zero3_prefetch)


def same_run_but_zero(case: str) -> tuple:
    """What identifies a case apart from its ZeRO stage: its layout and its other overrides."""
    layout, _, extra = case.partition(":")
    return layout, tuple(sorted(o for o in extra.split(",") if o and not o.startswith(ZERO)))


def run_case(case: str, args) -> list[dict]:
    """One row per rank: measured peak above baseline, estimate, model state estimated and analytic (MB)."""
    overrides = case_overrides(case, args.model, args.steps)
    with tempfile.TemporaryDirectory() as run_dir:
        result = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *overrides,
                                 f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=args.timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{case} failed:\n{result.stderr[-2000:]}")
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
    cfg, rows = compose(overrides), []
    shape, layout, stage = model_shape(cfg), Layout.from_config(cfg), int(cfg.optimizer.zero_stage)
    for rank, peak in enumerate(summary["peak_memory_mb_per_rank"]):
        pp_rank = layout.position(rank)[0]
        parts, (params, _) = estimate(cfg, shape, pp_rank), held_parameters(shape, layout, pp_rank)
        state = parts["parameters"] + parts["gradients"] + parts["optimizer"]
        rows.append({"case": case, "rank": rank, "zero_stage": stage,
                     "measured_mb": peak - summary["baseline_memory_mb"], "estimate_mb": total(parts) / MB,
                     "model_state_mb": state / MB,
                     "analytic_state_mb": analytic_model_state(stage, params, layout.shard_size,
                                                               gathered_units(cfg, shape, layout, pp_rank)) / MB,
                     "activations_mb": parts["activations"] / MB, "in_flight_mb": parts["in_flight"] / MB,
                     "baseline_mb": summary["baseline_memory_mb"]})
    return rows


def savings(rows: list[dict]) -> list[dict]:
    """Per rank of each ZeRO-1/2/3 case with a ZeRO-0 twin among `rows`: what the stage saves against it."""
    zero0 = {(same_run_but_zero(r["case"]), r["rank"]): r for r in rows if r["zero_stage"] == 0}
    result = []
    for row in rows:
        twin = zero0.get((same_run_but_zero(row["case"]), row["rank"]))
        if row["zero_stage"] == 0 or twin is None:
            continue
        measured = twin["measured_mb"] - row["measured_mb"]
        analytic = twin["analytic_state_mb"] - row["analytic_state_mb"]
        result.append({"case": row["case"], "rank": row["rank"], "measured_saving_mb": measured,
                       "analytic_saving_mb": analytic, "estimated_saving_mb": twin["estimate_mb"] - row["estimate_mb"],
                       "measured_over_analytic": measured / analytic if analytic else float("nan")})
    return result


def print_savings(rows: list[dict]) -> None:
    print(f"\n{'saving against ZeRO-0 of the same case':<62}{'rank':>5}{'measured':>10}{'analytic':>10}{'estimate':>10}"
          f"{'meas/analytic':>15}  (MB; the bar: measured >= 0.8 x analytic)")
    for s in rows:
        verdict = "ok" if s["measured_over_analytic"] >= 0.8 else "BELOW 0.8"
        print(f"{s['case']:<62}{s['rank']:>5}{s['measured_saving_mb']:>10.0f}{s['analytic_saving_mb']:>10.0f}"
              f"{s['estimated_saving_mb']:>10.0f}{s['measured_over_analytic']:>15.2f}  {verdict}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="ZeRO 0-3 at dp 2 and 4: python benchmarks/bench_memory.py "
                                            "dp{2,4}tp1pp1:optimizer.zero_stage={0,1,2,3}")
    parser.add_argument("cases", nargs="*", default=DEFAULT_CASES)
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per case (the peak comes from step 2 on)")
    parser.add_argument("--csv", help="also write the rows here")
    parser.add_argument("--timeout", type=float, default=1200)
    args = parser.parse_args(argv)
    columns = ["case", "rank", "zero_stage", "measured_mb", "estimate_mb", "model_state_mb", "analytic_state_mb",
               "activations_mb", "in_flight_mb", "baseline_mb"]
    print(f"{'case':<62}{'rank':>5}{'measured':>10}{'estimate':>10}{'est/meas':>9}{'state':>8}{'analytic':>9}"
          f"{'activ':>8}{'units':>7}{'base':>7}  (MB above the runtime baseline; units: ZeRO-2/3's in flight)")
    rows = []
    for case in args.cases:
        for row in run_case(case, args):
            rows.append(row)
            print(f"{row['case']:<62}{row['rank']:>5}{row['measured_mb']:>10.0f}{row['estimate_mb']:>10.0f}"
                  f"{row['estimate_mb'] / row['measured_mb']:>9.2f}{row['model_state_mb']:>8.0f}"
                  f"{row['analytic_state_mb']:>9.0f}{row['activations_mb']:>8.0f}{row['in_flight_mb']:>7.0f}"
                  f"{row['baseline_mb']:>7.0f}", flush=True)
    saved = savings(rows)
    if saved:
        print_savings(saved)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
