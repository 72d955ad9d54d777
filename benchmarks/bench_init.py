"""Time and peak memory of building a model's shards (build_model: modules, materialised shards, initial weights)
on tp ranks, one process per rank as `python train.py` runs them.

    python benchmarks/bench_init.py --model llama_1b --tp 1 2 4

For each tp, tp forked gloo workers (torch's threads split between them) each build their shard of the model
and report the wall time of build_model and the growth of their peak resident memory (VmHWM, reset before the
build) against the bytes of the shard they hold. Timing here is never a pass/fail test: see docs/performance.md.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from nanoexp.config import compose  # noqa: E402
from nanoexp.launch.workers import free_port  # noqa: E402
from nanoexp.instruments.memory import MB, peak_memory_mb, start_measuring  # noqa: E402


def build(cfg):
    """This rank's model shard, as the trainer builds it."""
    from nanoexp.runtime.build import build_model
    from nanoexp.parallel.context import ParallelContext
    from nanoexp.parallel.layout import Layout
    return build_model(cfg, ParallelContext(Layout.from_config(cfg)))


def worker(rank: int, tp: int, port: int, overrides: list[str], queue) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
        dist.init_process_group("gloo", rank=rank, world_size=tp)
        cfg = compose(overrides + [f"parallelism.tp={tp}"])
        dist.barrier()
        baseline = start_measuring(torch.device("cpu"))
        start = time.perf_counter()
        model = build(cfg)
        seconds = time.perf_counter() - start
        held = sum(p.numel() * p.element_size() for p in model.parameters()) / MB
        queue.put((rank, seconds, peak_memory_mb(torch.device("cpu")) - baseline, held, None))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - hand any failure to the parent
        queue.put((rank, 0, 0, 0, traceback.format_exc()))


def measure(tp: int, overrides: list[str]) -> list[tuple]:
    context = mp.get_context("fork")
    queue, port = context.Queue(), free_port()
    procs = [context.Process(target=worker, args=(r, tp, port, overrides, queue)) for r in range(tp)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=1800) for _ in procs]
    for proc in procs:
        proc.join()
    errors = [r[4] for r in results if r[4]]
    if errors:
        raise RuntimeError(errors[0])
    return sorted(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama_1b")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--set", nargs="*", default=[], help="Hydra overrides")
    args = parser.parse_args()
    overrides = [f"model={args.model}", *args.set]
    print(f"model={args.model}, {os.cpu_count()} CPUs; per rank: wall seconds of build_model, peak memory growth "
          "(MB), the shard's parameters (MB)")
    print(f"{'tp':>3} {'seconds (max over ranks)':>25} {'peak growth MB (max)':>21} {'shard MB':>9}")
    for tp in args.tp:
        results = measure(tp, overrides)
        print(f"{tp:>3} {max(r[1] for r in results):>25.1f} {max(r[2] for r in results):>21.0f} "
              f"{max(r[3] for r in results):>9.0f}", flush=True)


if __name__ == "__main__":
    main()
