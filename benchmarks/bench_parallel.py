"""Tokens/s and bytes moved per process group, for a few layouts on local CPU/gloo workers.

    python benchmarks/bench_parallel.py dp2tp1pp1 dp1tp2pp1 dp1tp2pp1:parallelism.tp_mode=reduce_scatter \
        dp1tp1pp2 dp2tp2pp2 [--model tiny] [--steps 3] [--warmup 1] [--set KEY=VALUE ...]
    python benchmarks/bench_parallel.py dp1cp2tp1pp1 dp1cp4tp1pp1 dp2cp2tp1pp1   # context parallel
    python benchmarks/bench_parallel.py dp2ep2tp1pp1 dp4ep2tp1pp1 --model moe_tiny  # expert parallel

Each layout ("dpXtpYppZ" or "dpXcpWtpYppZ", optionally ":" and comma-separated overrides for that
layout) runs dp*cp*tp*pp forked gloo workers with the real Trainer; after warm-up steps, `--steps`
optimizer steps run inside a `CommCounter` (nanoexp/verify/comm_counter.py), which records every
collective and point-to-point call per process group (dp, tp, pp, model-parallel, embedding, and
with cp > 1 cp and dp_cp).

Reported per group: calls and bytes SENT per rank per optimizer step (ring algorithms; mean
over the ranks), next to the analytic minimum for the layout, derived from the model's shape and
the layout alone (nanoexp.observe.memory_estimate.held_parameters counts what a rank holds), each rank's own count
averaged the same way (m micro-batches per step, s' = seq / cp the tokens of a sample a rank holds,
A = micro_batch x s' x hidden activation bytes, N = the parameters this rank holds):
  dp  averaging this rank's float32 gradients: 2(dp-1)/dp x 4N, whether as one all-reduce
      (zero_stage 0) or as a reduce-scatter of the gradients plus an all-gather of the updated
      parameters (ZeRO-1: (dp-1)/dp x 4N each); ZeRO-2 reduce-scatters every micro-batch (m + 1 passes
      of (dp-1)/dp x 4N), ZeRO-3 also all-gathers each layer before its forward and its backward (3m
      passes; 2m with zero3_reshard_after_forward=false) (`zero_passes`); plus the step loss, and on the loss stage the
      count of target tokens (4 bytes each, all-reduced); with cp > 1 all of this runs over the
      dp x cp group instead ("dp_cp", n = dp·cp: every cp rank holds full weights);
  cp  ring attention (nanoexp/parallel/context_parallel/ring.py, its plan nanoexp.verify.context_parallel.ring_plan), per attention layer the rank
      holds and per micro-batch: the K/V block, K and V stacked, KV = 2 x micro_batch x kv_heads/tp x
      s' x head_dim x activation bytes, sent cp-1 times forward; in backward KV again cp-1 times
      plus the float32 dK/dV accumulator (KV's size at 4 bytes a float) cp-1 hops home:
      cp_min = m x layers x (cp-1) x (2 KV + KV32), and the forward's share once more per layer
      recomputed under parallelism.recompute. With parallelism.cp_mode=all_gather
      (nanoexp/parallel/context_parallel/all_gather.py) one all-gather of K/V forward sends (cp-1)/cp of the
      gathered cp x KV, and one reduce-scatter of the float32 dK/dV backward (cp-1) x KV32; the backward
      reuses the saved K/V: cp_min = m x layers x (cp-1) x (KV + KV32), plus the forward's share again
      under recomputation;
  ep  expert parallelism's all-to-all (nanoexp/parallel/expert_parallel.py, layouts dpXepVtpYppZ with a MoE
      model): per micro-batch and MoE layer of the stage, each routed token's float32 hidden state to its
      top_k experts and back, forward and backward (the forward's share again under recomputation), of which
      (ep-1)/ep leave the rank with even routing, plus the E int64 counts per forward; the measured share
      follows the routing, so sent/min strays from 1 by the routing's skew; and edp: the experts' gradients,
      2(edp-1)/edp x 4 x the expert parameters the rank holds (reduce-scatter + all-gather under ZeRO-1), the
      dense ones staying on dp;
  tp  Megatron's minimum, per micro-batch: 2 all-reduces forward + 2 backward per layer
      (sequence parallel: 4 all-gathers + 4 reduce-scatters, the same bytes), one for the
      embedding (first stage) and one for the LM head's input (last stage), each 2(tp-1)/tp x A;
      the vocab-parallel cross-entropy's 3 all-reduces of micro_batch x s' floats; under SP the
      norm-weight gradients;
  pp  per micro-batch the activation to the next stage and its gradient to the previous one
      (float32, s'/tp long under SP), plus the step loss;
  model_parallel  the squared gradient norm (4 bytes; with ZeRO-1 it is summed over all ranks,
      the "world" line).
tokens/s is the global batch's tokens over rank 0's median step time (workers share the CPUs,
so on a small machine it measures process overhead more than scaling).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from nanoexp.launch.workers import free_port
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.plan.traffic import GROUPS, sent_bytes
from nanoexp.verify.comm_counter import CommCounter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a file: the repository root
from benchmarks.harness import compose  # noqa: E402


def analytic_sent(cfg, ctx: ParallelContext, trainer) -> dict[str, float]:
    """This rank's minimum bytes sent per optimizer step, per group (see the module docstring): the cost model's
    own formulas (nanoexp/plan/traffic.py), so the counts checked here are the bytes the planner predicts."""
    return sent_bytes(cfg, ctx.layout, trainer.shape, ctx.pp_rank, trainer.accumulation)


def worker(rank, world_size, port, cfg, args, queue):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        from nanoexp.runtime.trainer import Trainer
        ctx = ParallelContext(Layout.from_config(cfg))
        with tempfile.TemporaryDirectory() as run_dir:
            trainer = Trainer(cfg, ctx, run_dir)
            steps = [trainer.batches.next_step() for _ in range(args.warmup + args.steps)]
            trainer.batches.close()
            lr = cfg.optimizer.learning_rate_scheduler.learning_rate
            for micro_batches in steps[:args.warmup]:
                trainer.train_step(micro_batches, lr)
            times = []
            # with cp = 1 the dp_cp group IS the dp group: count it once, as dp
            named = [name for name in GROUPS if ctx.cp > 1 or name not in ("dp_cp", "cp")]
            with CommCounter({name: getattr(ctx, f"{name}_group") for name in named}) as comm:
                for micro_batches in steps[args.warmup:]:
                    dist.barrier()
                    start = time.perf_counter()
                    trainer.train_step(micro_batches, lr)
                    times.append(time.perf_counter() - start)
            result = {"times": times, "totals": comm.totals(), "analytic": analytic_sent(cfg, ctx, trainer),
                      "tokens": trainer.tokens_per_step}
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - hand any failure to the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_layout(cfg, args) -> list[dict]:
    world = Layout.from_config(cfg).world_size
    context = mp.get_context("fork")
    queue, port = context.Queue(), free_port()
    procs = [context.Process(target=worker, args=(r, world, port, cfg, args, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    results = {}
    try:
        for _ in range(world):
            rank, status, payload = queue.get(timeout=args.timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [results[r] for r in range(world)]


def report(name: str, results: list[dict], steps: int) -> None:
    tokens_per_sec = results[0]["tokens"] / statistics.median(results[0]["times"])
    print(f"\n{name}: {tokens_per_sec:,.0f} tokens/s ({len(results)} ranks); per rank and optimizer step, mean over ranks:")
    print(f"  {'group':<15} {'calls':>7} {'sent MB':>10} {'analytic min MB':>16} {'sent/min':>9}")
    for group in GROUPS:
        calls = statistics.mean(r["totals"].get(group, {}).get("calls", 0) for r in results) / steps
        sent = statistics.mean(r["totals"].get(group, {}).get("sent_bytes", 0) for r in results) / steps
        analytic = statistics.mean(r["analytic"][group] for r in results)
        if calls == 0 and analytic == 0:
            continue
        ratio = f"{sent / analytic:9.2f}" if analytic else f"{'-':>9}"
        print(f"  {group:<15} {calls:>7.1f} {sent / 1e6:>10.3f} {analytic / 1e6:>16.3f} {ratio}")
    others = {g for r in results for g in r["totals"] if g not in GROUPS}
    for group in sorted(others):
        sent = statistics.mean(r["totals"].get(group, {}).get("sent_bytes", 0) for r in results) / steps
        print(f"  {group:<15} {'':>7} {sent / 1e6:>10.3f}   (not a named group)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("layouts", nargs="+", help="dpXtpYppZ or dpXcpWtpYppZ[:key=value,...]")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=3, help="counted optimizer steps")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted steps first")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a layout's ranks")
    parser.add_argument("--set", nargs="*", default=[], help="Hydra overrides for every layout")
    args = parser.parse_args()
    print(f"model={args.model}, {args.warmup} warm-up + {args.steps} counted steps, gloo on "
          f"{os.cpu_count()} CPUs; bytes are what each rank sends (ring algorithms)")
    for spec in args.layouts:
        layout, _, extra = spec.partition(":")
        match = re.fullmatch(r"dp(\d+)(?:cp(\d+))?(?:ep(\d+))?tp(\d+)pp(\d+)", layout)
        if match is None:
            parser.error(f"layout {layout!r} is not of the form dpXtpYppZ, dpXcpWtpYppZ or dpXepVtpYppZ")
        dp, cp, ep, tp, pp = match.groups()
        overrides = [f"model={args.model}", f"parallelism.dp={dp}", f"parallelism.cp={cp or 1}", f"parallelism.tp={tp}",
                     f"parallelism.pp={pp}", f"parallelism.ep={ep or 1}",
                     "logging.tensorboard=false", "data.prefetch=false", *args.set,
                     *[o for o in extra.split(",") if o]]
        report(spec, run_layout(compose(overrides, plain=True), args), args.steps)


if __name__ == "__main__":
    main()
