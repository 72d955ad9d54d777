"""Write a starter experiment for a model and a GPU count, with a layout that fits in memory.

    python scripts/make_config.py --model llama_1b --gpus 16 --gpu-memory-gb 80 --tokenizer /data/llama3_tokenizer
    python scripts/make_config.py --model tiny --gpus 2 --gpu-memory-gb 24 --out my_experiment.yaml
    python scripts/make_config.py --show-lrs model.parametrization=mup model.mup.base_width=32   # train.py overrides

Promises:
- Every dp x cp x tp x pp layout of --gpus processes (cp fixed by --cp, default 1) is checked with nanoexp's
  own `validate` (heads, KV heads, vocabulary and MLP width divisible by tp, no more stages than layers,
  global batch divisible by dp x micro-batch, sequence by 2 x cp) and with tp <= --gpus-per-node (tensor
  parallelism stays inside a node).
- For each valid layout it picks the lowest ZeRO stage that fits (estimate <= 90% of --gpu-memory-gb), and
  prints that stage's estimated memory of the busiest GPU, split into parameters, gradients, optimizer state,
  bf16 weight copies and the transient peak (activations with ZeRO-2/3's units in flight, or the update's
  temporaries), with the totals of every stage. Lower stages are cheaper (`dp_traffic_bytes`): ZeRO-0 and 1 move
  the bytes of one all-reduce of the gradients per step, ZeRO-2 a reduce-scatter per micro-batch, ZeRO-3 also an
  all-gather of the parameters before each forward and each backward. Without dp x cp > 1 only ZeRO-0 applies.
- Of the fitting layouts it takes the one with the least model parallelism: the smallest tp*pp, then the smallest
  pp (a pipeline adds a bubble, tensor parallelism inside a node does not), then the lowest ZeRO stage. ZeRO's
  collectives overlap the computation (gathers are prefetched, reduce-scatters run while backward goes on),
  where tp's sit between a layer's matmuls and pp idles in the bubble: more ZeRO before more model parallelism.
  It prints why: which stages were too big, and each stage's dp traffic per step.
- Writes a coherent experiment (the overrides on the defaults: model, layout, ZeRO, batch, a schedule of
  --train-steps with --warmup-steps, the tokenizer the model's vocabulary needs) as
  conf/experiment/<--experiment, default <model>_<gpus>gpu>.yaml, or to --out, and prints the command
  that runs it. A model whose vocabulary is not the built-in byte tokenizer's needs --tokenizer.

The estimate (bytes per GPU) is nanoexp/observe/memory_estimate.py's for the busiest pipeline stage (parameters, gradients,
AdamW state, activations of the micro-batches the engine holds, counted from what autograd saves; see
scripts/estimate_memory.py; ZeRO-2/3's gathered units and gradients in flight included), plus what a GPU adds:
under bf16 autocast the bf16 copies of the weights it keeps during a step (2 B per parameter held, whatever the
stage: each matmul saves its weight's cast for backward, even where ZeRO-3 frees the float32 unit), and the CUDA
context (memory.CUDA_CONTEXT_MB, a nominal allowance). It leaves out allocator fragmentation and NCCL's buffers:
hence the 10% margin.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from nanoexp.config import (CONF_DIR, ConfigError, batch_accumulation, compose, normalize, num_kv_heads,
                            padded_vocab_size)
from nanoexp.observe.memory import CUDA_CONTEXT_MB, MB
from nanoexp.observe.memory_estimate import busiest_rank_estimate, held_parameters, total
from nanoexp.runtime.build import model_shape
from nanoexp.parallel.layout import Layout
from nanoexp.validation import validate

GIB = 1024 ** 3
HEADROOM = 0.9
BYTE_VOCAB = 257
ZERO_STAGES = (0, 1, 2, 3)   # in the order of their communication per step


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def estimate(cfg) -> dict[str, float]:
    """Bytes on the busiest GPU of this layout and ZeRO stage, by kind: nanoexp.observe.memory's estimate of the busiest
    pipeline stage (what scripts/estimate_memory.py prints), plus what a GPU adds: the bf16 copies of the weights
    autocast keeps during a step, and the CUDA context. `transient` is the largest of what a step's moments add
    (memory.total): activations with ZeRO-2/3's units in flight, or AdamW's temporaries at the update."""
    shape = model_shape(cfg)
    pp_rank, parts = busiest_rank_estimate(cfg, shape, "cuda")
    held, _ = held_parameters(shape, Layout.from_config(cfg), pp_rank)
    state = {kind: parts[kind] for kind in ("parameters", "gradients", "optimizer")}
    return {**state, "weight_copies": 2 * held if cfg.model.dtype == "bfloat16" else 0,
            "transient": total(parts) - sum(state.values()), "cuda_context": CUDA_CONTEXT_MB * MB}


def dp_traffic_bytes(cfg) -> float:
    """Bytes a GPU sends over dp x cp per optimizer step for its ZeRO stage (ring collectives, float32, its
    busiest pipeline stage's parameters): a reduce-scatter or an all-gather of N parameters sends 4N(d - 1)/d.
    ZeRO-0 all-reduces once (two of those), ZeRO-1 reduce-scatters and all-gathers once; ZeRO-2 reduce-scatters
    every micro-batch and all-gathers the update; ZeRO-3 gathers every micro-batch before forward and again before
    backward (once with zero3_reshard_after_forward=false) and reduce-scatters."""
    layout, shape = Layout.from_config(cfg), model_shape(cfg)
    held = max(held_parameters(shape, layout, r)[0] for r in range(layout.pp))
    one = 4 * held * (layout.dp_cp - 1) / layout.dp_cp
    micro_batches, stage = batch_accumulation(cfg), int(cfg.optimizer.zero_stage)
    if stage <= 1:
        return 2 * one
    if stage == 2:
        return (micro_batches + 1) * one
    gathers = 2 if cfg.optimizer.zero3_reshard_after_forward else 1
    return micro_batches * (gathers + 1) * one


def with_stage(cfg, stage: int):
    staged = copy.deepcopy(cfg)
    staged.optimizer.zero_stage = stage
    return staged


def problem_of(cfg, gpus: int) -> str | None:
    """The first problem `validate` finds in this config, or None."""
    try:
        validate(cfg, world_size=gpus)
    except ConfigError as error:
        return str(error).splitlines()[1].strip(" -")
    return None


def candidates(base, gpus: int, gpus_per_node: int):
    """(cfg, problem) for every dp*cp*tp*pp == gpus layout (cp as given, parallelism.cp), without ZeRO; problem
    is None for a valid one."""
    cp = base.parallelism.cp
    for tp in divisors(gpus // cp if gpus % cp == 0 else 0):
        for pp in divisors(gpus // (cp * tp)):
            cfg = with_stage(base, 0)
            cfg.parallelism.dp, cfg.parallelism.tp, cfg.parallelism.pp = gpus // (cp * tp * pp), tp, pp
            too_wide = f"tp={tp} > {gpus_per_node} GPUs per node" if tp > gpus_per_node else None
            yield cfg, too_wide or problem_of(cfg, gpus)


@dataclass
class Option:
    """A valid layout: each ZeRO stage it may use, with its estimate; `stage` the lowest that fits, or None."""
    by_stage: dict[int, tuple[Any, dict[str, float]]]   # stage -> (its config, its estimate)
    stage: int | None

    @property
    def cfg(self):
        return self.by_stage[self.stage][0]

    def total(self, stage: int) -> float:
        return sum(self.by_stage[stage][1].values())


def stages_of(cfg, gpus: int, budget: float) -> Option:
    """The layout `cfg` under each ZeRO stage that applies (0 only without dp x cp > 1; a stage `validate`
    refuses is left out), and the lowest one that fits in `budget` bytes."""
    applicable = ZERO_STAGES if Layout.from_config(cfg).dp_cp > 1 else (0,)
    staged = [with_stage(cfg, stage) for stage in applicable]
    by_stage = {c.optimizer.zero_stage: (c, estimate(c)) for c in staged if problem_of(c, gpus) is None}
    fitting = [stage for stage, (_, parts) in by_stage.items() if sum(parts.values()) <= budget]
    return Option(by_stage, min(fitting, default=None))


def layout(cfg) -> str:
    return Layout.from_config(cfg).name


def print_option(option: Option) -> None:
    """One row: the lowest fitting stage's estimate (the highest stage's when none fits), every stage's total."""
    shown = option.stage if option.stage is not None else max(option.by_stage)
    cfg, parts = option.by_stage[shown]
    totals = "  ".join(f"{s}: {option.total(s) / GIB:.1f}" for s in option.by_stage)
    print(f"{layout(cfg):<12}{shown:>5}" + "".join(f"{v / GIB:9.1f}" for v in parts.values())
          + f"{option.total(shown) / GIB:9.1f}  {'fits' if option.stage is not None else 'too big':<8} {totals}")


