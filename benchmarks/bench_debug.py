"""What hang diagnosis costs a run: the flight recorder with the stall watchdog (the default), and
`debug.collectives=check`, each against the same run with both off, on the same layout.

    python benchmarks/bench_debug.py                                     # the default run and dp2tp2pp2
    python benchmarks/bench_debug.py --layouts dp2tp2pp2 --steps 30 --rounds 3

Each case is a fresh `python train.py` (torch reads the recorder's and the check's settings when a process starts
its groups); the cases of a layout run in turns, reversed every other round, so background load hits them alike.
The figure is summary.json's tokens/s (the mean step after the first two), as a fraction of the same layout's
"off" mean; the machine's float32 matmul peak is measured before and after, to show how busy it was.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a file: the repository root
from benchmarks.harness import in_turns, matmul_peak

CASES = {"off": ["debug.stall_s=0", "debug.flight_recorder_entries=0"],
         "recorder + watchdog (default)": [],
         "collectives=check": ["debug.collectives=check"]}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_case(layout: str, overrides: list[str], steps: int, folder: str) -> float:
    command = [sys.executable, os.path.join(ROOT, "train.py"), f"parallelism={layout}", f"tokens.train_steps={steps}",
               "tokens.val_check_interval=0", "checkpoint.save_final_state=false", f"hydra.run.dir={folder}",
               *overrides]
    subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
    with open(os.path.join(folder, "summary.json")) as f:
        return json.load(f)["tokens_per_sec"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=["dp1tp1pp1", "dp2tp2pp2"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    peak_before = matmul_peak().tflops
    print(f"float32 matmul peak before: {peak_before:.3f} TFLOP/s; load {os.getloadavg()[0]:.2f}", flush=True)
    for layout in args.layouts:
        speeds: dict[str, list[float]] = {name: [] for name in CASES}
        for i, name in in_turns(list(CASES), args.rounds):
            with tempfile.TemporaryDirectory() as folder:
                speeds[name].append(run_case(layout, CASES[name], args.steps, folder))
            print(f"{layout} round {i} {name}: {speeds[name][-1]:,.0f} tokens/s", flush=True)
        base = statistics.mean(speeds["off"])
        for name, values in speeds.items():
            spread = f"{min(values) / base:.3f}–{max(values) / base:.3f}"
            print(f"| {layout} | {name} | {statistics.mean(values):,.0f} | {statistics.mean(values) / base:.3f} "
                  f"({spread}) |", flush=True)
    print(f"float32 matmul peak after: {matmul_peak().tflops:.3f} TFLOP/s; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
