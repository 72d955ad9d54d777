"""Single-process training throughput: nanoexp's Trainer against a plain PyTorch loop.

    python scripts/bench.py                                    # tiny and small, default options
    python scripts/bench.py --models small --variants default,compile,recompute,fused
    python scripts/bench.py --models tiny --steps 20 tokens.micro_batch_size=8   # extra overrides
    python scripts/bench.py --wall --models small             # fresh runs timed from outside

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

With --wall, the comparison is made from outside instead, as a user would time it: fresh processes of
`python train.py model=M tokens.train_steps=S` (everything default: metrics, TensorBoard, the final
evaluation and checkpoint) and of the plain loop (`--plain-run S`: HF's init, the same batches, nothing
else), each with S = 25 and 50; tokens/s = 25 steps' tokens / (wall(50) - wall(25)), so start-up and
the end of the run cancel out. The four runs alternate, `--repeats` times; medians are reported.

Variants switch the same option on both sides: compile (each decoder block compiled),
recompute (activation checkpointing per block), fused (fused AdamW); the saved-activation
bytes of one micro-batch are reported for every variant (recompute saves most of them).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from nanoexp.config import batch_accumulation, compose as compose_config, global_batch_size, normalize
from nanoexp.memory import saved_activation_bytes
from nanoexp.optim import parameter_groups
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.validation import validate

VARIANTS = {   # name -> nanoexp overrides (the reference loop switches the same thing on)
    "default": [],
    "compile": ["model.compile=true"],
    "recompute": ["parallelism.recompute_layer=true"],
    "fused": ["optimizer.optimizer_factory.torch_adam_is_fused=true"],
}


def compose(overrides: list[str]):
    """The config `python train.py <overrides>` runs with, checked for one process."""
    cfg = compose_config(overrides)
    normalize(cfg)
    validate(cfg, world_size=1)
    return cfg


def build_trainer(cfg, run_dir: str):
    from nanoexp.trainer import Trainer
    return Trainer(cfg, ParallelContext(Layout.from_config(cfg)), run_dir)


class PlainLoop:
    """HF LlamaForCausalLM of the model's shape, trained the obvious way; with `weights` (a state dict,
    e.g. `trainer.model`'s) it starts from those, else from HF's own init."""

    def __init__(self, cfg, s, weights: dict | None = None):
        from transformers import LlamaConfig, LlamaForCausalLM
        hf_cfg = LlamaConfig(hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                             num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
                             num_key_value_heads=s.num_key_value_heads, vocab_size=s.vocab_size,
                             max_position_embeddings=s.max_position_embeddings, rope_theta=s.rope_theta,
                             rms_norm_eps=s.rms_norm_eps, tie_word_embeddings=s.tie_word_embeddings,
                             attn_implementation="sdpa")
        self.model = LlamaForCausalLM(hf_cfg)
        if weights is not None:
            missing = self.model.load_state_dict(weights, strict=False)
            if missing.missing_keys or missing.unexpected_keys:
                raise RuntimeError(f"weights do not map onto the HF model: {missing}")
        self.model.train()
        if cfg.parallelism.recompute_layer:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.model.compile:
            for layer in self.model.model.layers:
                layer.compile()
        o, f = cfg.optimizer, cfg.optimizer.optimizer_factory
        fused = bool(f.torch_adam_is_fused)
        self.optimizer = torch.optim.AdamW(parameter_groups(self.model, o.weight_decay),
                                           lr=o.learning_rate_scheduler.learning_rate,
                                           betas=(f.adam_beta1, f.adam_beta2), eps=f.adam_eps,
                                           fused=fused or None, foreach=None if fused else True)
        self.clip, self.accumulation = o.clip_grad, batch_accumulation(cfg)
        self.autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if cfg.model.dtype == "bfloat16"
                         else contextlib.nullcontext())

    def loss(self, mb):
        with self.autocast:
            logits = self.model(input_ids=mb["input_ids"]).logits
        return F.cross_entropy(logits.float().flatten(0, 1), mb["labels"].flatten())

    def train_step(self, micro_batches, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = 0.0
        for mb in micro_batches:
            loss = self.loss(mb) / self.accumulation
            loss.backward()
            total += loss.item()
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


def nanoexp_activation_bytes(trainer, mb) -> int:
    with saved_activation_bytes(trainer.model.parameters()) as counter:
        loss = trainer.forward_step(mb, None)
    loss.backward()
    trainer.grad_sync.zero_grad()
    return counter.bytes


def plain_activation_bytes(plain, mb) -> int:
    with saved_activation_bytes(plain.model.parameters()) as counter:
        loss = plain.loss(mb)
    loss.backward()
    plain.optimizer.zero_grad(set_to_none=True)
    return counter.bytes


def bench_one(model: str, variant: str, args, extra: list[str]) -> dict:
    cfg = compose([f"model={model}", "logging.tensorboard=false", "data.prefetch=false",
                   *VARIANTS[variant], *extra])
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = build_trainer(cfg, run_dir)
        plain = PlainLoop(cfg, trainer.shape, trainer.model.state_dict())
        steps = [trainer.batches.next_step() for _ in range(args.warmup + args.steps)]
        trainer.batches.close()
        act_nano = nanoexp_activation_bytes(trainer, steps[0][0])
        act_plain = plain_activation_bytes(plain, steps[0][0])
        lr = cfg.optimizer.learning_rate_scheduler.learning_rate
        times = {"nanoexp": [], "plain": []}
        cpu_times = {"nanoexp": [], "plain": []}
        first = {}
        for i, micro_batches in enumerate(steps):
            # Alternate the order each step so that neither side always runs after the other.
            sides = [("nanoexp", trainer), ("plain", plain)]
            for name, runner in (sides if i % 2 == 0 else sides[::-1]):
                start, cpu_start = time.perf_counter(), time.process_time()
                out = runner.train_step(micro_batches, lr)
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
                loss = out[0] if isinstance(out, tuple) else out
                first.setdefault(name, loss)
                if i >= args.warmup:
                    times[name].append(elapsed)
                    cpu_times[name].append(cpu)
    tokens = global_batch_size(cfg) * cfg.tokens.sequence_length
    t_nano, t_plain = statistics.median(times["nanoexp"]), statistics.median(times["plain"])
    cpu_nano, cpu_plain = statistics.median(cpu_times["nanoexp"]), statistics.median(cpu_times["plain"])
    return {"model": model, "variant": variant, "tokens_per_step": tokens,
            "nanoexp_ms": 1e3 * t_nano, "plain_ms": 1e3 * t_plain,
            "nanoexp_tok_s": tokens / t_nano, "plain_tok_s": tokens / t_plain, "ratio": t_plain / t_nano,
            "cpu_ratio": cpu_plain / cpu_nano, "nanoexp_cpu_ms": 1e3 * cpu_nano, "plain_cpu_ms": 1e3 * cpu_plain,
            "loss_nanoexp": first["nanoexp"], "loss_plain": first["plain"],
            "act_mb_nanoexp": act_nano / 2**20, "act_mb_plain": act_plain / 2**20}


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plain_run(model: str, steps: int, extra: list[str]) -> None:
    """The plain side of --wall: HF Llama (its own init) trained `steps` steps on the run's batches."""
    from nanoexp.data import build_datasets
    from nanoexp.data.loader import TrainBatches
    from nanoexp.model.build import model_shape
    cfg = compose([f"model={model}", *extra])
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
    cfg = compose([f"model={model}", *extra])
    tokens = global_batch_size(cfg) * cfg.tokens.sequence_length
    seconds = {("nanoexp", 25): [], ("nanoexp", 50): [], ("plain", 25): [], ("plain", 50): []}
    with tempfile.TemporaryDirectory() as out:
        for i in range(repeats):
            for side, steps in (list(seconds) if i % 2 == 0 else list(seconds)[::-1]):
                command = ([sys.executable, "train.py", f"model={model}", f"tokens.train_steps={steps}",
                            f"hydra.run.dir={out}/{i}_{steps}", *extra] if side == "nanoexp" else
                           [sys.executable, "scripts/bench.py", "--plain-run", str(steps), "--models", model, *extra])
                seconds[side, steps].append(wall_seconds(command))
    per_25 = {side: statistics.median(seconds[side, 50]) - statistics.median(seconds[side, 25])
              for side in ("nanoexp", "plain")}
    return {"model": model, "nanoexp_tok_s": 25 * tokens / per_25["nanoexp"], "plain_tok_s": 25 * tokens / per_25["plain"],
            "ratio": per_25["plain"] / per_25["nanoexp"], "seconds": {f"{k[0]} {k[1]}": v for k, v in seconds.items()}}


