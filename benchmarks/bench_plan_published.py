"""The cost model (nanoexp/plan/) against published training throughputs: every row predicted vs published, the
error, whether the row was one the global constants were fitted on, and where the published layout ranks among
the planner's layouts of the same GPU count (docs/planning.md).

    python benchmarks/bench_plan_published.py            # the table and the shares within +-15 %
    python benchmarks/bench_plan_published.py --ranks    # also each published layout's rank (minutes)
    python benchmarks/bench_plan_published.py --fit      # refit the constants on the fit rows and print them

No timing: the model is deterministic, so the table is the same on any machine.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a file: the repository root

from nanoexp.plan import comm, cost
from nanoexp.plan.published import ROWS, check, fit_constants, layout_rank, share_within

FIT_GRID = {"GEMM_EFFICIENCY": [round(0.40 + 0.02 * i, 2) for i in range(31)],
            "OVERLAP": [round(0.50 + 0.05 * i, 2) for i in range(11)],
            "ATTENTION_EFFICIENCY": [0.15, 0.20, 0.25, 0.30, 0.35, 0.40, 0.50]}


def fmt(value: float, metric: str) -> str:
    return f"{100 * value:.1f}% MFU" if metric == "mfu" else f"{value:,.0f} tok/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", action="store_true", help="rank each published layout among the planner's")
    parser.add_argument("--fit", action="store_true", help="refit the global constants on the fit rows")
    args = parser.parse_args()
    if args.fit:
        print("fitted:", fit_constants([r for r in ROWS if r.fit], FIT_GRID))
    print(f"constants: GEMM_EFFICIENCY {cost.GEMM_EFFICIENCY}, OVERLAP {comm.OVERLAP}, ATTENTION_EFFICIENCY "
          f"{cost.ATTENTION_EFFICIENCY} (fitted); GEMM_KNEE {cost.GEMM_KNEE}, FUSED_ATTENTION {cost.FUSED_ATTENTION}, "
          f"LINK_EFFICIENCY {comm.LINK_EFFICIENCY} (stated)")
    print(f"| row | source | published | predicted | error | set | rank | nanoexp |\n|{'---|' * 8}")
    results = []
    for row in ROWS:
        result = check(row)
        results.append(result)
        rank = "-"
        if args.ranks:
            position, total, faster = layout_rank(row)
            rank = f"{position} of {total}" + (f" (after {', '.join(faster)})" if 1 < position <= 8 else "")
        runs = "runs" if result["problem"] is None else f"refused: {result['problem'][:60]}"
        print(f"| {row.name} | {row.source.split(' ')[0]} `{row.source.split(' ')[1]}` | {fmt(row.value, row.metric)} "
              f"| {fmt(result['predicted'], row.metric)} | {100 * result['error']:+.1f}% | "
              f"{'fit' if row.fit else 'held out'} | {rank} | {runs} |", flush=True)
    for name, chosen in (("all", results), ("fit", [r for r in results if r["row"].fit]),
                         ("held out", [r for r in results if not r["row"].fit])):
        share = share_within([r["error"] for r in chosen])
        print(f"{name}: {sum(abs(r['error']) <= 0.15 for r in chosen)} of {len(chosen)} rows within +-15 % "
              f"({100 * share:.0f} %)")


if __name__ == "__main__":
    main()
