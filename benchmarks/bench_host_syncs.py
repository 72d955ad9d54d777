"""Host waits per training step, by line of nanoexp (nanoexp/verify/host_syncs.py): each read of a device value on
the host (`.item()`, `.tolist()`, `bool()`, ...) and each op whose output size depends on the data, which on a GPU
make the host wait for everything queued. Counted on CPU, where the same calls are made.

    python benchmarks/bench_host_syncs.py                 # tiny, moe_tiny, tiny on dp1tp1pp2 (per rank)
    python benchmarks/bench_host_syncs.py --cases moe_tiny:dp1tp1pp1 tiny:dp2tp2pp1

Step 3 of a 4-step run (global batch 32, micro-batch 4: 8 micro-batches), from its start to step 4's.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a file: the repository root
from benchmarks.harness import compose
from nanoexp.launch.workers import spawn_local, start_method
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.verify.host_syncs import host_waits_of_a_step

RUN = ["tokens.train_steps=4", "optimizer.learning_rate_scheduler.lr_warmup_steps=1", "tokens.val_check_interval=0",
       "checkpoint.save_final_state=false", "logging.tensorboard=false", "data.prefetch=false"]


def worker(rank, world_size, device, cfg, run_dir, results) -> None:
    syncs = host_waits_of_a_step(cfg, ParallelContext(Layout.from_config(cfg), device), run_dir)
    results.put((rank, dict(syncs.by_site)))


def count(model: str, layout: str) -> list[dict]:
    cfg = compose(RUN + [f"model={model}", f"parallelism={layout}"], plain=True)
    world = Layout.from_config(cfg).world_size
    results = mp.get_context(start_method()).Queue()
    with tempfile.TemporaryDirectory() as run_dir:
        if world == 1:
            worker(0, 1, None, cfg, run_dir, results)
        else:
            spawn_local(world, worker, (cfg, run_dir, results))
        by_rank = dict(results.get() for _ in range(world))
    return [by_rank[r] for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=["tiny:dp1tp1pp1", "moe_tiny:dp1tp1pp1", "tiny:dp1tp1pp2"])
    args = parser.parse_args()
    for case in args.cases:
        model, layout = case.split(":")
        for rank, sites in enumerate(count(model, layout)):
            print(f"| {model} | {layout} | rank {rank} | {sum(sites.values())} | "
                  + "; ".join(f"{site} ×{n}" for site, n in sorted(sites.items(), key=lambda kv: -kv[1])) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
