"""The optimizer step's share of a training step, AdamW against Muon, on several layouts.

    python benchmarks/bench_optimizer.py                                   # tiny: one process, tp2, dp2 ZeRO-1
    python benchmarks/bench_optimizer.py --model small --layouts dp1tp1pp1 dp1tp2pp1 --steps 6 --repeats 3

Each case is a fresh set of local workers (nanoexp's launcher) running the real Trainer. Per step, rank 0 times
the gradients (forward, backward, gradient sync, clipping by the global norm) and `optimizer.step()` apart (Muon:
the momentum, the gathers of the update direction, Newton–Schulz and the update; under ZeRO both also all-gather
the updated parameters), every rank starting the step together; medians over the timed steps, then over the
repeats. The cases alternate (AdamW, Muon per layout), so background load hits both alike. On CUDA each part ends
with a device synchronisation.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from nanoexp.launch.workers import WorkerFailed, spawn_local, start_method
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.optim.schedule import lr_at, set_lr
from nanoexp.runtime.trainer import Trainer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a file: the repository root
from benchmarks.harness import compose, in_turns  # noqa: E402

LAYOUTS = {"dp1tp1pp1": [], "dp1tp2pp1": ["parallelism.tp=2"],
           "dp2tp1pp1-zero1": ["parallelism.dp=2", "optimizer.zero_stage=1"],
           "dp2tp1pp1-zero3": ["parallelism.dp=2", "optimizer.zero_stage=3"],
           "dp1tp1pp2": ["parallelism.pp=2"]}
OPTIMIZERS = ("adamW", "muon")


def timed(device: torch.device, fn) -> float:
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def worker(rank, world_size, device, cfg, args, results) -> None:
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            trainer = Trainer(cfg, ParallelContext(Layout.from_config(cfg), device), run_dir)
            steps = [trainer.batches.next_step() for _ in range(args.warmup + args.steps)]
            trainer.batches.close()
            gradient_times, update_times = [], []
            for i, micro_batches in enumerate(steps, start=1):
                set_lr(trainer.optimizer, lr_at(i, cfg))
                dist.barrier()

                def gradients(micro_batches=micro_batches):   # the trainer's phases before its optimizer step
                    losses = trainer.forward_backward([trainer.runner.prepare(mb) for mb in micro_batches])
                    trainer.sync_gradients()
                    trainer.step_loss(losses).item()
                    trainer.clip_gradients()
                g, u = timed(device, gradients), timed(device, trainer.optimizer.step)
                trainer.grad_sync.zero_grad()
                if i > args.warmup:
                    gradient_times.append(g)
                    update_times.append(u)
        results.put((rank, "ok", (statistics.median(gradient_times), statistics.median(update_times))))
    except BaseException as error:
        results.put((rank, "error", f"{type(error).__name__}: {error}"))
        raise
    finally:   # the launcher ends workers with os._exit: let the queue's data through first
        results.close()
        results.join_thread()


def run_case(layout: str, optimizer: str, args) -> tuple[float, float] | str:
    """(gradients s, optimizer step s) of rank 0, or the error."""
    overrides = [f"model={args.model}", f"optimizer.optimizer_factory.name={optimizer}", "logging.tensorboard=false",
                 "data.prefetch=false", *LAYOUTS[layout], *args.overrides]
    cfg = compose(overrides, plain=True)
    world = Layout.from_config(cfg).world_size
    results = mp.get_context(start_method()).Queue()
    try:
        spawn_local(world, worker, (cfg, args, results), timeout_s=args.timeout)
    except WorkerFailed as error:
        return str(error)
    reports = {}
    while not results.empty():
        rank, status, payload = results.get()
        reports.setdefault(status, {})[rank] = payload
    return reports.get("ok", {}).get(0) or str(reports.get("error", "no result"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--layouts", nargs="+", default=["dp1tp1pp1", "dp1tp2pp1", "dp2tp1pp1-zero1"],
                        choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=6, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of all cases, alternating")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every case")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, model={args.model}, {args.warmup} warm-up + {args.steps} timed steps, "
          f"{args.repeats} repeat(s), load average {load:.2f}", flush=True)
    runs: dict[tuple[str, str], list] = {}
    cases = [(layout, optimizer) for layout in args.layouts for optimizer in OPTIMIZERS]
    for repeat, (layout, optimizer) in in_turns(cases, args.repeats):
        result = run_case(layout, optimizer, args)
        runs.setdefault((layout, optimizer), []).append(result)
        shown = result if isinstance(result, str) else f"gradients {1e3 * result[0]:.1f} ms, step {1e3 * result[1]:.1f} ms"
        print(f"  repeat {repeat + 1}: {layout} {optimizer}: {shown}", flush=True)
    print(f"\nload average {load:.2f} -> {os.getloadavg()[0]:.2f}; rank 0, medians")
    print(f"{'layout':<18}{'optimizer':>10}{'gradients ms':>14}{'step ms':>10}{'step share':>12}")
    for (layout, optimizer), results in runs.items():
        done = [r for r in results if not isinstance(r, str)]
        if not done:
            print(f"{layout:<18}{optimizer:>10}  FAILED: {results[0]}")
            continue
        g, u = statistics.median(r[0] for r in done), statistics.median(r[1] for r in done)
        print(f"{layout:<18}{optimizer:>10}{1e3 * g:>14.1f}{1e3 * u:>10.1f}{100 * u / (g + u):>11.1f}%")


if __name__ == "__main__":
    main()