def choose(base, gpus: int, gpus_per_node: int, memory_gb: float) -> Option | None:
    """Print the estimate of every layout at its lowest fitting ZeRO stage; return the chosen one (None when
    nothing fits)."""
    budget = HEADROOM * memory_gb * GIB
    print(f"{'layout':<12}{'ZeRO':>5}{'params':>9}{'grads':>9}{'optim':>9}{'bf16 w':>9}{'transient':>10}{'context':>8}"
          f"{'total':>9}  {'':<8} total by ZeRO stage  (GiB per GPU; budget {budget / GIB:.1f})")
    fitting = []
    for cfg, problem in candidates(base, gpus, gpus_per_node):
        if problem:
            print(f"{layout(cfg):<12}invalid: {problem}")
            continue
        option = stages_of(cfg, gpus, budget)
        if not option.by_stage:
            print(f"{layout(cfg):<12}invalid at every ZeRO stage")
            continue
        print_option(option)
        if option.stage is not None:
            fitting.append(option)
    if not fitting:
        return None
    return min(fitting, key=lambda o: (o.cfg.parallelism.tp * o.cfg.parallelism.pp, o.cfg.parallelism.pp,
                                       o.cfg.parallelism.tp, o.stage))


def explain(option: Option, memory_gb: float) -> str:
    """Why this layout and stage: the stages below it that did not fit, and what each stage sends per step."""
    cfg, budget = option.cfg, HEADROOM * memory_gb * GIB
    lines = [f"chosen: {layout(cfg)} with ZeRO-{option.stage}: the fitting layout with the least model parallelism "
             f"(tp x pp = {cfg.parallelism.tp * cfg.parallelism.pp}), {batch_accumulation(cfg)} micro-batches per step "
             f"and replica"]
    too_big = [f"ZeRO-{s} {option.total(s) / GIB:.1f} GiB" for s in option.by_stage if s < option.stage]
    room = f"{budget / GIB:.1f} GiB, {HEADROOM:.0%} of {memory_gb:g} GB"
    lowest = f"the stages below are too big ({', '.join(too_big)} > {room})" if too_big else f"it fits in {room}"
    lines.append(f"  ZeRO-{option.stage} ({option.total(option.stage) / GIB:.1f} GiB) is its lowest stage that fits: "
                 f"{lowest}")
    if option.stage == 0 and 1 in option.by_stage:
        lines.append(f"  (ZeRO-1 sends the same bytes and would hold {option.total(1) / GIB:.1f} GiB: "
                     "optimizer.zero_stage=1 for more headroom)")
    if len(option.by_stage) > 1:
        traffic = ", ".join(f"ZeRO-{s} {dp_traffic_bytes(c) / GIB:.1f}" for s, (c, _) in option.by_stage.items())
        lines.append(f"  sent over dp x cp per step and GPU (GiB): {traffic}")
        lines.append("  (ZeRO-0/1 all-reduce the gradients once a step, ZeRO-2 reduce-scatters them every micro-batch, "
                     "ZeRO-3 also gathers the parameters for each forward and backward)")
    return "\n".join(lines)


