"""What the health checks (nanoexp/health/, docs/health.md) cost and how soon they find their fault.

    python benchmarks/bench_health.py                         # model=small dp2: overhead, then detection
    python benchmarks/bench_health.py --part overhead --steps 30 --rounds 3
    python benchmarks/bench_health.py --part detection
    python benchmarks/bench_health.py --part calls            # the straggler wrapper's cost per collective call

Overhead: each case is a fresh `python train.py model=small parallelism=dp2tp1pp1`, the cases in turns (reversed every
other round, so background load hits them alike); the figure is summary.json's tokens/s (the mean step after the
first two) as a fraction of the "off" case's mean. Detection: each detector's fault (nanoexp/launch/fault_injection.py)
on the same run (FAULTS); the step of the finding, counted from the fault's first step, and the training seconds
from that step until then (the steps' step_time_sec summed).
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
from benchmarks.harness import in_turns, matmul_peak  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["model=small", "parallelism=dp2tp1pp1", "tokens.val_check_interval=0", "checkpoint.save_final_state=false",
       "logging.iteration_step_info_interval=1"]
OFF = ["health.stragglers=false", "health.spike.action=off"]
CASES = {"off": OFF,
         "stragglers (every 10)": ["health.spike.action=off"],
         "spike warn": ["health.stragglers=false"],
         "defaults (stragglers + spike warn)": [],
         "replay every 10": OFF + ["health.replay_every=10"]}
# (the fault, the step it first strikes, the steps to train): the default keys but a spike window of 20 steps and a
# replay every 10; the slow rank sleeps 1 s in each of its 4 micro-batches' forwards, about doubling its compute.
FAULTS = {"straggler": (["fault_injection.slow_rank=1", "fault_injection.slow_rank_s=1.0"], 1, 30),
          "spike": (["fault_injection.spike_at_step=25", "health.spike.window=20"], 25, 25),
          "replay": (["health.replay_every=10", "fault_injection.flip_gradient_rank=1",
                      "fault_injection.flip_gradient_step=20", "health.replay_action=skip"], 20, 20)}


def train(overrides: list[str], steps: int, folder: str) -> list[dict]:
    command = [sys.executable, os.path.join(ROOT, "train.py"), *RUN, f"tokens.train_steps={steps}",
               f"hydra.run.dir={folder}", *overrides]
    subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def tokens_per_sec(folder: str) -> float:
    with open(os.path.join(folder, "summary.json")) as f:
        return json.load(f)["tokens_per_sec"]


def overhead(steps: int, rounds: int) -> None:
    speeds: dict[str, list[float]] = {name: [] for name in CASES}
    for i, name in in_turns(list(CASES), rounds):
        with tempfile.TemporaryDirectory() as folder:
            train(CASES[name], steps, folder)
            speeds[name].append(tokens_per_sec(folder))
        print(f"round {i} {name}: {speeds[name][-1]:,.0f} tokens/s", flush=True)
    base = statistics.mean(speeds["off"])
    print("| case | tokens/s | of off (min-max) |\n|---|---|---|")
    for name, values in speeds.items():
        print(f"| {name} | {statistics.mean(values):,.0f} | {statistics.mean(values) / base:.3f} "
              f"({min(values) / base:.3f}-{max(values) / base:.3f}) |", flush=True)


def detection() -> None:
    print("| detector | fault from step | named at step | steps | training seconds until then |\n|---|---|---|---|---|")
    for kind, (fault, start, steps) in FAULTS.items():
        with tempfile.TemporaryDirectory() as folder:
            records = train(fault, steps, folder)
        found = [r for r in records if r.get("health/event") == kind]
        if not found:
            print(f"| {kind} | {start} | not named in {steps} steps | | |", flush=True)
            continue
        step = found[0]["step"]
        seconds = sum(r["step_time_sec"] for r in records if "step_time_sec" in r and start <= r["step"] <= step)
        print(f"| {kind} | {start} | {step} | {step - start} | {seconds:.1f} |", flush=True)


def calls(repeats: int = 200_000) -> None:
    """What the straggler detector adds to each collective call: its wrapper around a call that does nothing, in a
    timed section (two host clock reads and a span kept) and outside one, against the bare call."""
    import time
    import torch
    from nanoexp.health.stragglers import ComputeClock

    clock = ComputeClock(torch.device("cpu"))
    bare = lambda: None  # noqa: E731
    wrapped = clock.timed(bare)

    def per_call(call) -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        return (time.perf_counter() - start) / repeats * 1e6

    base, outside = per_call(bare), per_call(wrapped)
    with clock.section():
        inside = per_call(wrapped)
    clock.read()
    print(f"a collective call: {outside - base:.2f} us more outside a timed section, {inside - base:.2f} us more "
          f"inside one ({repeats:,} calls of a no-op)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["overhead", "detection", "calls", "both"], default="both")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"float32 matmul peak before: {matmul_peak().tflops:.3f} TFLOP/s; load {os.getloadavg()[0]:.2f}", flush=True)
    if args.part in ("calls", "both"):
        calls()
    if args.part in ("overhead", "both"):
        overhead(args.steps, args.rounds)
    if args.part in ("detection", "both"):
        detection()
    print(f"float32 matmul peak after: {matmul_peak().tflops:.3f} TFLOP/s; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
