"""Long context under context parallelism: peak memory per rank and attention work balance, cp = 1, 2, 4.

    python benchmarks/bench_long_context.py                       # model=tiny, 4096 tokens, cp 1 2 4, 2 steps
    python benchmarks/bench_long_context.py --cp 1 2 --steps 1 --sequence-length 8192
    python benchmarks/bench_long_context.py --cp 2 4 --cp-mode all_gather     # peaks of the all-gather cp mode
    python benchmarks/bench_long_context.py --tiles 64 128 256 512 1024     # the tile size of ring attention

Each cp runs `python train.py model=tiny tokens.sequence_length=S tokens.global_batch_size=4
tokens.micro_batch_size=1 model.model_config.max_position_embeddings=S parallelism.cp=CP` (dp = tp = pp = 1)
for a few steps with `logging.exact_cpu_memory=true`, so that the CPU peak tracks the live tensors, and
prints per rank the measured peak above the runtime baseline next to nanoexp/observe/memory_estimate.py's estimate (and
its activation part, which should fall as 1/cp). The same run with a short sequence (--short-length)
holds the same weights, optimizer and fixed buffers: the difference of the two peaks (Δ) is what the
long sequence adds, to be set against the estimate's difference.

Attention work is counted (4 ranks on a few cores make wall time meaningless): the score elements
q·k a rank computes per layer, head and sample, from ring_attention.ring_blocks (a full chunk x chunk
block is c² elements, a causal diagonal one c(c+1)/2, c = S / 2cp), against the contiguous split a plain
ring would use (rank r holding tokens [rL, (r+1)L), L = S/cp, whose queries see r·L earlier keys plus a
causal L x L block). Balance is max / min over the ranks.

The same work is also timed, as CPU time rather than wall time: in this one process, on one thread, each
rank's attention blocks of one layer and sample (forward and backward, with the tiled kernels of
nanoexp/parallel/context_parallel/blocks.py) run alone under time.thread_time, best of --repeats taken in turns,
so other jobs on the machine slow them less than they slow wall clocks.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from nanoexp.config import compose
from nanoexp.observe.memory_estimate import MB, estimate, total
from nanoexp.model.shape import model_shape
from nanoexp.parallel.context_parallel import blocks as attention_blocks
from nanoexp.parallel.context_parallel.blocks import attend_block, attend_block_backward
from nanoexp.parallel.context_parallel.ring import ring_blocks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # run as a file: the repository root
from benchmarks.harness import in_turns, matmul_peak  # noqa: E402


def zigzag_scores(seq_len: int, cp: int, cp_rank: int) -> int:
    """Score elements cp rank `cp_rank` computes under the zig-zag split, per layer, head and sample."""
    c = seq_len // (2 * cp)
    return sum(c * (c + 1) // 2 if causal else c * c for step in ring_blocks(cp, cp_rank) for _, _, causal in step)


def contiguous_scores(seq_len: int, cp: int, cp_rank: int) -> int:
    """The same for the contiguous split: L queries see cp_rank·L earlier keys and a causal L x L block."""
    length = seq_len // cp
    return length * cp_rank * length + length * (length + 1) // 2


def zigzag_blocks(seq_len: int, cp: int, cp_rank: int) -> list[tuple[int, int, bool]]:
    """(query rows, key columns, causal) of every block a zig-zag rank computes: chunk x chunk blocks."""
    c = seq_len // (2 * cp)
    return [(c, c, causal) for step in ring_blocks(cp, cp_rank) for _, _, causal in step]


def contiguous_blocks(seq_len: int, cp: int, cp_rank: int) -> list[tuple[int, int, bool]]:
    """The same for the contiguous split: the earlier keys in one full block, then the causal diagonal."""
    length = seq_len // cp
    return [(length, length * cp_rank, False)] * (cp_rank > 0) + [(length, length, True)]


def cpu_seconds(blocks, heads: int, kv_heads: int, head_dim: int) -> float:
    """Thread CPU time of the blocks' forward and backward (one sample, one layer)."""
    gen = torch.Generator().manual_seed(0)
    spent = 0.0
    for n, m, causal in blocks:
        q, grad_out = (torch.randn(1, heads, n, head_dim, generator=gen) for _ in range(2))
        k, v = (torch.randn(1, kv_heads, m, head_dim, generator=gen) for _ in range(2))
        start = time.thread_time()
        out, lse = torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"))
        attend_block(q, k, v, head_dim ** -0.5, causal, out, lse)
        grads = [torch.zeros_like(x) for x in (q, k, v)]
        attend_block_backward(q, k, v, grad_out, lse, (grad_out * out).sum(-1), head_dim ** -0.5, causal, *grads)
        spent += time.thread_time() - start
    return spent


def best_cpu_ms(work: list, shape, repeats: int) -> list[float]:
    """Each item's (a rank's blocks) best CPU ms of `repeats`, taken in turns so that a busy spell of the
    machine slows one round of every rank rather than every round of one rank."""
    best = [float("inf")] * len(work)
    for _, (i, blocks) in in_turns(list(enumerate(work)), repeats, alternate=False):
        best[i] = min(best[i], 1e3 * cpu_seconds(blocks, shape.num_attention_heads, shape.num_key_value_heads,
                                                 shape.head_dim))
    return best


