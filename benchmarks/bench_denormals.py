"""Denormals: a run's tokens/s as it trains, with model.flush_denormals on (the default on a CPU) and off.

    python benchmarks/bench_denormals.py                       # model=small, 50 steps, 2 rounds
    python benchmarks/bench_denormals.py --steps 50 --rounds 3 model.dtype=bfloat16

Each case is a fresh `python train.py model=small tokens.train_steps=S logging.iteration_step_info_interval=1`
(everything else default); the two cases run in turns, reversed every other round, so background load hits them
alike. Reported per case: the step's own tokens/s (metrics.jsonl) at steps 5, 25 and S (the median over rounds),
the loss at those steps (flushing must not change it beyond float32 noise) and summary.json's mean tokens/s. A CPU
that computes denormals slowly shows the unflushed run slowing down as it trains; how slowly this one does is
printed first (a multiply of 2^20 denormals against one of normal numbers, one thread, flushing off). The
machine's float32 matmul peak and load are printed before and after, to show how busy it was. The comparison with a plain Hugging Face loop
timed from outside is `benchmarks/bench.py --wall` (with `model.flush_denormals=false` for the other case).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a file: the repository root
from benchmarks.harness import in_turns, matmul_peak
from nanoexp.observe.metrics import read_metrics
from nanoexp.observe.peak import cpu_model

CASES = {"flushed (default)": [], "not flushed": ["model.flush_denormals=false"]}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_case(model: str, steps: int, overrides: list[str], folder: str) -> dict:
    """One fresh run: each step's tokens/s and loss, and summary.json's mean tokens/s."""
    command = [sys.executable, os.path.join(ROOT, "train.py"), f"model={model}", f"tokens.train_steps={steps}",
               "logging.iteration_step_info_interval=1", f"hydra.run.dir={folder}", *overrides]
    subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
    records = read_metrics(folder)
    with open(os.path.join(folder, "summary.json")) as f:
        summary = json.load(f)
    steps_seen = {r["step"]: r for r in records if "loss" in r}
    return {"tokens_per_sec": {s: r["tokens_per_sec"] for s, r in steps_seen.items()},
            "loss": {s: r["loss"] for s, r in steps_seen.items()}, "mean": summary["tokens_per_sec"],
            "flushed": summary.get("denormals_flushed")}


def denormal_penalty() -> str:
    """How much slower this CPU multiplies denormals than normal numbers (one thread, best of 20, flushing off)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times = {}
    for name, value in (("normal", 1e-3), ("denormal", 1e-39)):
        x = torch.full((1 << 20,), value)
        best = float("inf")
        for _ in range(20):
            start = time.perf_counter()
            x * 0.5
            best = min(best, time.perf_counter() - start)
        times[name] = best
    torch.set_num_threads(threads)
    return (f"2^20 multiplies: {times['normal'] * 1e3:.3f} ms on normal numbers, {times['denormal'] * 1e3:.3f} ms on "
            f"denormals ({times['denormal'] / times['normal']:.1f}x)")


def machine(when: str) -> str:
    return f"{when}: float32 matmul peak {matmul_peak().tflops * 1e3:.0f} GFLOP/s, load {os.getloadavg()[0]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for both cases")
    args = parser.parse_args()
    shown = sorted({5, 25, args.steps} & set(range(1, args.steps + 1)))
    print(f"{cpu_model()}, {os.cpu_count()} cores; {denormal_penalty()}; {machine('before')}", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in CASES}
    for i, name in in_turns(list(CASES), args.rounds):
        with tempfile.TemporaryDirectory() as folder:
            runs[name].append(run_case(args.model, args.steps, CASES[name] + args.overrides, folder))
        r = runs[name][-1]
        print(f"round {i} {name} (summary says flushed={r['flushed']}): "
              + ", ".join(f"step {s} {r['tokens_per_sec'][s]:,.0f} tok/s loss {r['loss'][s]:.4f}" for s in shown)
              + f"; mean {r['mean']:,.0f} tok/s", flush=True)
    print("| case | " + " | ".join(f"tokens/s at step {s}" for s in shown) + " | mean tokens/s | losses |")
    for name, results in runs.items():
        speeds = [statistics.median(r["tokens_per_sec"][s] for r in results) for s in shown]
        losses = "/".join(f"{results[0]['loss'][s]:.4f}" for s in shown)
        print(f"| {name} | " + " | ".join(f"{v:,.0f}" for v in speeds)
              + f" | {statistics.median(r['mean'] for r in results):,.0f} | {losses} |")
    print(machine("after"))


if __name__ == "__main__":
    main()
