"""A refactor changes no number: the same short runs at an earlier commit and at this tree, their metrics.jsonl
compared value for value (losses, gradient norms, learning rates, held-out losses, MoE loads; not timings).

    python -m benchmarks.same_metrics --start f286b03 [--only dp1,tp2] [--steps 4]

The earlier commit runs from a `git worktree` of it in a temporary folder (removed afterwards). Each layout runs
`python train.py debug=fast <layout> tokens.train_steps=<steps>` in both trees, one after the other.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

from nanoexp.observe.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P = "parallelism"
LAYOUTS = {   # one of each kind of layout: every dimension, schedule, cp kernel and ZeRO stage
    "dp1": [],
    "dp2": [f"{P}.dp=2"],
    "tp2": [f"{P}.tp=2"],
    "tp2-sp": [f"{P}.tp=2", f"{P}.tp_mode=reduce_scatter"],
    "pp2-1f1b": [f"{P}.pp=2"],
    "pp2-interleaved": [f"{P}.pp=2", f"{P}.pp_engine=interleaved_1f1b", f"{P}.pp_virtual_stages=2"],
    "pp2-zb_h1": [f"{P}.pp=2", f"{P}.pp_engine=zb_h1"],
    "pp2-zbv": [f"{P}.pp=2", f"{P}.pp_engine=zbv", f"{P}.pp_virtual_stages=2"],
    "cp2-ring": [f"{P}.cp=2"],
    "cp2-all_gather": [f"{P}.cp=2", f"{P}.cp_mode=all_gather"],
    "dp2-zero1": [f"{P}.dp=2", "optimizer.zero_stage=1"],
    "dp2-zero3": [f"{P}.dp=2", "optimizer.zero_stage=3"],
    "moe-ep2": ["model=moe_tiny", f"{P}.dp=2", f"{P}.ep=2"],
}
TIMING = ("sec", "tokens_per_sec", "tflops", "mfu", "memory", "checkpoint/")   # keys that measure, not compute


def run(tree: str, name: str, steps: int, out: str) -> list[dict]:
    folder = os.path.join(out, name)
    cmd = [sys.executable, "train.py", "debug=fast", *LAYOUTS[name], f"tokens.train_steps={steps}",
           "checkpoint.save_final_state=false", f"hydra.run.dir={folder}"]
    done = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{name} in {tree}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return [{k: v for k, v in record.items() if not any(t in k for t in TIMING)} for record in read_metrics(folder)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--start", required=True, help="the commit to compare with")
    parser.add_argument("--only", help="comma-separated layout names (default: all)")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(LAYOUTS)
    scratch = tempfile.mkdtemp(prefix="same_metrics_")
    start = os.path.join(scratch, "start")
    subprocess.run(["git", "worktree", "add", "--detach", start, args.start], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        same = 0
        for name in names:
            before = run(start, name, args.steps, os.path.join(scratch, "before"))
            after = run(ROOT, name, args.steps, os.path.join(scratch, "after"))
            records = [r for r in before if len(r) > 1]
            identical = before == after
            same += identical
            print(f"{name:16} {'identical' if identical else 'DIFFERENT'} ({len(records)} records; last loss "
                  f"{[r['loss'] for r in before if 'loss' in r][-1]!r})", flush=True)
            if not identical:
                for b, a in zip(before, after):
                    if a != b:
                        print(f"    first difference: {b} vs {a}")
                        break
        print(f"{same}/{len(names)} layouts give identical metrics.jsonl against {args.start}")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", start], cwd=ROOT, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
