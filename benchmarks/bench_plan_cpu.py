"""The performance model (nanoexp/plan/) against this CPU: predicted vs measured step time and per-rank memory of
`model=small` on local gloo processes (issue 53, item 4b; results in docs/planning.md, "This CPU").

    python -m benchmarks.bench_plan_cpu --calibrate --json runs.json [--append] [--idle] [--only dp1,tp2] [--batch 16]
    python -m benchmarks.bench_plan_cpu --calibrate --measured runs.json       # predict again, run nothing

Each layout runs `python train.py model=small <layout> ...` (checkpoints off, one held-out batch at the end,
logging.exact_cpu_memory=true so that the peak RSS tracks the live tensors: nanoexp/instruments/memory.py). Its step
time is the shortest `step_time_sec` of metrics.jsonl after step 1 (warm-up; the shortest, as load only adds);
its load-free step that less the share of the ranks' lifetime their busiest thread sat runnable waiting for a
core (/proc schedstat, sampled during the run): the machine is shared. Its memory is the largest
`peak_memory_mb_per_rank` of summary.json. The prediction is nanoexp.plan.cost.predict on the "cpu" device
(hardware.calibrate_cpu: the peak and gloo measured now, the overheads and runtime stored), whose cores the run's
processes share (hardware.per_rank). Predicted memory is the plan's estimate plus the device's runtime a process
(Python, torch, the warmed-up runtime: CPU_RUNTIME_GB), so that both sides count the same things.

--calibrate fits the CPU overhead terms (hardware.CPU_OVERHEADS: step_overhead_s, micro_batch_overhead_s, message_us)
by non-negative least squares of the relative error of the load-free steps on the FIT layouts only, takes the
1-process run's baseline as CPU_RUNTIME_GB, prints them to be stored, and reports the held-out layouts separately. --append measures again into the --json file, keeping each layout's less loaded run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a file: the repository root
from benchmarks.harness import compose
from nanoexp.observe.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P = "parallelism"
LAYOUTS = {   # name: overrides (at most 4 processes)
    "dp1": [],
    "dp2": [f"{P}.dp=2"],
    "tp2": [f"{P}.tp=2"],
    "pp2 1f1b": [f"{P}.pp=2", f"{P}.pp_engine=1f1b"],
    "pp2 afab": [f"{P}.pp=2", f"{P}.pp_engine=afab"],
    "pp2 interleaved v3": [f"{P}.pp=2", f"{P}.pp_engine=interleaved_1f1b", f"{P}.pp_virtual_stages=3"],
    "pp2 zb_h1": [f"{P}.pp=2", f"{P}.pp_engine=zb_h1"],
    "cp2 ring": [f"{P}.cp=2", f"{P}.cp_mode=ring"],
    "cp2 all_gather": [f"{P}.cp=2", f"{P}.cp_mode=all_gather"],
    "dp2 ZeRO-1": [f"{P}.dp=2", "optimizer.zero_stage=1"],
    "dp2 ZeRO-2": [f"{P}.dp=2", "optimizer.zero_stage=2"],
    "dp2 ZeRO-3": [f"{P}.dp=2", "optimizer.zero_stage=3"],
    "dp2tp2": [f"{P}.dp=2", f"{P}.tp=2"],
    "dp2pp2": [f"{P}.dp=2", f"{P}.pp=2"],
    "tp2pp2": [f"{P}.tp=2", f"{P}.pp=2"],
}
# --calibrate fits on these; the others are held out. Not dp1: its one rank runs 2 threads, whose OpenMP barriers a
# loaded machine stalls far more than the 1-thread ranks of the others (docs/planning.md, "This CPU").
FIT = ("dp2", "tp2", "pp2 1f1b", "cp2 ring", "dp2pp2")
TERMS = ("step_overhead_s", "micro_batch_overhead_s", "message_us")   # hardware.CPU_OVERHEADS


def overrides(name: str, model: str, steps: int, batch: int) -> list[str]:
    return [f"model={model}", *LAYOUTS[name], f"tokens.train_steps={steps}", f"tokens.global_batch_size={batch}",
            "optimizer.learning_rate_scheduler.lr_warmup_steps=1", "checkpoint.save_final_state=false",
            "tokens.val_check_interval=0", "tokens.limit_val_batches=1", "logging.tensorboard=false",
            "logging.iteration_step_info_interval=1", "logging.exact_cpu_memory=true"]


def measure(name: str, model: str, steps: int, batch: int, folder: str) -> dict:
    """Run the layout with train.py; the shortest step time after step 1, the largest per-rank peak, the baseline."""
    run_dir = os.path.join(folder, name.replace(" ", "_"))
    cmd = [sys.executable, "train.py", *overrides(name, model, steps, batch), f"hydra.run.dir={run_dir}"]
    code, waited = run_watched(cmd, os.path.join(folder, "stderr.txt"))
    if code:
        with open(os.path.join(folder, "stderr.txt")) as f:
            raise RuntimeError(f"{name}: train.py exited {code}:\n{f.read()[-3000:]}")
    records = read_metrics(run_dir)
    times = [r["step_time_sec"] for r in records if "step_time_sec" in r and r["step"] > 1]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    return {"step_s": min(times), "times": times, "memory_mb": max(summary["peak_memory_mb_per_rank"]),
            "baseline_mb": summary["baseline_memory_mb"], "world": summary["world_size"], "waited": waited}


def schedstat(pid: int) -> dict[int, tuple[int, int]]:
    """{thread id: (ns on a CPU, ns runnable but waiting for one)} of a process (Linux /proc/<pid>/task/*/schedstat)."""
    stats = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                cpu, wait, _ = f.read().split()
            stats[int(tid)] = (int(cpu), int(wait))
    except (OSError, ValueError):   # the process or thread ended meanwhile
        pass
    return stats


def run_watched(cmd: list[str], stderr_path: str, interval: float = 0.25) -> tuple[int, float]:
    """Run `cmd` (its stderr to a file), sampling its processes' schedstat; (exit status, waited): averaged over
    the processes that work (the busiest thread's CPU time at least a fifth of the busiest process's), the share of
    their lifetime their busiest thread was runnable but waited for a core, i.e. the time other load took."""
    import psutil
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        first, last, root = {}, {}, psutil.Process(proc.pid)
        while proc.poll() is None:
            now = time.monotonic()
            try:
                pids = [proc.pid, *(c.pid for c in root.children(recursive=True))]
            except psutil.Error:
                pids = [proc.pid]
            for pid in pids:
                if stats := schedstat(pid):
                    first.setdefault(pid, (now, stats))
                    last[pid] = (now, stats)
            time.sleep(interval)
    busiest = {}
    for pid, (end, stats) in last.items():
        start, before = first[pid]
        if end - start > 1:   # a thread born after the first sample started from zero
            cpu, wait = max((c - before.get(t, (0, 0))[0], w - before.get(t, (0, 0))[1]) for t, (c, w) in stats.items())
            busiest[pid] = (cpu, wait / 1e9 / (end - start))
    most = max((cpu for cpu, _ in busiest.values()), default=0)
    shares = [share for cpu, share in busiest.values() if cpu >= most / 5]
    return proc.returncode, statistics.mean(shares) if shares else 0.0


def predict_layout(name: str, model: str, steps: int, batch: int, hw):
    from nanoexp.parallel.layout import Layout
    from nanoexp.plan.cost import predict
    cfg = compose(overrides(name, model, steps, batch))
    return predict(cfg, hw, gpus_per_node=Layout.from_config(cfg).world_size)   # its ranks share hw (per_rank)


def fit_overheads(hw, names, measured, model, steps, batch, idle):
    """Non-negative least squares of the relative error (each layout's residual over its measured step) on the three
    CPU overhead terms; a term's column is the prediction with it at 1 unit minus the one without (they add)."""
    import numpy as np
    from scipy.optimize import nnls
    terms = TERMS
    base = dataclasses.replace(hw, **{t: 0.0 for t in terms})
    zero = np.array([predict_layout(n, model, steps, batch, base).step_time_s for n in names])
    columns = [np.array([predict_layout(n, model, steps, batch, dataclasses.replace(base, **{t: 1.0})).step_time_s
                         for n in names]) - zero for t in terms]
    step = np.array([free_step(measured[n], idle) for n in names])
    solution = nnls(np.stack(columns, 1) / step[:, None], (step - zero) / step)[0]
    return dataclasses.replace(hw, **dict(zip(terms, solution.tolist())))


def spearman(a, b) -> float:
    from scipy.stats import spearmanr
    return float(spearmanr(a, b).statistic)


def table(rows, title) -> None:
    print(f"\n{title}")
    print("| layout | procs | predicted s/step | measured s/step | waited | load-free s/step | error | predicted MB | "
          "measured MB | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['world']} | {r['pred_s']:.2f} | {r['step_s']:.2f} | {r.get('waited', 0):.0%} | "
              f"{r['free_s']:.2f} | {r['time_err']:+.0%} | {r['pred_mb']:,.0f} | {r['memory_mb']:,.0f} | "
              f"{r['mem_err']:+.0%} |")
    if len(rows) > 2:
        raw = [r["pred_s"] / r["step_s"] - 1 for r in rows]
        print(f"load-free: Spearman {spearman([r['pred_s'] for r in rows], [r['free_s'] for r in rows]):.2f}, "
              f"median |time error| {statistics.median(abs(r['time_err']) for r in rows):.0%}; as measured: Spearman "
              f"{spearman([r['pred_s'] for r in rows], [r['step_s'] for r in rows]):.2f}, median |time error| "
              f"{statistics.median(abs(e) for e in raw):.0%}; memory within ±15 %: "
              f"{sum(abs(r['mem_err']) <= 0.15 for r in rows)}/{len(rows)} (largest "
              f"{max(abs(r['mem_err']) for r in rows):.0%})")


def rows_of(names, measured, hw, model, steps, batch, idle):
    from nanoexp.plan.memory import GIB
    from nanoexp.instruments.memory import MB
    rows = []
    for n in names:
        p, m = predict_layout(n, model, steps, batch, hw), measured[n]
        pred_mb = p.memory_gb * GIB / MB   # with the device's runtime a process (Hardware.cuda_context_gb)
        rows.append({"name": n, **m, "pred_s": p.step_time_s, "free_s": free_step(m, idle),
                     "time_err": p.step_time_s / free_step(m, idle) - 1,
                     "pred_mb": pred_mb, "mem_err": pred_mb / m["memory_mb"] - 1, "breakdown": p.breakdown})
    return rows


def free_step(m: dict, idle: bool) -> float:
    """The step as if no other load had run: the measured one less the share its ranks waited for a core beyond
    what more ranks than cores wait for each other anyway (1 - cpus / ranks, which cpu_share already models).
    With `idle` (--idle: the machine ran nothing else), the step as measured (the wait estimate only adds its own noise then: a 2-thread rank descheduled
    once stalls at OpenMP's barriers for longer than it waited)."""
    if idle:
        return m["step_s"]
    own = max(0.0, 1 - (os.cpu_count() or 1) / m["world"])
    return m["step_s"] * (1 - max(0.0, m.get("waited", 0.0) - own))


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def measure_all(names: list[str], args) -> dict:
    """Run each layout in turn (into --json after each: a cut-short pass keeps what it measured); with --append,
    into the --json file's earlier runs, keeping each layout's run with the shorter load-free step."""
    measured, folder = {}, tempfile.mkdtemp(prefix="bench_plan_cpu_")
    if args.append:
        with open(args.json) as f:
            measured = json.load(f)
    try:
        for n in names:
            new = measure(n, args.model, args.steps, args.batch, folder)
            runs = measured.get(n, {}).get("runs", 1 if n in measured else 0) + 1
            if n not in measured or free_step(new, args.idle) < free_step(measured[n], args.idle):
                measured[n] = new
            measured[n]["runs"] = runs
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(measured, f, indent=1)
            print(f"  {n}: {new['step_s']:.2f} s/step {new['times']}, waited {new['waited']:.0%}, "
                  f"{new['memory_mb']:.0f} MB, load {load()}", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"load after: {load()}")
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=4, help="train_steps per run (step 1 is not counted)")
    parser.add_argument("--batch", type=int, default=16, help="tokens.global_batch_size (sequences of 128)")
    parser.add_argument("--only", help="comma-separated layout names (default: all)")
    parser.add_argument("--calibrate", action="store_true", help=f"fit the CPU overheads on {', '.join(FIT)}")
    parser.add_argument("--measured", help="a --json file of earlier runs: predict again without running")
    parser.add_argument("--json", help="write the measurements here")
    parser.add_argument("--idle", action="store_true", help="the machine is otherwise idle: fit and keep runs by "
                        "the step as measured, not the load-free estimate")
    parser.add_argument("--append", action="store_true", help="measure again into the --json file's runs, keeping "
                        "each layout's run with the shorter load-free step (a second pass in another order)")
    args = parser.parse_args()
    from nanoexp.plan.memory import GIB
    from nanoexp.instruments.memory import MB
    from nanoexp.plan.hardware import calibrate_cpu
    names = args.only.split(",") if args.only else list(LAYOUTS)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: python -m benchmarks.bench_plan_cpu "
          f"{' '.join(sys.argv[1:])}\nmodel={args.model}, global batch {args.batch} x 128 tokens, {args.steps} steps "
          f"a run, {os.cpu_count()} CPUs, load (1/5/15 min) before: {load()}")
    hw = calibrate_cpu()
    print(f"calibrated: {hw.bf16_tflops:.3f} TFLOP/s matmul peak, gloo {hw.intra_gbps:.2f} GB/s")
    if args.measured:
        with open(args.measured) as f:
            measured = json.load(f)
        names = [n for n in names if n in measured]
    else:
        measured = measure_all(names, args)
        names = [n for n in LAYOUTS if n in measured]
    print(f"stored: {', '.join(f'{k} {getattr(hw, k):g}' for k in TERMS)}, runtime {hw.cuda_context_gb:.3f} GB")
    table(rows_of(names, measured, hw, args.model, args.steps, args.batch, args.idle), "with the stored terms (hardware.py)")
    if args.calibrate:
        fit = [n for n in FIT if n in measured]
        hw = fit_overheads(hw, fit, measured, args.model, args.steps, args.batch, args.idle)
        baseline = measured["dp1"]["baseline_mb"] if "dp1" in measured else statistics.mean(
            m["baseline_mb"] for m in measured.values())
        hw = dataclasses.replace(hw, cuda_context_gb=baseline * MB / GIB)
        print(f"\nfitted on {', '.join(fit)} (store in nanoexp/plan/hardware.py): CPU_OVERHEADS = dict("
              f"step_overhead_s={hw.step_overhead_s:.3f}, micro_batch_overhead_s={hw.micro_batch_overhead_s:.4f}, "
              f"message_us={hw.message_us:.0f}), CPU_RUNTIME_GB = {hw.cuda_context_gb:.3f} (the 1-process run's "
              f"baseline, {baseline:.0f} MB)")
        rows = rows_of(names, measured, hw, args.model, args.steps, args.batch, args.idle)
        table([r for r in rows if r["name"] in fit], "calibrated: the fitted layouts")
        table([r for r in rows if r["name"] not in fit], "calibrated: held out")
        table(rows, "calibrated: all")


if __name__ == "__main__":
    main()