def experiment_yaml(args, chosen: list[str], tokenizer: str) -> str:
    """The experiment file: the model as a defaults override, then every other override as YAML."""
    body = OmegaConf.from_dotlist([o for o in chosen if not o.startswith("model=")] + [
        f"tokenizer.tokenizer_name_or_path={tokenizer}", f"tokens.train_steps={args.train_steps}",
        f"tokens.val_check_interval={max(1, args.train_steps // 10)}", "tokens.limit_val_batches=8",
        f"optimizer.learning_rate_scheduler.lr_warmup_steps={args.warmup_steps}",
        f"checkpoint.checkpoint_interval={max(1, args.train_steps // 20)}", "checkpoint.keep_last_n=3"])
    lines = ["# @package _global_", f"# scripts/make_config.py {' '.join(sys.argv[1:])}", "defaults:",
             f"  - override /model: {args.model}"]
    return "\n".join(lines) + "\n" + OmegaConf.to_yaml(body)


def show_lrs(overrides: list[str]) -> int:
    """Print each optimizer parameter group that `python train.py <overrides>` trains with: its tensors,
    init std, learning rate (peak and end of decay) and weight decay, read from the model's full shapes
    with the optimizer's own grouping rule (nothing is built, so any model size answers at once)."""
    from nanoexp.runtime.build import model_shape
    from nanoexp.model.llama import parameter_shapes
    from nanoexp.model.mup import GROUPS, describe, parametrization_of
    from nanoexp.runtime.optim import min_decay_lr

    cfg = compose(overrides)
    normalize(cfg)
    try:
        validate(cfg)
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 2
    shape, mup, sched = model_shape(cfg), parametrization_of(cfg), cfg.optimizer.learning_rate_scheduler
    members: dict[str, list] = {}
    for name, full in parameter_shapes(shape).items():
        members.setdefault(mup.group(name, len(full)), []).append((name, full))
    print(f"parametrization: {describe(mup, shape.hidden_size, shape.head_dim)}")
    print(f"{'group':<10}{'tensors':>8}{'parameters':>12}{'init std':>10}{'lr scale':>10}{'peak lr':>11}"
          f"{'final lr':>11}{'decay':>7}  holds")
    for group in (g for g in GROUPS if g in members):
        name, full = members[group][0]
        std = "ones" if group == "vectors" else f"{mup.init_std(name, len(full), cfg.model.init_method.std):.4g}"
        scale = mup.lr_scale(group)
        decay = mup.weight_decay(group, cfg.optimizer.weight_decay)
        held = dict.fromkeys(re.sub(r"^model\.layers\.\d+\.", "", n).removesuffix(".weight") for n, _ in members[group])
        held = [n for n in held if n.startswith(("model.", "lm_head"))] + [   # the layers' tensors in one entry
            "model.layers.*.{" + ", ".join(n for n in held if not n.startswith(("model.", "lm_head"))) + "}"]
        print(f"{group:<10}{len(members[group]):>8}{sum(math.prod(f) for _, f in members[group]):>12,}{std:>10}"
              f"{scale:>10.4g}{sched.learning_rate * scale:>11.4g}{min_decay_lr(cfg) * scale:>11.4g}{decay:>7g}  "
              + ", ".join(n for n in held if not n.endswith("{}"))
              + (" (= lm_head, tied)" if shape.tie_word_embeddings and group == "matrices" else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a file of conf/model/ (tiny, small, llama_1b, llama3_8b, ...)")
    parser.add_argument("--gpus", type=int, required=True, help="processes in all (nodes x GPUs per node)")
    parser.add_argument("--gpu-memory-gb", type=float, required=True, help="memory of one GPU")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--sequence-length", type=int, default=2048)
    parser.add_argument("--cp", type=int, default=1, help="context parallel ranks per sequence (parallelism.cp)")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--global-batch-size", type=int, default=256, help="sequences per optimizer step")
    parser.add_argument("--train-steps", type=int, default=10000)
    parser.add_argument("--warmup-steps", type=int, default=500)
    parser.add_argument("--tokenizer", help="a local Hugging Face tokenizer folder (needed unless the model's "
                                            "vocabulary is the byte tokenizer's 257)")
    parser.add_argument("--experiment", help="name of the conf/experiment/ file (default <model>_<gpus>gpu)")
    parser.add_argument("--out", help="write the experiment here instead of conf/experiment/")
    parser.add_argument("--show-lrs", nargs="*", metavar="OVERRIDE", help="only print the learning rate of each "
                        "parameter group for the config of these train.py overrides (the other options are not needed)")
    argv = sys.argv[1:] if argv is None else argv
    if "--show-lrs" in argv:
        return show_lrs(argv[argv.index("--show-lrs") + 1:])
    args = parser.parse_args(argv)

    overrides = [f"model={args.model}", f"tokens.sequence_length={args.sequence_length}",
                 f"tokens.micro_batch_size={args.micro_batch_size}",
                 f"tokens.global_batch_size={args.global_batch_size}", *([f"parallelism.cp={args.cp}"] if args.cp > 1 else [])]
    base = compose(overrides)
    normalize(base)
    m = base.model.model_config
    if args.sequence_length > m.max_position_embeddings:
        parser.error(f"--sequence-length {args.sequence_length} > max_position_embeddings {m.max_position_embeddings}")
    if m.vocab_size > BYTE_VOCAB and not args.tokenizer:
        parser.error(f"--tokenizer is needed: {args.model} has a vocabulary of {m.vocab_size}, the byte tokenizer "
                     f"{BYTE_VOCAB}; give a local Hugging Face tokenizer folder of that vocabulary")
    if args.warmup_steps > args.train_steps:
        parser.error(f"--warmup-steps {args.warmup_steps} > --train-steps {args.train_steps}")
    print(f"model {args.model}: hidden {m.hidden_size}, {m.num_hidden_layers} layers, {m.num_attention_heads} heads "
          f"({num_kv_heads(base)} KV), vocabulary {padded_vocab_size(base)}, {base.model.dtype}; sequence "
          f"{args.sequence_length}, micro-batch {args.micro_batch_size}, global batch {args.global_batch_size}; "
          f"{args.gpus} GPUs of {args.gpu_memory_gb:g} GB")
    option = choose(base, args.gpus, args.gpus_per_node, args.gpu_memory_gb)
    if option is None:
        print(f"no layout fits in {HEADROOM:.0%} of {args.gpu_memory_gb:g} GB: use more GPUs, a smaller micro-batch "
              "or sequence, or parallelism.recompute_layer=true", file=sys.stderr)
        return 1
    cfg = option.cfg
    p = cfg.parallelism
    print(explain(option, args.gpu_memory_gb))
    chosen = overrides + [f"parallelism.dp={p.dp}", f"parallelism.tp={p.tp}", f"parallelism.pp={p.pp}",
                          f"optimizer.zero_stage={cfg.optimizer.zero_stage}"]
    name = args.experiment or f"{args.model}_{args.gpus}gpu"
    path = args.out or os.path.join(CONF_DIR, "experiment", f"{name}.yaml")
    with open(path, "w") as f:
        f.write(experiment_yaml(args, chosen, args.tokenizer or "byte"))
    name = os.path.splitext(os.path.basename(path))[0]
    nodes = math.ceil(args.gpus / args.gpus_per_node)
    print(f"wrote {path}" + (" (move it into conf/experiment/ to run it)" if args.out else ""))
    print(f"run it: python train.py -m +experiment={name} hydra/launcher=slurm hydra.launcher.nodes={nodes} "
          f"hydra.launcher.gpus_per_node={min(args.gpus, args.gpus_per_node)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
