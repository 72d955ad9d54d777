"""How long scripts/plan.py takes to answer, and what it answers, for the GPU counts it exists for (issue 63).

    python benchmarks/bench_plan_speed.py                          # wall time of every TIMED case
    python benchmarks/bench_plan_speed.py --only 8b-4096 70b-4096  # some of them
    python benchmarks/bench_plan_speed.py --answers answers.json    # also every ANSWERS case's top 10, kept in a file
    python benchmarks/bench_plan_speed.py --compare answers.json   # the ANSWERS again, compared with the file's
    python benchmarks/bench_plan_speed.py --host                   # the host's ops and their cost (cost.py's)

Each case runs `python scripts/plan.py <case> --json` in a fresh process (what a user waits for: imports and
composing included) and prints its wall and CPU time (the process's user and system seconds: what other load
changes least) and the number of layouts it returned. --answers keeps each case's
JSON; --compare runs the same cases and says, row by row, whether the layout, schedule, ZeRO stage, micro-batch,
recomputation, tokens/s and memory are the same (the rankings of two versions of the planner, or of two machines:
the model is deterministic). --host counts the ops eager PyTorch issues for a decoder block's forward and
backward (bf16 autocast) and for a step's clipping, foreach AdamW and zero_grad, with a TorchDispatchMode on
model=tiny, and times a small op's dispatch on this CPU: cost.OPS_FORWARD, OPS_BACKWARD, FIXED_STEP_OPS and
hardware.Hardware.launch_us come from it. Times depend on the machine and its load: say both with them.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = ["--gpu", "h100", "--gpus-per-node", "8", "--seq", "8192"]


def case(model: str, gpus: int, batch_tokens: int, *extra: str) -> list[str]:
    return [f"model={model}", "--gpus", str(gpus), *H100, "--global-batch-tokens", str(batch_tokens), *extra]


TIMED = {   # Llama 3 8B and 70B at 8, 512 and 4,096 GPUs (1M, 4M and 16M tokens a step), the default --top 5
    "8b-8": case("llama3_8b", 8, 2 ** 20),
    "8b-512": case("llama3_8b", 512, 2 ** 22),
    "8b-4096": case("llama3_8b", 4096, 2 ** 24),
    "70b-8": case("llama3_70b", 8, 2 ** 20),
    "70b-512": case("llama3_70b", 512, 2 ** 22),
    "70b-4096": case("llama3_70b", 4096, 2 ** 24),
    "8b-64-all": case("llama3_8b", 64, 2 ** 20, "--top", "100000"),   # every layout that fits
}
SMALL = ["--gpu", "h100", "--gpus-per-node", "8"]
ANSWERS = {   # the top 10 of each, compared before and after a change to the planner
    "8b-8": case("llama3_8b", 8, 2 ** 20, "--top", "10"),
    "8b-64": case("llama3_8b", 64, 2 ** 20, "--top", "10"),
    "8b-512": case("llama3_8b", 512, 2 ** 22, "--top", "10"),
    "70b-512": case("llama3_70b", 512, 2 ** 22, "--top", "10"),
    "tiny-8": ["model=tiny", "--gpus", "8", *SMALL, "--top", "10"],
    "small-16": ["model=small", "--gpus", "16", *SMALL, "--seq", "2048", "--global-batch-tokens", "262144",
                 "--top", "10"],
    "moe_tiny-8": ["model=moe_tiny", "--gpus", "8", *SMALL, "--top", "10"],
    "1b-32-a100": ["model=llama_1b", "--gpus", "32", "--gpu", "a100", "--gpus-per-node", "8", "--seq", "4096",
                   "--global-batch-tokens", "1048576", "--top", "10"],
}
SAME = ("layout", "zero_stage", "schedule", "virtual_stages", "micro_batch", "recompute")
CLOSE = ("tokens_per_s_per_gpu", "memory_gib")


def figure(row: dict, key: str) -> float:
    return row[key] if key in row else row["memory_gb"]   # memory_gib was memory_gb before issue 63


def run(argv: list[str]) -> tuple[float, float, list[dict]]:
    """(wall seconds, CPU seconds, the rows) of scripts/plan.py --json with these arguments. The CPU seconds (user
    and system, of the process) are what other load on the machine changes least."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plan.py"), *argv, "--json"], env=env,
                         capture_output=True, text=True, check=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return time.perf_counter() - start, cpu, json.loads(out)


