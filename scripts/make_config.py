"""Write a starter experiment for a model and a GPU count, with a layout that fits in memory.

    python scripts/make_config.py --model llama_1b --gpus 16 --gpu-memory-gb 80
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
  that runs it. A model whose vocabulary is not the built-in byte tokenizer's needs a tokenizer of that vocabulary:
  without --tokenizer the experiment leaves `tokenizer.tokenizer_name_or_path: ???` (a run stops at start, in one
  line, until it is set) and the command it prints sets it.

The chooser is nanoexp/plan/chooser.py; its estimate (bytes per GPU, nanoexp/plan/memory.py) is nanoexp/observe/memory_estimate.py's for
the busiest pipeline stage (parameters, gradients, AdamW state, activations of the micro-batches the engine holds,
counted from what autograd saves; see scripts/estimate_memory.py; ZeRO-2/3's gathered units and gradients in flight
included), plus what a GPU adds: under bf16 autocast the bf16 copies of the weights it keeps during a step (2 B per
parameter held, whatever the stage: each matmul saves its weight's cast for backward, even where ZeRO-3 frees the
float32 unit), and the CUDA context (memory.CUDA_CONTEXT_MB, a nominal allowance). It leaves out allocator
fragmentation and NCCL's buffers: hence the 10% margin. --show-lrs prints nanoexp/optim/lr_table.py's table.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

from omegaconf import OmegaConf

from nanoexp.config import CONF_DIR, ConfigError, compose, normalize, num_kv_heads, padded_vocab_size
from nanoexp.plan.chooser import HEADROOM, choose, explain
from nanoexp.optim.lr_table import lr_table
from nanoexp.validation import validate

BYTE_VOCAB = 257


def tokenizer_of(args, vocab_size: int) -> str:
    """--tokenizer, else the byte tokenizer where the vocabulary fits it, else ??? (OmegaConf's "must be set")."""
    return args.tokenizer or ("byte" if vocab_size <= BYTE_VOCAB else "???")


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
    """Print each optimizer parameter group that `python train.py <overrides>` trains with (lr_table)."""
    cfg = compose(overrides)
    normalize(cfg)
    try:
        validate(cfg)
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 2
    print(lr_table(cfg))
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
    parser.add_argument("--tokenizer", help="a local Hugging Face tokenizer folder of the model's vocabulary (without "
                                            "it: byte for a vocabulary of up to 257, else left for the run to set)")
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
    if args.warmup_steps > args.train_steps:
        parser.error(f"--warmup-steps {args.warmup_steps} > --train-steps {args.train_steps}")
    print(f"model {args.model}: hidden {m.hidden_size}, {m.num_hidden_layers} layers, {m.num_attention_heads} heads "
          f"({num_kv_heads(base)} KV), vocabulary {padded_vocab_size(base)}, {base.model.dtype}; sequence "
          f"{args.sequence_length}, micro-batch {args.micro_batch_size}, global batch {args.global_batch_size}; "
          f"{args.gpus} GPUs of {args.gpu_memory_gb:g} GB")
    option = choose(base, args.gpus, args.gpus_per_node, args.gpu_memory_gb)
    if option is None:
        print(f"no layout fits in {HEADROOM:.0%} of {args.gpu_memory_gb:g} GB: use more GPUs, a smaller micro-batch "
              "or sequence, or parallelism.recompute=selective (or full)", file=sys.stderr)
        return 1
    cfg = option.cfg
    p = cfg.parallelism
    print(explain(option, args.gpu_memory_gb))
    chosen = overrides + [f"parallelism.dp={p.dp}", f"parallelism.tp={p.tp}", f"parallelism.pp={p.pp}",
                          f"optimizer.zero_stage={cfg.optimizer.zero_stage}"]
    name = args.experiment or f"{args.model}_{args.gpus}gpu"
    path = args.out or os.path.join(CONF_DIR, "experiment", f"{name}.yaml")
    with open(path, "w") as f:
        f.write(experiment_yaml(args, chosen, tokenizer_of(args, m.vocab_size)))
    name = os.path.splitext(os.path.basename(path))[0]
    nodes = math.ceil(args.gpus / args.gpus_per_node)
    print(f"wrote {path}" + (" (move it into conf/experiment/ to run it)" if args.out else ""))
    missing = tokenizer_of(args, m.vocab_size) == "???"
    if missing:
        print(f"its tokenizer is left unset (???): {args.model} has a vocabulary of {m.vocab_size}, the byte tokenizer "
              f"{BYTE_VOCAB}; give a tokenizer of that vocabulary (a local Hugging Face tokenizer folder) when you run "
              "it, or --tokenizer here")
    print(f"run it: python train.py -m +experiment={name} hydra/launcher=slurm hydra.launcher.nodes={nodes} "
          f"hydra.launcher.gpus_per_node={min(args.gpus, args.gpus_per_node)}"
          + (" tokenizer.tokenizer_name_or_path=/path/to/tokenizer" if missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