def tile_timings(args, shape) -> None:
    """CPU ms of one full and one causal chunk x chunk block (cp=2's chunk: s/4) with each tile size of
    --tiles, the choice of attention_blocks.TILE; and the full block's rate as a fraction of this thread's
    2048² float32 matmul. A block's matmuls: q·k and p·v forward, q·k again and four gradient products
    backward, 2·n·m·d FLOPs each per head."""
    chunk = args.sequence_length // 4
    peak = matmul_peak("float32", threads=1, device="cpu").tflops * 1e3   # GFLOP/s
    flops = 7 * 2 * chunk * chunk * shape.head_dim * shape.num_attention_heads
    print(f"one thread's 2048² float32 matmul: {peak:.1f} GFLOP/s; a full block = {flops / 1e9:.3f} GFLOP")
    for tile in args.tiles:
        attention_blocks.TILE = tile
        ms = best_cpu_ms([[(chunk, chunk, False)], [(chunk, chunk, True)]], shape, args.repeats)
        rate = flops / ms[0] / 1e6
        print(f"tile {tile:>5}: {chunk} x {chunk} block, forward + backward {ms[0]:.1f} ms full ({rate:.1f} GFLOP/s, "
              f"{rate / peak:.2f} of the matmul), {ms[1]:.1f} ms causal")


def balance(counts: list[float]) -> float:
    return max(counts) / min(counts)


def overrides(args, cp: int, s: int) -> list[str]:
    return [f"model={args.model}", f"tokens.sequence_length={s}", f"model.model_config.max_position_embeddings={s}",
            "tokens.global_batch_size=4", "tokens.micro_batch_size=1", f"parallelism.cp={cp}",
            f"tokens.train_steps={args.steps}", "tokens.val_check_interval=0", "tokens.limit_val_batches=1",
            "optimizer.learning_rate_scheduler.lr_warmup_steps=1", "checkpoint.save_final_state=false",
            "logging.tensorboard=false", "logging.exact_cpu_memory=true", f"parallelism.cp_mode={args.cp_mode}"]


def run(args, cp: int, s: int) -> dict:
    """summary.json of one run with sequence length s."""
    with tempfile.TemporaryDirectory() as run_dir:
        result = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *overrides(args, cp, s),
                                 f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=args.timeout)
        if result.returncode != 0:
            raise RuntimeError(f"cp={cp} failed:\n{result.stderr[-2000:]}")
        with open(os.path.join(run_dir, "summary.json")) as f:
            return json.load(f)


def report(args, cp: int) -> None:
    """One cp's rows: memory of a real run (unless --work-only), and attention work counted and timed."""
    s, short = args.sequence_length, args.short_length
    cfg = compose(overrides(args, cp, s))
    shape = model_shape(cfg)
    peaks = {length: [float("nan")] * cp for length in (s, short)}
    for length in peaks if not args.work_only else ():
        summary = run(args, cp, length)
        peaks[length] = [peak - summary["baseline_memory_mb"] for peak in summary["peak_memory_mb_per_rank"]]
    parts, short_parts = estimate(cfg, shape, 0), estimate(compose(overrides(args, cp, short)), shape, 0)
    growth = (total(parts) - total(short_parts)) / MB   # what the longer sequence adds: activations only
    zz, co = ([scores(s, cp, r) for r in range(cp)] for scores in (zigzag_scores, contiguous_scores))
    timed = best_cpu_ms([blocks(s, cp, r) for blocks in (zigzag_blocks, contiguous_blocks) for r in range(cp)],
                        shape, args.repeats)
    zz_ms, co_ms = timed[:cp], timed[cp:]
    for r in range(cp):
        print(f"{cp:>3}{r:>5}{peaks[s][r]:>10.0f}{total(parts) / MB:>10.0f}{parts['activations'] / MB:>10.0f}"
              f"{peaks[s][r] - peaks[short][r]:>9.0f}{growth:>9.0f}{zz[r] / 1e6:>11.3f}{co[r] / 1e6:>11.3f}{zz_ms[r]:>10.1f}{co_ms[r]:>10.1f}")
    print(f"    cp={cp}: max/min zig-zag {balance(zz):.3f} counted, {balance(zz_ms):.3f} CPU time; contiguous "
          f"{balance(co):.3f} counted, {balance(co_ms):.3f} CPU time; score elements in all "
          f"{sum(zz) / 1e6:.3f} M (the causal triangle {s * (s + 1) / 2e6:.3f} M)", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--cp-mode", default="ring", choices=["ring", "all_gather"], help="parallelism.cp_mode")
    parser.add_argument("--sequence-length", type=int, default=4096)
    parser.add_argument("--short-length", type=int, default=256,
                        help="the same run with this sequence length: the difference of the peaks is what the "
                             "long sequence adds (activations)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps (the peak comes from step 2 on)")
    parser.add_argument("--repeats", type=int, default=5, help="timings of each rank's blocks (the best counts)")
    parser.add_argument("--work-only", action="store_true", help="count and time the attention work; no runs")
    parser.add_argument("--tiles", type=int, nargs="*", help="only time one block with each of these tile sizes")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)   # thread CPU time measures the work of one thread
    if args.tiles:
        return tile_timings(args, model_shape(compose(overrides(args, 1, args.sequence_length))))
    print(f"model={args.model}, cp_mode={args.cp_mode}, sequence {args.sequence_length}, micro-batch 1, global batch 4, {args.steps} steps; "
          "MB per rank above the runtime baseline (Δ: minus the same at --short-length); attention work per layer and sample: score elements per head "
          "(M) and forward + backward CPU ms (one thread)")
    print(f"{'cp':>3}{'rank':>5}{'measured':>10}{'estimate':>10}{'activ est':>10}{'Δ meas':>9}{'Δ est':>9}"
          f"{'zig-zag M':>11}{'contig. M':>11}"
          f"{'zz ms':>10}{'contig ms':>10}")
    for cp in args.cp:
        report(args, cp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