def main_wall(args) -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads (torch's default, as train.py); wall time "
          f"of fresh 50-step minus 25-step runs, medians of {args.repeats}; ratio = nanoexp tok/s / plain tok/s")
    for model in args.models:
        r = bench_wall(model, args.repeats, args.overrides)
        print(f"{model}: nanoexp {r['nanoexp_tok_s']:,.0f} tok/s, plain {r['plain_tok_s']:,.0f} tok/s, "
              f"ratio {r['ratio']:.3f}", flush=True)
        for run, times in r["seconds"].items():
            print(f"  {run:>11} steps: " + ", ".join(f"{t:.2f} s" for t in times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
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
    if args.plain_run is not None:
        return plain_run(args.models[0], args.plain_run, args.overrides)
    if args.wall:
        return main_wall(args)
    torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            parser.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    print(f"torch {torch.__version__}, {args.threads} threads, {args.warmup} warm-up + {args.steps} timed steps, "
          f"medians; ratio = plain / nanoexp step time (> 1: nanoexp faster); CPU = process CPU time per step")
    header = (f"{'model':<6} {'variant':<10} {'tokens/step':>11} {'nanoexp ms':>10} {'plain ms':>9} "
              f"{'nanoexp tok/s':>13} {'plain tok/s':>11} {'ratio':>6} {'CPU ms n/p':>15} {'CPU ratio':>9} "
              f"{'act MB n/p':>12} {'step-1 loss n/p':>17}")
    print(header)
    for model in args.models:
        for variant in variants:
            r = bench_one(model, variant, args, args.overrides)
            print(f"{r['model']:<6} {r['variant']:<10} {r['tokens_per_step']:>11} {r['nanoexp_ms']:>10.1f} "
                  f"{r['plain_ms']:>9.1f} {r['nanoexp_tok_s']:>13.0f} {r['plain_tok_s']:>11.0f} "
                  f"{r['ratio']:>6.2f} {r['nanoexp_cpu_ms']:>7.0f}/{r['plain_cpu_ms']:<7.0f} {r['cpu_ratio']:>9.2f} "
                  f"{r['act_mb_nanoexp']:>5.1f}/{r['act_mb_plain']:<6.1f} "
                  f"{r['loss_nanoexp']:>8.4f}/{r['loss_plain']:.4f}", flush=True)


if __name__ == "__main__":
    main()
