"""A run's start-up on this CPU: torch._scaled_mm's rate against float32's, how long `python train.py` takes to its
first step and how fast it then trains, and how soon a stop signal sent during the start-up ends it.

    python benchmarks/bench_startup.py                                   # debug=fast model.fp8.enabled=true
    python benchmarks/bench_startup.py --root /path/to/another/checkout  # the same, with that checkout's code
    python benchmarks/bench_startup.py --rounds 3 parallelism=dp2tp1pp1

Start-up: from starting the process to the `peak for MFU` line (the last fact before step 1; imports, config,
peak measurement, model) and to step 1's line; tokens/s: summary.json's mean. Signals: SIGINT and SIGTERM sent
`--signal-after` seconds into the same command: the exit code and the seconds to exit. Medians of `--rounds`.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

from nanoexp.observe.peak import cpu_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def product_rates(size: int, repeats: int = 5) -> dict[str, float]:
    """GFLOP/s of one size² product in float32 and in e4m3 through torch._scaled_mm (the best of `repeats`)."""
    a = torch.linspace(-1.0, 1.0, size * size).reshape(size, size)
    one = torch.ones(())
    fp8 = a.to(torch.float8_e4m3fn)
    products = {"float32": lambda: torch.mm(a, a),
                "_scaled_mm e4m3": lambda: torch._scaled_mm(fp8, fp8.t().contiguous().t(), scale_a=one, scale_b=one,
                                                            out_dtype=torch.float32)}
    rates = {}
    for name, product in products.items():
        product()
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            product()
            seconds.append(time.perf_counter() - start)
        rates[name] = 2 * size ** 3 / min(seconds) / 1e9
    return rates


def start_up(root: str, overrides: list[str], folder: str, timeout_s: float) -> dict:
    """One run: seconds to the facts' last line and to step 1, and summary.json's tokens/s; a run still going
    after `timeout_s` is killed and reported as such (a start-up that measures slow FP8 products for minutes)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "train.py", *overrides, f"hydra.run.dir={folder}"], cwd=root,
                            env=dict(os.environ, PYTHONPATH=root), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    killer = threading.Timer(timeout_s, os.killpg, (proc.pid, signal.SIGKILL))
    killer.start()
    seen = {}
    for line in proc.stdout:
        for key, needle in (("facts", "peak for MFU"), ("step 1", "step 1/")):
            if needle in line and key not in seen:
                seen[key] = time.perf_counter() - start
    proc.wait()
    killer.cancel()
    if proc.returncode != 0:
        return {**seen, "killed after": timeout_s}
    with open(os.path.join(folder, "summary.json")) as f:
        return {**seen, "tokens/s": json.load(f)["tokens_per_sec"], "wall": time.perf_counter() - start}


def stopped(root: str, overrides: list[str], folder: str, signum: int, after_s: float) -> tuple[int, float]:
    proc = subprocess.Popen([sys.executable, "train.py", *overrides, f"hydra.run.dir={folder}"], cwd=root,
                            env=dict(os.environ, PYTHONPATH=root), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    time.sleep(after_s)
    sent = time.perf_counter()
    proc.send_signal(signum)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode, time.perf_counter() - sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=ROOT, help="the checkout whose train.py runs")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--signal-after", type=float, default=3.0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take before it is killed")
    parser.add_argument("overrides", nargs="*", default=["debug=fast", "model.fp8.enabled=true"])
    args = parser.parse_args()
    print(f"{cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}")
    for size in (64, 256):   # _scaled_mm can run at 0.03 GFLOP/s on a CPU: 2048² would take minutes
        print(f"{size}²: " + ", ".join(f"{name} {rate:.3g} GFLOP/s" for name, rate in product_rates(size).items()))
    print(f"{args.root}: python train.py {' '.join(args.overrides)}", flush=True)
    runs = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory() as folder:
            runs.append(start_up(args.root, args.overrides, folder, args.timeout))
        print(f"round {i}: " + ", ".join(f"{k} {v:,.1f}" for k, v in runs[-1].items()), flush=True)
    keys = dict.fromkeys(k for r in runs for k in r)
    print("medians: " + ", ".join(f"{k} {statistics.median(r[k] for r in runs if k in r):,.1f}" for k in keys))
    for signum in (signal.SIGINT, signal.SIGTERM):
        for i in range(args.rounds):
            with tempfile.TemporaryDirectory() as folder:
                code, seconds = stopped(args.root, args.overrides, folder, signum, args.signal_after)
            code_text = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            print(f"{signal.Signals(signum).name} {args.signal_after:g} s in: {code_text}, {seconds:.2f} s to exit",
                  flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