def differences(before: list[dict], after: list[dict]) -> list[str]:
    """What differs between two answers, one line a row (empty: the same ranking, figures equal to 1e-9)."""
    lines = [f"{len(before)} rows before, {len(after)} after"] if len(before) != len(after) else []
    for i, (b, a) in enumerate(zip(before, after), 1):
        same = [k for k in SAME if b[k] != a[k]]
        close = [k for k in CLOSE if abs(figure(b, k) - figure(a, k)) > 1e-9 * abs(figure(b, k))]
        if same or close:
            lines.append(f"row {i}: " + ", ".join(f"{k} {figure(b, k)} -> {figure(a, k)}" for k in same + close))
    return lines


def host_ops() -> dict[str, float]:
    """{forward, backward: ops of model=tiny's block 0 under bf16 autocast; step: ops of clip_grad_norm_, foreach
    AdamW and zero_grad of its parameters; dispatch_us: the best mean of an add_ on a small CPU tensor}."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from nanoexp.config import compose, normalize
    from nanoexp.model.attention import Causal
    from nanoexp.model.llama import DecoderLayer, LlamaBody, rotary_tables
    from nanoexp.model.shape import model_shape

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    cfg = compose(["model=tiny"])
    normalize(cfg)
    shape = model_shape(cfg)
    layer, x = DecoderLayer(shape, 0), torch.randn(2, 64, shape.hidden_size, requires_grad=True)
    cos, sin = rotary_tables(shape, 64, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16), Count() as forward:
        y = layer(x, cos, sin, Causal(0))
    with Count() as backward:
        y.float().sum().backward()
    params = list(LlamaBody(shape).parameters())
    optimizer = torch.optim.AdamW(params, foreach=True)
    for _ in range(2):   # the first step makes the state
        for p in params:
            p.grad = torch.randn_like(p)
        with Count() as step:
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    t, best = torch.ones(8), float("inf")
    for _ in range(20):
        start = time.perf_counter()
        for _ in range(1000):
            t.add_(1)
        best = min(best, (time.perf_counter() - start) / 1000)
    return {"forward": forward.n, "backward": backward.n, "step": step.n, "dispatch_us": best * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help=f"cases of {', '.join(TIMED)} (or of ANSWERS with --answers)")
    parser.add_argument("--answers", help="run the ANSWERS cases and write their rows to this JSON file")
    parser.add_argument("--compare", help="run the ANSWERS cases and compare their rows with this file's")
    parser.add_argument("--host", action="store_true", help="count the host's ops and time one (cost.py's figures)")
    args = parser.parse_args()
    if args.host:
        sys.path.insert(0, ROOT)
        print(host_ops())
        return
    if args.answers or args.compare:
        kept = json.load(open(args.compare)) if args.compare else {}
        found = {}
        for name, argv in ANSWERS.items():
            if args.only and name not in args.only:
                continue
            seconds, cpu, found[name] = run(argv)
            verdict = "" if not args.compare else "; ".join(differences(kept[name], found[name])) or "the same"
            print(f"{name:<12} {seconds:7.1f} s ({cpu:.1f} s CPU)  {len(found[name])} rows  {verdict}", flush=True)
        if args.answers:
            with open(args.answers, "w") as f:
                json.dump(found, f, indent=1)
        return
    for name, argv in TIMED.items():
        if args.only and name not in args.only:
            continue
        seconds, cpu, rows = run(argv)
        best = rows[0] if rows else {}
        print(f"{name:<10} {seconds:7.1f} s wall {cpu:7.1f} s CPU  {len(rows)} rows  best {best.get('layout')} "
              f"{best.get('tokens_per_s_per_gpu', 0):,.0f} tok/s/GPU   {' '.join(argv)}", flush=True)


if __name__ == "__main__":
    main()
