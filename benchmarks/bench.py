"""Single-process training throughput: nanoexp's Trainer against a plain PyTorch loop.

    python benchmarks/bench.py                                    # tiny and small, default options
    python benchmarks/bench.py --models small,moe_small           # dense vs MoE at the same active parameters
    python benchmarks/bench.py --models small --variants default,compile,recompute,fused
    python benchmarks/bench.py --models tiny --steps 20 tokens.micro_batch_size=8   # extra overrides
    python benchmarks/bench.py --wall --models small             # fresh runs timed from outside

For each model and variant, in one process, side by side:
  * nanoexp: the real `Trainer` built from the composed config, timed around `train_step`
    (engine, gradient sync, global-norm clipping, AdamW, zero_grad);
  * reference: Hugging Face's `LlamaForCausalLM` with the same shape (padded vocabulary
    included) and the same weights, trained by a plain loop: forward, float32 cross-entropy,
    backward per micro-batch, `clip_grad_norm_`, `torch.optim.AdamW` with the same settings
    and parameter groups, `zero_grad(set_to_none=True)`.
Both see the same micro-batches, dtype (autocast for bf16), thread count and accumulation.
The two alternate step by step (so background load hits both alike); after `--warmup` steps
each, the medians of `--steps` timed steps are reported, with ratio = reference time /
nanoexp time (> 1: nanoexp is faster), by wall clock and by process CPU time (less
sensitive to other load on the machine). The first-step losses of both are printed too: they
start from the same weights, so they must agree (a check that the comparison is fair).

MFU: each side's model FLOP/s (nanoexp/observe/metrics.py: 6 x the parameters a token goes through + attention)
over this machine's matmul peak (the first model's dtype, the same thread count) as nanoexp/observe/peak.py keeps it
(the best of a few 2048² matmuls now, or the best this machine ever measured if higher); it is printed first.

A mixture of experts: FLOPs and MFU count its active parameters. A Mixtral-shaped one (every layer MoE, no
shared experts, router=softmax_topk_normalized, e.g. conf/model/moe_small) is compared with transformers'
`MixtralForCausalLM`, a Qwen3-MoE-shaped one (q/k norms, no shared experts, e.g. conf/model/qwen3_moe_small) with
`Qwen3MoeForCausalLM`, each holding the same weights (exported with nanoexp.interop.hf's names and loaded by
`from_pretrained`, so transformers' default expert kernel runs; benchmarks/hf_reference.py); its loop adds HF's
load-balancing loss, weighted to match nanoexp's aux_loss_coef (see PlainLoop). Any other shape (e.g. moe_tiny) has
no Hugging Face counterpart: only nanoexp is timed, the reference columns say "-" (--wall skips it). When a run has
a dense model and a MoE, a closing line compares the MoE's tokens/s and MFU with the dense model's
whose active parameter count is nearest.

With --wall, the comparison is made from outside instead, as a user would time it: fresh processes of
`python train.py model=M tokens.train_steps=S` (everything default: metrics, TensorBoard, the final
evaluation and checkpoint) and of the plain loop (`--plain-run S`: HF's init, the same batches, nothing
else), each with S = 25 and 50; tokens/s = 25 steps' tokens / (wall(50) - wall(25)), so start-up and
the end of the run cancel out. The four runs alternate, `--repeats` times; medians are reported.

Variants switch the same option on both sides: compile (each decoder block compiled),
recompute (activation checkpointing per block), fused (fused AdamW), fp8 and fp8_rowwise (model.fp8; the
reference converts the same linears with torchao's convert_to_float8_training, emulated where nanoexp's are; MFU
stays against the float32 peak, so that the variants compare); moe_loop runs a MoE's experts with the loop kernel
(model.moe.expert_kernel; the reference and a dense model as in default); the saved-activation
bytes of one micro-batch are reported for every variant (recompute saves most of them).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from nanoexp.config import global_batch_size
from nanoexp.interop.hf import hf_mismatch, hf_tensors
from nanoexp.instruments.memory import saved_activation_bytes
from nanoexp.observe.metrics import flops_per_token
from nanoexp.model.shape import model_shape
from nanoexp.model.llama import count_active_parameters, count_parameters
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.observe.peak import node_peak

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a file: the repository root
from benchmarks.harness import compose, in_turns  # noqa: E402
from benchmarks.hf_reference import PlainLoop  # noqa: E402

VARIANTS = {   # name -> nanoexp overrides (the reference loop switches the same thing on)
    "default": [],
    "compile": ["model.compile=true"],
    "recompute": ["parallelism.recompute=full"], "selective": ["parallelism.recompute=selective"],
    "fused": ["optimizer.optimizer_factory.torch_adam_is_fused=true"],
    "fp8": ["model.fp8.enabled=true"],
    "fp8_rowwise": ["model.fp8.enabled=true", "model.fp8.recipe=rowwise"],
    "moe_loop": ["model.moe.expert_kernel=loop"],   # a MoE's experts one matmul each; the reference as in default
}


def build_trainer(cfg, run_dir: str):
    from nanoexp.runtime.trainer import Trainer
    return Trainer(cfg, ParallelContext(Layout.from_config(cfg)), run_dir)


def nanoexp_activation_bytes(trainer, mb) -> int:
    """The step runner measures what its first forward saves for backward itself (`saved_bytes`, with the same
    counter as plain_activation_bytes); a counter around it would see nothing, as the innermost hooks win."""
    trainer.runner.saved_bytes = None
    trainer.forward_backward([trainer.runner.prepare(mb)])   # the first phases of a step
    trainer.sync_gradients()
    trainer.grad_sync.zero_grad()
    return trainer.runner.saved_bytes


def plain_activation_bytes(plain, mb) -> int:
    with saved_activation_bytes(plain.model.parameters()) as counter:
        loss = plain.losses(mb)[1]
    loss.backward()
    plain.optimizer.zero_grad(set_to_none=True)
    return counter.bytes


def time_steps(runners: dict, steps: list, warmup: int, lr: float) -> tuple[dict, dict, dict]:
    """Every runner trains on the same steps, their order alternating each step so that neither always runs
    after the other: the timed steps' wall and CPU seconds per runner, and each one's step-1 loss."""
    times, cpu_times, first = {name: [] for name in runners}, {name: [] for name in runners}, {}
    for i, (name, runner) in in_turns(list(runners.items()), len(steps)):
        start, cpu_start = time.perf_counter(), time.process_time()
        out = runner.train_step(steps[i], lr)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        first.setdefault(name, out[0] if isinstance(out, tuple) else out)
        if i >= warmup:
            times[name].append(elapsed)
            cpu_times[name].append(cpu)
    return times, cpu_times, first


def bench_one(model: str, variant: str, args, extra: list[str], peak_tflops: float | None) -> dict:
    """One model and variant: per side ("nanoexp", and "plain" when HF has the model) the median step time,
    tokens/s, CPU time, MFU, step-1 loss and saved-activation MB."""
    cfg = compose([f"model={model}", "logging.tensorboard=false", "data.prefetch=false",
                   *VARIANTS[variant], *extra], world_size=1)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = build_trainer(cfg, run_dir)
        shape = trainer.shape
        runners = {"nanoexp": trainer}
        if not hf_mismatch(shape):
            runners["plain"] = PlainLoop(cfg, shape, hf_tensors(trainer.model))
        steps = [trainer.batches.next_step() for _ in range(args.warmup + args.steps)]
        trainer.batches.close()
        act = {name: (nanoexp_activation_bytes if name == "nanoexp" else plain_activation_bytes)(r, steps[0][0])
               for name, r in runners.items()}
        times, cpu_times, first = time_steps(runners, steps, args.warmup,
                                             cfg.optimizer.learning_rate_scheduler.learning_rate)
    tokens = global_batch_size(cfg) * cfg.tokens.sequence_length
    flops = flops_per_token(shape, cfg.tokens.sequence_length) * tokens   # model FLOPs per step
    sides = {}
    for name in runners:
        t, cpu = statistics.median(times[name]), statistics.median(cpu_times[name])
        sides[name] = {"ms": 1e3 * t, "tok_s": tokens / t, "cpu_ms": 1e3 * cpu, "loss": first[name],
                       "mfu": flops / t / 1e12 / peak_tflops if peak_tflops else None, "act_mb": act[name] / 2**20}
    return {"model": model, "variant": variant, "tokens_per_step": tokens, "moe": shape.moe is not None,
            "parameters": count_parameters(shape), "active": count_active_parameters(shape), "sides": sides,
            "no_reference": hf_mismatch(shape),
            "reference": describe_reference(runners["plain"].model) if "plain" in runners else None}


def describe_reference(model) -> str:
    """The HF class, transformers version and, for a MoE, the expert kernel transformers chose."""
    import transformers
    kernel = getattr(model.config, "_experts_implementation", None)
    return (f"{type(model).__name__} (transformers {transformers.__version__}"
            f"{f', experts_implementation={kernel}' if kernel else ''})")


def cell(side: dict | None, key: str, spec: str) -> str:
    """side[key] formatted by `spec`; "-" when there is no such side (no reference) or value (no peak)."""
    value = side.get(key) if side else None
    return "-" if value is None else format(value, spec)


def table_row(r: dict, width: int) -> str:
    """One result as a row of the table main() prints."""
    n, p = r["sides"]["nanoexp"], r["sides"].get("plain")
    ratio = f"{p['ms'] / n['ms']:.2f}" if p else "-"
    cpu_ratio = f"{p['cpu_ms'] / n['cpu_ms']:.2f}" if p else "-"
    return (f"{r['model']:<{width}} {r['variant']:<10} {r['tokens_per_step']:>11} {n['ms']:>10.1f} "
            f"{cell(p, 'ms', '.1f'):>9} {n['tok_s']:>13.0f} {cell(p, 'tok_s', '.0f'):>11} {ratio:>6} "
            f"{n['cpu_ms']:>7.0f}/{cell(p, 'cpu_ms', '.0f'):<7} {cpu_ratio:>9} "
            f"{cell(n, 'mfu', '.1%'):>6}/{cell(p, 'mfu', '.1%'):<6} "
            f"{n['act_mb']:>5.1f}/{cell(p, 'act_mb', '.1f'):<6} {n['loss']:>8.4f}/{cell(p, 'loss', '.4f')}")


def moe_comparisons(results: list[dict]) -> list[str]:
    """For each MoE result, a line comparing it with the dense result of the same variant whose active
    parameter count is nearest (none when the run has no dense model)."""
    lines = []
    for moe in (r for r in results if r["moe"]):
        dense = [r for r in results if not r["moe"] and r["variant"] == moe["variant"]]
        if not dense:
            continue
        d = min(dense, key=lambda r: abs(r["active"] - moe["active"]))
        parts = []
        for side in ("nanoexp", "plain"):
            a, b = moe["sides"].get(side), d["sides"].get(side)
            if a and b:
                mfu = (f" (MFU {100 * a['mfu']:.1f}% vs {100 * b['mfu']:.1f}%)" if a["mfu"] and b["mfu"] else "")
                parts.append(f"{side} {a['tok_s'] / b['tok_s']:.2f}x the tokens/s{mfu}")
        lines.append(f"{moe['model']} vs {d['model']} ({moe['variant']}): {moe['active'] / 1e6:.2f}M active of "
                     f"{moe['parameters'] / 1e6:.2f}M parameters vs {d['active'] / 1e6:.2f}M dense; "
                     + ", ".join(parts))
    return lines


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plain_run(model: str, steps: int, extra: list[str]) -> None:
    """The plain side of --wall: HF Llama (its own init) trained `steps` steps on the run's batches."""
    from nanoexp.data import build_datasets
    from nanoexp.data.loader import TrainBatches
    cfg = compose([f"model={model}", *extra], world_size=1)
    train_set, _, _ = build_datasets(cfg)
    batches = TrainBatches(train_set, global_batch_size(cfg), cfg.tokens.micro_batch_size, 0, 1, cfg.general.seed,
                           prefetch=False)
    plain = PlainLoop(cfg, model_shape(cfg))
    for _ in range(steps):
        plain.train_step(batches.next_step(), cfg.optimizer.learning_rate_scheduler.learning_rate)


