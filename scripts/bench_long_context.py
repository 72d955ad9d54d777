"""Long context under context parallelism: peak memory per rank and attention work balance, cp = 1, 2, 4.

    python scripts/bench_long_context.py                       # model=tiny, 4096 tokens, cp 1 2 4, 2 steps
    python scripts/bench_long_context.py --cp 1 2 --steps 1 --sequence-length 8192

Each cp runs `python train.py model=tiny tokens.sequence_length=S tokens.global_batch_size=4
tokens.micro_batch_size=1 model.model_config.max_position_embeddings=S parallelism.cp=CP` (dp = tp = pp = 1)
for a few steps with `logging.exact_cpu_memory=true`, so that the CPU peak tracks the live tensors, and
prints per rank the measured peak above the runtime baseline next to nanoexp/memory.py's estimate (and
its activation part, which should fall as 1/cp).

Attention work is counted, not timed (4 ranks on a few cores make wall time meaningless): the score
elements q·k a rank computes per layer, head and sample, from ring_attention.ring_blocks (a full
chunk x chunk block is c² elements, a causal diagonal one c(c+1)/2, c = S / 2cp), against the contiguous
split a plain ring would use (rank r holding tokens [rL, (r+1)L), L = S/cp, whose queries see r·L earlier
keys plus a causal L x L block). Balance is max / min over the ranks.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from nanoexp.config import compose
from nanoexp.memory import MB, estimate, total
from nanoexp.model.build import model_shape
from nanoexp.parallel.ring_attention import ring_blocks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def zigzag_scores(seq_len: int, cp: int, cp_rank: int) -> int:
    """Score elements cp rank `cp_rank` computes under the zig-zag split, per layer, head and sample."""
    c = seq_len // (2 * cp)
    return sum(c * (c + 1) // 2 if causal else c * c for step in ring_blocks(cp, cp_rank) for _, _, causal in step)


def contiguous_scores(seq_len: int, cp: int, cp_rank: int) -> int:
    """The same for the contiguous split: L queries see cp_rank·L earlier keys and a causal L x L block."""
    length = seq_len // cp
    return length * cp_rank * length + length * (length + 1) // 2


def balance(counts: list[int]) -> float:
    return max(counts) / min(counts)


def overrides(args, cp: int) -> list[str]:
    s = args.sequence_length
    return [f"model={args.model}", f"tokens.sequence_length={s}", f"model.model_config.max_position_embeddings={s}",
            "tokens.global_batch_size=4", "tokens.micro_batch_size=1", f"parallelism.cp={cp}",
            f"tokens.train_steps={args.steps}", "tokens.val_check_interval=0", "tokens.limit_val_batches=1",
            "optimizer.learning_rate_scheduler.lr_warmup_steps=1", "checkpoint.save_final_state=false",
            "logging.tensorboard=false", "logging.exact_cpu_memory=true"]


def run(args, cp: int) -> dict:
    """summary.json of one run."""
    with tempfile.TemporaryDirectory() as run_dir:
        result = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *overrides(args, cp),
                                 f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=args.timeout)
        if result.returncode != 0:
            raise RuntimeError(f"cp={cp} failed:\n{result.stderr[-2000:]}")
        with open(os.path.join(run_dir, "summary.json")) as f:
            return json.load(f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--sequence-length", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps (the peak comes from step 2 on)")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    s = args.sequence_length
    print(f"model={args.model}, sequence {s}, micro-batch 1, global batch 4, {args.steps} steps; MB per rank above "
          "the runtime baseline; attention work = score elements per layer, head and sample (M)")
    print(f"{'cp':>3}{'rank':>5}{'measured':>10}{'estimate':>10}{'activ est':>10}{'zig-zag M':>11}{'contig. M':>11}")
    for cp in args.cp:
        summary = run(args, cp)
        cfg = compose(overrides(args, cp))
        parts = estimate(cfg, model_shape(cfg), 0)
        zigzag = [zigzag_scores(s, cp, r) for r in range(cp)]
        contiguous = [contiguous_scores(s, cp, r) for r in range(cp)]
        for rank, peak in enumerate(summary["peak_memory_mb_per_rank"]):
            print(f"{cp:>3}{rank:>5}{peak - summary['baseline_memory_mb']:>10.0f}{total(parts) / MB:>10.0f}"
                  f"{parts['activations'] / MB:>10.0f}{zigzag[rank] / 1e6:>11.3f}{contiguous[rank] / 1e6:>11.3f}")
        print(f"    cp={cp}: attention work max/min zig-zag {balance(zigzag):.3f}, "
              f"contiguous {balance(contiguous):.3f}; total score elements {sum(zigzag) / 1e6:.3f} M (full causal {s * (s + 1) / 2e6:.3f} M)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
