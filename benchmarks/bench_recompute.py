"""Each recomputation mode (parallelism.recompute, docs/memory.md#activation-recomputation) against `none`: the peak
activation memory per rank, measured and estimated, and the step time.

    python benchmarks/bench_recompute.py                                  # small and medium; 1 process, tp2, pp2
    python benchmarks/bench_recompute.py --models small --layouts dp1tp2pp1 --modes none selective --steps 5
    python benchmarks/bench_recompute.py --models small --rounds 3     # the cases in turns: load hits all alike

A case is a model, a layout (a conf/parallelism name) and a mode (`selective:attention` keeps attention's outputs
only). Each runs in fresh workers (nanoexp.launch.workers.spawn_local), one Trainer a rank: the first step's forward
and backward under LiveTensorPeak (nanoexp/instruments/memory.py: the tensors the step creates, counted from the
tensors, the same on any CPU; parameters and gradient buffers exist before), against the estimate's activations
for the rank's pipeline stage (nanoexp/observe/memory_estimate.py); then `--warmup` and `--steps` whole training
steps, timed on rank 0 (the median wall time over the rounds, and the CPU time of rank 0's threads). Memory is
exact and repeatable; times depend on the machine and its load (--rounds runs the cases in turns, so that a
changing load hits every mode alike).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from benchmarks.harness import compose, in_turns
from nanoexp.instruments.memory import MB, LiveTensorPeak
from nanoexp.launch.workers import WorkerFailed, spawn_local, start_method
from nanoexp.model.shape import model_shape
from nanoexp.observe.memory_estimate import estimate
from nanoexp.optim.schedule import lr_at
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.runtime.trainer import Trainer

MODES = {"none": [], "full": ["parallelism.recompute=full"], "selective": ["parallelism.recompute=selective"],
         "every_k": ["parallelism.recompute=every_k"],
         "selective:attention": ["parallelism.recompute=selective", "parallelism.selective_ops=[attention]"]}
RUN = ["tokens.sequence_length=128", "tokens.micro_batch_size=4", "tokens.global_batch_size=8",
       "tokens.val_check_interval=0", "logging.tensorboard=false", "data.prefetch=false",
       "checkpoint.save_final_state=false", "optimizer.learning_rate_scheduler.lr_warmup_steps=1"]


def worker(rank, world_size, device, cfg, args, results) -> None:
    """One rank: the first step's activation peak and estimate, then the timed steps; hands them to the parent."""
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            trainer = Trainer(cfg, ParallelContext(Layout.from_config(cfg), device), run_dir)
            steps = [trainer.batches.next_step() for _ in range(1 + args.warmup + args.steps)]
            trainer.batches.close()
            with LiveTensorPeak() as live:
                trainer.forward_backward([trainer.runner.prepare(mb) for mb in steps[0]])
            trainer.sync_gradients()
            trainer.grad_sync.zero_grad()
            times, cpu_times = [], []
            for i, micro_batches in enumerate(steps[1:], start=1):
                dist.barrier()   # every rank starts the step together: rank 0's time is the step's
                start, cpu_start = time.perf_counter(), time.process_time()
                trainer.train_step(micro_batches, lr_at(i, cfg))
                times.append(time.perf_counter() - start)
                cpu_times.append(time.process_time() - cpu_start)   # its threads' CPU time: less moved by load
            pp_rank = trainer.ctx.layout.position(rank)[0]
            results.put((rank, {"measured": live.peak, "estimated": estimate(cfg, model_shape(cfg), pp_rank)[
                "activations"], "times": times[args.warmup:], "cpu_times": cpu_times[args.warmup:]}))
    finally:   # the launcher ends workers with os._exit: let the queue's data through first
        results.close()
        results.join_thread()


def run_case(model: str, layout: str, mode: str, args) -> list[dict]:
    """Per rank: measured and estimated activation bytes, step times."""
    cfg = compose([f"model={model}", f"parallelism={layout}", f"tokens.train_steps={1 + args.warmup + args.steps}",
                   *RUN, *MODES[mode]], plain=True)
    world = Layout.from_config(cfg).world_size
    results = mp.get_context(start_method()).Queue()
    spawn_local(world, worker, (cfg, args, results), timeout_s=args.timeout)
    reports = dict(results.get() for _ in range(world))
    return [reports[r] for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["small", "medium"])
    parser.add_argument("--layouts", nargs="+", default=["dp1tp1pp1", "dp1tp2pp1", "dp1tp1pp2"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="each case this many times, the cases in turns")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = [(model, layout, mode) for model in args.models for layout in args.layouts for mode in args.modes]
    runs: dict[tuple, list] = {}
    for _, case in in_turns(cases, args.rounds):   # background load hits every mode alike
        try:
            runs.setdefault(case, []).append(run_case(*case, args))
        except WorkerFailed as error:
            print(f"{' '.join(case)} failed: {error}", flush=True)
    print(f"{'model':<7}{'layout':<11}{'mode':<21}{'rank':>4}{'measured MB':>12}{'estimated MB':>13}{'est/meas':>9}"
          f"{'step s':>8}{'vs none':>8}{'CPU s':>8}{'vs none':>8}")
    for model, layout, mode in (case for case in cases if case in runs):
        ranks = runs[model, layout, mode][0]
        step, cpu = (statistics.median(t for run in runs[model, layout, mode] for t in run[0][key])
                     for key in ("times", "cpu_times"))
        base = runs.get((model, layout, "none"))
        base_step, base_cpu = ((statistics.median(t for run in base for t in run[0][key]) for key in
                                ("times", "cpu_times")) if base else (float("nan"),) * 2)
        for rank, r in enumerate(ranks):
            print(f"{model:<7}{layout:<11}{mode:<21}{rank:>4}{r['measured'] / MB:>12.1f}{r['estimated'] / MB:>13.1f}"
                  f"{r['estimated'] / r['measured']:>9.3f}{step:>8.3f}{step / base_step:>8.2f}{cpu:>8.2f}"
                  f"{cpu / base_cpu:>8.2f}")


if __name__ == "__main__":
    main()
