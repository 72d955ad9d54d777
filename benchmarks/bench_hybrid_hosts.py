"""Hybrid vs full ZeRO-3 on two hosts: the bytes each rank sends across the host boundary per step, counted and
by the formula, and each rank's peak memory against the estimate (issue 57 item 3; docs/multi-node.md).

    bash scripts/fake_hosts.sh up 2                      # root: two hosts in network namespaces
    python benchmarks/bench_hybrid_hosts.py              # model=tiny, dp4 (2 ranks a host), ZeRO-3, 1 + 2 steps
    python benchmarks/bench_hybrid_hosts.py --model small --steps 2 --set tokens.sequence_length=128

Each case is one torchrun agent a host (c10d rendezvous, 2 processes each) running this file's worker: a Trainer
whose counted steps run inside a CommCounter over every group of the layout (plan.traffic.GROUPS). What crosses the
boundary follows the counter's ring rule: in a ring each rank sends only to the next rank of its group, so all the
bytes a rank sends over a group cross when that next rank is on the other host, none otherwise. With the shard
groups inside a host only the replica all-reduce (and the loss scalars over dp) cross; under full sharding the
ring over the 4 ranks crosses twice, so half of the ranks send their shard traffic across. The formula column
applies the same rule to nanoexp/plan/traffic.py's bytes. Memory: the peak above the rank's runtime baseline
(logging.exact_cpu_memory) against nanoexp/observe/memory_estimate.py's estimate for the rank.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # run as a file (also by torchrun): the repository root
CASES = {"hybrid 2 x 2": ["parallelism.dp_shard=2"], "full (dp4)": []}
BASE = ["parallelism=dp4tp1pp1", "optimizer.zero_stage=3", "tokens.global_batch_size=8",
        "tokens.micro_batch_size=1", "tokens.val_check_interval=0", "logging.tensorboard=false", "data.prefetch=false",
        "logging.exact_cpu_memory=true"]


def crossing(groups: dict, hosts: list[str], me: int) -> dict[str, bool]:
    """Per named group: whether this rank's ring neighbour (the next rank of the group) is on another host."""
    import torch.distributed as dist
    out = {}
    for name, group in groups.items():
        ranks = dist.get_process_group_ranks(group)
        out[name] = hosts[ranks[(ranks.index(me) + 1) % len(ranks)]] != hosts[me]
    return out


