"""bench_gpu.sh's bookkeeping: one compact record per run in $OUT/results.json (the run folders stay outside $OUT,
where the lent machine's few returned files would be wasted on them), and the closing summary.

    python benchmarks/bench_gpu_results.py record RESULTS NAME RUN_DIR LOG EXIT_CODE STARTED_S ENDED_S
    python benchmarks/bench_gpu_results.py report RESULTS
"""
from __future__ import annotations

import json
import math
import os
import sys

LOG_TAIL_LINES = 15


def read_json_lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def record(results: str, name: str, run_dir: str, log: str, exit_code: str, started: str, ended: str) -> None:
    """Append the run's summary, its step losses, and the tail of its log (what explains a failure)."""
    summary_path = os.path.join(run_dir, "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else None
    steps = [r for r in read_json_lines(os.path.join(run_dir, "metrics.jsonl")) if "loss" in r]
    tail = open(log, errors="replace").read().splitlines()[-LOG_TAIL_LINES:] if os.path.exists(log) else []
    entry = {"name": name, "exit_code": int(exit_code), "started_s": int(started), "ended_s": int(ended),
             "killed_at_limit": int(exit_code) == 137, "losses": [r["loss"] for r in steps],
             "last_step": {k: steps[-1].get(k) for k in ("step", "tokens_per_sec", "mfu", "model_tflops_per_sec",
                                                         "step_time_sec", "peak_memory_mb")} if steps else None,
             "summary": {k: summary.get(k) for k in ("status", "tokens_per_sec", "mfu", "peak_tflops", "peak_source",
                                                     "peak_memory_mb", "final_loss", "error")} if summary else None,
             "log_tail": tail}
    entries = json.load(open(results)) if os.path.exists(results) else []
    entries.append(entry)
    with open(results + ".tmp", "w") as f:
        json.dump(entries, f, indent=1)
    os.replace(results + ".tmp", results)


def report(results: str) -> int:
    """One line a run, the smoke test's verdict; exit 1 when the smoke test failed."""
    entries = json.load(open(results)) if os.path.exists(results) else []
    ok = True
    for e in entries:
        s = e["summary"] or {}
        speed = f"{s['tokens_per_sec']:,.0f} tokens/s" if s.get("tokens_per_sec") else "no speed"
        mfu = f"MFU {100 * s['mfu']:.1f}% of {s['peak_tflops']:.4g} TFLOP/s" if s.get("mfu") else "no MFU"
        memory = f"peak {s['peak_memory_mb'] / 1024:.1f} GiB" if s.get("peak_memory_mb") else ""
        ending = "killed at its limit" if e["killed_at_limit"] else f"exit {e['exit_code']}"
        print(f"{e['name']}: {s.get('status', 'no summary')} ({ending}, {e['started_s']}-{e['ended_s']} s), {speed}, "
              f"{mfu}, {memory}, final loss {s.get('final_loss')}")
        if e["name"] == "smoke":
            losses = e["losses"]
            ok = bool(losses) and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
            print(f"smoke: loss {losses[0] if losses else None} -> {losses[-1] if losses else None}:",
                  "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "record":
        record(*args)
    else:
        sys.exit(report(*args))
