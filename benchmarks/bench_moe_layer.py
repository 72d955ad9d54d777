"""A MoE layer's forward and backward, the grouped expert kernel against the loop, side by side in one process.

    python benchmarks/bench_moe_layer.py                          # the default shapes, 1 thread
    python benchmarks/bench_moe_layer.py --shapes qwen3_moe_small --threads 2 --rounds 30

Each shape is a conf/model file's MoE layer (its hidden size and `model.moe`: experts, width, top-k, shared
experts, router, kernel) on `--tokens` tokens (a micro-batch: 4 x 128 by default), in float32, built once per
kernel with the same weights and inputs (nanoexp.model.moe.MoE, one process: its route is local). A timed round is
one forward (router, top-k, sort, the experts, the weighted scatter, the losses) and one backward of the layer; the
kernels take turns round by round (their order alternating, so that background load hits both alike), and the
medians of `--rounds` rounds after `--warmup` are reported, with the routed experts' matmul FLOP/s
(tokens x top_k x 3 matmuls of hidden x width, x 2 for a multiply-add, x 3 for forward and backward) as a
fraction of this machine's float32 matmul peak on the same threads (nanoexp/observe/peak.py's `node_peak`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a file: the repository root
from benchmarks.harness import compose, in_turns  # noqa: E402
from nanoexp.model.experts import EXPERT_KERNELS  # noqa: E402
from nanoexp.model.moe import MoE, MoeLosses  # noqa: E402
from nanoexp.observe.peak import node_peak  # noqa: E402
from nanoexp.model.shape import model_shape  # noqa: E402

SHAPES = ("qwen3_moe_small", "qwen3_moe_tiny", "olmoe_1b_7b:hidden=512")   # --shapes


def layer_of(spec: str, kernel: str) -> MoE:
    """The MoE layer of conf/model/<name> ("<name>:hidden=<h>" overrides its hidden size), with `kernel`."""
    name, _, hidden = spec.partition(":hidden=")
    overrides = [f"model={name}", f"model.moe.expert_kernel={kernel}"]
    overrides += [f"model.model_config.hidden_size={hidden}"] if hidden else []
    shape = model_shape(compose(overrides, world_size=1))
    torch.manual_seed(0)
    layer = MoE(shape.hidden_size, shape.moe, MoeLosses(shape.moe, [0]), 0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return layer


def fwd_bwd(layer: MoE, x: torch.Tensor, grad: torch.Tensor) -> float:
    start = time.perf_counter()
    layer(x).backward(grad)
    seconds = time.perf_counter() - start
    layer.zero_grad(set_to_none=True)
    return seconds


def bench_shape(spec: str, tokens: int, warmup: int, rounds: int) -> dict:
    layers = {kernel: layer_of(spec, kernel) for kernel in EXPERT_KERNELS}
    moe, hidden = layers["loop"].moe, layers["loop"].router.in_features
    x = torch.randn(tokens // 128, 128, hidden, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    times = {kernel: [] for kernel in layers}
    for i, kernel in in_turns(list(layers), warmup + rounds):
        seconds = fwd_bwd(layers[kernel], x, grad)
        if i >= warmup:
            times[kernel].append(seconds)
    flops = 18 * tokens * moe.top_k * hidden * moe.intermediate_size
    return {"shape": spec, "experts": moe.num_experts, "top_k": moe.top_k, "hidden": hidden,
            "width": moe.intermediate_size, "flops": flops,
            "ms": {kernel: 1e3 * statistics.median(t) for kernel, t in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated conf/model names[:hidden=h]")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per forward (a multiple of 128)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peak = node_peak("float32", args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.tokens} tokens, float32, medians of "
          f"{args.rounds} rounds after {args.warmup}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
          f"cores\npeak: {peak.tflops * 1e3:.1f} GFLOP/s ({peak.source})")
    print(f"{'shape':<24} {'E':>4} {'k':>3} {'hidden':>6} {'width':>5} {'grouped_mm ms':>13} {'loop ms':>9} "
          f"{'speed-up':>8} {'MFU grouped/loop':>17}")
    for spec in args.shapes.split(","):
        r = bench_shape(spec, args.tokens, args.warmup, args.rounds)
        grouped, loop = r["ms"]["grouped_mm"], r["ms"]["loop"]
        mfu = [r["flops"] / (ms / 1e3) / (peak.tflops * 1e12) for ms in (grouped, loop)]
        print(f"{spec:<24} {r['experts']:>4} {r['top_k']:>3} {r['hidden']:>6} {r['width']:>5} {grouped:>13.2f} "
              f"{loop:>9.2f} {loop / grouped:>7.2f}x {mfu[0]:>8.1%}/{mfu[1]:<8.1%}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