def wall_seconds(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return time.perf_counter() - start


def bench_wall(model: str, repeats: int, extra: list[str]) -> dict:
    """Tokens/s of each side from the wall time of 50-step minus 25-step runs, fresh processes."""
    cfg = compose([f"model={model}", *extra], world_size=1)
    tokens = global_batch_size(cfg) * cfg.tokens.sequence_length
    seconds = {("nanoexp", 25): [], ("nanoexp", 50): [], ("plain", 25): [], ("plain", 50): []}
    with tempfile.TemporaryDirectory() as out:
        for i, (side, steps) in in_turns(list(seconds), repeats):
            command = ([sys.executable, "train.py", f"model={model}", f"tokens.train_steps={steps}",
                        f"hydra.run.dir={out}/{i}_{steps}", *extra] if side == "nanoexp" else
                       [sys.executable, "benchmarks/bench.py", "--plain-run", str(steps), f"--models={model}", *extra])
            seconds[side, steps].append(wall_seconds(command))
    per_25 = {side: statistics.median(seconds[side, 50]) - statistics.median(seconds[side, 25])
              for side in ("nanoexp", "plain")}
    return {"model": model, "nanoexp_tok_s": 25 * tokens / per_25["nanoexp"], "plain_tok_s": 25 * tokens / per_25["plain"],
            "ratio": per_25["plain"] / per_25["nanoexp"], "seconds": {f"{k[0]} {k[1]}": v for k, v in seconds.items()}}


def main_wall(args) -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads (torch's default, as train.py); wall time "
          f"of fresh 50-step minus 25-step runs, medians of {args.repeats}; ratio = nanoexp tok/s / plain tok/s")
    for model in args.models:
        shape = model_shape(compose([f"model={model}", *args.overrides], world_size=1))
        if hf_mismatch(shape):
            print(f"{model}: no Hugging Face reference ({hf_mismatch(shape)}), skipped")
            continue
        r = bench_wall(model, args.repeats, args.overrides)
        print(f"{model}: nanoexp {r['nanoexp_tok_s']:,.0f} tok/s, plain {r['plain_tok_s']:,.0f} tok/s, "
              f"ratio {r['ratio']:.3f}", flush=True)
        for run, times in r["seconds"].items():
            print(f"  {run:>11} steps: " + ", ".join(f"{t:.2f} s" for t in times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"], help="comma- or space-separated")
    parser.add_argument("--variants", default="default", help="comma-separated: " + ",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile happens here)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: robust on a shared machine; CPU ms then = compute)")
    parser.add_argument("--wall", action="store_true", help="time fresh runs from outside (see above)")
    parser.add_argument("--repeats", type=int, default=3, help="--wall: runs of each kind (medians reported)")
    parser.add_argument("--plain-run", type=int, metavar="STEPS", help=argparse.SUPPRESS)   # --wall's plain side
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for both sides")
    args = parser.parse_args()
    args.models = [m for item in args.models for m in item.split(",") if m]   # "small,moe_small" or "small moe_small"
    if args.plain_run is not None:
        return plain_run(args.models[0], args.plain_run, args.overrides)
    if args.wall:
        return main_wall(args)
    torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            parser.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    peak = node_peak(compose([f"model={args.models[0]}", *args.overrides], world_size=1).model.dtype, args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.warmup} warm-up + {args.steps} timed steps, "
          f"medians; ratio = plain / nanoexp step time (> 1: nanoexp faster); CPU = process CPU time per step; "
          f"MFU = model FLOP/s / peak\npeak: {peak.tflops * 1e3:.1f} GFLOP/s ({peak.source})")
    width = max(5, *map(len, args.models))
    print(f"{'model':<{width}} {'variant':<10} {'tokens/step':>11} {'nanoexp ms':>10} {'plain ms':>9} "
          f"{'nanoexp tok/s':>13} {'plain tok/s':>11} {'ratio':>6} {'CPU ms n/p':>15} {'CPU ratio':>9} "
          f"{'MFU n/p':>13} {'act MB n/p':>12} {'step-1 loss n/p':>17}")
    results = []
    for model in args.models:
        for variant in variants:
            results.append(bench_one(model, variant, args, args.overrides, peak.tflops))
            print(table_row(results[-1], width), flush=True)
    for r in (r for r in results if r["moe"] and r["variant"] == variants[0]):
        print(f"{r['model']}: " + (f"reference {r['reference']}" if r["reference"] else
                                    f"no Hugging Face reference ({r['no_reference']})"))
    for line in moe_comparisons(results):
        print(line)

if __name__ == "__main__":
    main()