def worker(overrides: list[str], steps: int, out_dir: str) -> None:
    """One rank: a warm-up step, `steps` counted ones, its bytes, crossings and peak written to out_dir."""
    import torch.distributed as dist

    from benchmarks.harness import compose
    from nanoexp.instruments.memory import peak_memory_mb, return_freed_memory
    from nanoexp.observe.memory_estimate import MB, estimate, total
    from nanoexp.parallel.context import ParallelContext
    from nanoexp.parallel.layout import Layout
    from nanoexp.plan.traffic import GROUPS, sent_bytes
    from nanoexp.runtime.trainer import Trainer
    from nanoexp.verify.comm_counter import CommCounter

    return_freed_memory()   # logging.exact_cpu_memory, as nanoexp.run does it
    dist.init_process_group("gloo")
    cfg = compose(overrides)
    ctx = ParallelContext(Layout.from_config(cfg))
    hosts = [None] * ctx.world_size
    dist.all_gather_object(hosts, socket.gethostname())
    named = {name: getattr(ctx, f"{name}_group") for name in GROUPS if ctx.cp > 1 or name not in ("dp_cp", "cp")}
    named = {name: group for name, group in named.items() if group is not None} | {"world": dist.group.WORLD}
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, ctx, run_dir)
        lr = cfg.optimizer.learning_rate_scheduler.learning_rate
        trainer.train_step(trainer.batches.next_step(), lr)
        with CommCounter(named) as comm:
            for _ in range(steps):
                trainer.train_step(trainer.batches.next_step(), lr)
        trainer.batches.close()
        peak = peak_memory_mb(ctx.device) - trainer.reporter.baseline_mb
        formula = sent_bytes(cfg, ctx.layout, trainer.shape, ctx.pp_rank, trainer.accumulation)
    crosses = crossing(named, hosts, ctx.rank)
    sent = {name: t["sent_bytes"] / steps for name, t in comm.totals().items()}
    result = {"rank": ctx.rank, "host": hosts[ctx.rank], "sent": sent, "formula": formula,
              "crossed": sum(b for name, b in sent.items() if crosses.get(name)),
              "crossed_formula": sum(b for name, b in formula.items() if crosses.get(name)),
              "peak_mb": peak, "estimate_mb": total(estimate(cfg, trainer.shape, ctx.pp_rank)) / MB}
    with open(os.path.join(out_dir, f"rank_{ctx.rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def run_case(overrides: list[str], steps: int, out_dir: str, port: int, timeout: float = 600) -> list[dict]:
    """Both hosts' torchrun agents on this file's worker; the ranks' results in rank order."""
    from tests.multihost import HOSTS, finish, torchrun_on_host
    args = ["--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d", f"--rdzv_endpoint={HOSTS[0]}:{port}",
            f"--rdzv_id=nanoexp-hybrid-{port}", "--max-restarts=0", os.path.abspath(__file__), "--worker",
            "--out", out_dir, "--steps", str(steps), "--", *overrides]
    outputs = finish([torchrun_on_host(host, args, cwd=ROOT) for host in (0, 1)], timeout=timeout)
    files = sorted(glob.glob(os.path.join(out_dir, "rank_*.json")))
    if len(files) != 4:
        raise RuntimeError("a rank wrote no result:\n" + outputs[0][-3000:] + outputs[1][-3000:])
    return sorted((json.load(open(path)) for path in files), key=lambda r: r["rank"])


def print_case(name: str, results: list[dict]) -> None:
    print(f"\n{name}: per rank and step (bytes sent, comm_counter's ring rule; memory MB above the baseline)")
    print(f"  {'rank':>4} {'host':<14} {'shard grp':>11} {'replica':>10} {'dp':>6} {'crossing':>10} "
          f"{'formula':>10} {'peak MB':>8} {'estimate':>9}")
    for r in results:   # full sharding's shard group is the dp group (with the loss scalars)
        hybrid = "replica" in r["sent"]
        shard, dp = (r["sent"]["shard"], r["sent"].get("dp", 0)) if hybrid else (r["sent"].get("dp", 0), 0)
        print(f"  {r['rank']:>4} {r['host']:<14} {shard:>11,.0f} {r['sent'].get('replica', 0):>10,.0f} {dp:>6,.0f} "
              f"{r['crossed']:>10,.0f} {r['crossed_formula']:>10,.0f} {r['peak_mb']:>8.1f} {r['estimate_mb']:>9.1f}")
    mean = statistics.mean(r["crossed"] for r in results)
    formula = statistics.mean(r["crossed_formula"] for r in results)
    print(f"  bytes across the host boundary per rank and step, mean: {mean:,.0f} counted, {formula:,.0f} formula"
          " (counted adds the world group's few bytes, which the formula leaves out)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=2, help="counted steps, after one uncounted")
    parser.add_argument("--set", nargs="*", default=[], help="Hydra overrides for both cases")
    parser.add_argument("--port", type=int, default=29461)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.overrides, args.steps, args.out)
    from tests.multihost import hosts_up
    if not hosts_up():
        sys.exit("needs root and two fake hosts: bash scripts/fake_hosts.sh up 2")
    print(f"model={args.model}, dp4 on 2 hosts x 2 processes, ZeRO-3, gloo, {os.cpu_count()} CPUs; "
          f"1 warm-up + {args.steps} counted steps; load {os.getloadavg()[0]:.1f}")
    for offset, (name, extra) in enumerate(CASES.items()):
        with tempfile.TemporaryDirectory() as out_dir:
            overrides = [f"model={args.model}", *BASE, *args.set, *extra]
            print_case(name, run_case(overrides, args.steps, out_dir, args.port + offset))


if __name__ == "__main__":
    main()
