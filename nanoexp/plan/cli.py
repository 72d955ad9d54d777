"""scripts/plan.py's command line: compose the model, rank its layouts (search.rank), print them or their JSON.
Usage and output: scripts/plan.py's docstring and docs/planning.md."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from nanoexp.config import ConfigError, compose, normalize
from nanoexp.model.llama import count_parameters
from nanoexp.model.shape import model_shape
from nanoexp.plan.cost import MODEL_ERROR, NANOEXP
from nanoexp.plan.goodput import LLAMA3_GPU_HOURS_PER_FAILURE, layout_goodput, replica_groups
from nanoexp.plan.hardware import GPUS, hardware
from nanoexp.plan.search import RECOMPUTE, rank


def fail(argument: str, message: str) -> int:
    print(f"plan.py: error: {argument}: {message}", file=sys.stderr)
    return 2


def base_config(overrides: list[str], seq: int | None, batch_tokens: int | None, hf_config: str | None):
    """The composed config, with --seq and --global-batch-tokens set when given (None: the config's own)."""
    extra = []
    if hf_config:
        from nanoexp.plan.hf_config import overrides_of
        extra = overrides_of(hf_config)
    cfg = compose([*extra, *overrides])
    if seq is not None:
        cfg.tokens.sequence_length = seq
        cfg.model.model_config.max_position_embeddings = max(seq, cfg.model.model_config.max_position_embeddings)
    if batch_tokens is not None:
        cfg.tokens.global_batch_size = batch_tokens // cfg.tokens.sequence_length
    normalize(cfg)
    return cfg


COLUMNS = (f"{'#':>3} {'layout':<22}{'ZeRO':>4} {'schedule':<18}{'mb':>3} {'recompute':<10}{'tok/s/GPU':>11}{'vs #1':>7}"
           f"{'MFU':>6}{'GiB/GPU':>8}{'margin':>7}  {'compute':>7}{'uneven':>7}{'comm':>6}{'bubble':>7}{'optim':>6}"
           f"{'host':>6}  (% of the step)")


def row(i: int, p, first) -> str:
    """One layout's line: `~` after its number when it is within the model's error of the first (a tie)."""
    schedule = p.schedule + (f" v{p.virtual_stages}" if p.virtual_stages > 1 else "") if p.pp > 1 else "-"
    share = {k: 100 * v / p.step_time_s for k, v in p.breakdown.items()}
    tie = "~" if i > 1 and p.tied_with(first) else " "
    behind = 100 * (p.tokens_per_s_per_gpu / first.tokens_per_s_per_gpu - 1)
    host = share.get("host", 0) + share.get("cpu_overhead", 0)   # waiting for the host's launches, its fixed ops
    uneven = 100 * p.uneven_s / p.step_time_s
    return (f"{i:>2}{tie} {p.name:<22}{p.zero_stage:>4} {schedule:<18}{p.micro_batch:>3} "
            f"{p.recompute:<10}{p.tokens_per_s_per_gpu:>11,.0f}{behind:>+6.1f}%{100 * p.mfu:>5.1f}%"
            f"{p.memory_gib:>8.1f}{p.margin_gib:>7.1f}  {share['compute'] - uneven:>6.0f}%{uneven:>6.0f}%"
            f"{share['exposed_comm']:>5.0f}%{share['bubble']:>6.0f}%{share['optimizer']:>5.0f}%{host:>5.0f}%")


def print_table(ranking, gpus: int, hw) -> None:
    print(COLUMNS)
    first = ranking.predictions[0] if ranking.predictions else None
    for i, p in enumerate(ranking.predictions, 1):
        print(row(i, p, first))
    if first is None:
        print(nothing_fits(ranking, gpus, hw))
    elif any(p.tied_with(first) for p in ranking.predictions[1:]):
        print(f"~ within the model's error of #1 ({MODEL_ERROR:.0%}, cost.MODEL_ERROR): a tie; choose among them by "
              "the memory margin (GiB below the 90 % that fits) or simplicity")
    print("out (candidates):")
    for line in ranking.reason_lines():
        print(line)


def nothing_fits(ranking, gpus: int, hw) -> str:
    reason, count = ranking.most_common()
    return (f"no layout of {gpus} GPUs fits on {hw.name}: the most common reason ({count} of "
            f"{sum(ranking.reasons.values())} candidates): {reason}")


def header(cfg, args, hw) -> str:
    m, t = cfg.model.model_config, cfg.tokens
    return (f"{args.gpus} x {hw.name} ({min(args.gpus_per_node, args.gpus)} a node): hidden {m.hidden_size}, "
            f"{m.num_hidden_layers} layers, sequence {t.sequence_length}, global batch {t.global_batch_size} "
            f"sequences ({t.global_batch_size * t.sequence_length:,} tokens)\nassumed: {NANOEXP.describe()}")


def parser_of() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (model=llama3_8b, ...)")
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu", default="h100", help=f"one of {', '.join(GPUS)}, cpu (calibrated now)")
    parser.add_argument("--seq", type=int, help="sequence length (tokens.sequence_length)")
    parser.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--hf-config", help="a Hugging Face config.json (Llama, Mixtral, Qwen-MoE shapes)")
    parser.add_argument("--mtbf-gpu-hours", type=float, default=LLAMA3_GPU_HOURS_PER_FAILURE,
                        help="GPU-hours between failures (default: Llama 3's 405B run's: docs/fault-tolerance.md)")
    parser.add_argument("--recompute", default=",".join(RECOMPUTE),
                        help=f"the parallelism.recompute modes tried, comma-separated (default {','.join(RECOMPUTE)})")
    return parser


def argument_problem(args) -> tuple[str, str] | None:
    """(argument, why) of the first argument that cannot be planned, or None."""
    if args.gpus < 1:
        return "--gpus", f"{args.gpus} is not a positive GPU count"
    if args.gpus_per_node < 1 or (args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node):
        return "--gpus", f"{args.gpus} GPUs do not fill nodes of --gpus-per-node {args.gpus_per_node}"
    if args.gpu.lower() not in (*GPUS, "cpu"):
        return "--gpu", f"unknown gpu {args.gpu!r}: one of {', '.join([*GPUS, 'cpu'])}"
    if args.top < 1:
        return "--top", "must be at least 1"
    if not args.mtbf_gpu_hours > 0:
        return "--mtbf-gpu-hours", f"{args.mtbf_gpu_hours} is not a positive number of GPU-hours"
    unknown = [mode for mode in args.recompute.split(",") if mode not in RECOMPUTE]
    if unknown or not args.recompute:
        return "--recompute", f"{args.recompute!r}: modes are {', '.join(RECOMPUTE)}, comma-separated"
    if args.seq is not None and args.seq < 1:
        return "--seq", f"{args.seq} is not a positive sequence length (tokens a sequence)"
    if args.global_batch_tokens is not None and args.global_batch_tokens < 1:
        return "--global-batch-tokens", f"{args.global_batch_tokens} is not a positive number of tokens a step"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser_of().parse_intermixed_args(argv)   # overrides before, between or after the options
    problem = argument_problem(args)
    if problem:
        return fail(*problem)
    try:
        cfg = base_config(args.overrides, args.seq, args.global_batch_tokens, args.hf_config)
    except (ConfigError, ValueError, OSError) as error:
        return fail("overrides", str(error).splitlines()[0])
    if args.global_batch_tokens is not None and cfg.tokens.global_batch_size < 1:
        return fail("--global-batch-tokens", f"{args.global_batch_tokens} is less than one sequence "
                                             f"({cfg.tokens.sequence_length} tokens)")
    hw = hardware(args.gpu, dtype=str(cfg.model.dtype))   # a CPU computes in the run's dtype
    try:
        ranking = rank(cfg, args.gpus, min(args.gpus_per_node, args.gpus), hw, args.top,
                       modes=tuple(args.recompute.split(",")))
    except ConfigError as error:   # what the model cannot price (cost.products_tflops)
        return fail("overrides", str(error))
    if not ranking.predictions and all(reason.startswith("invalid") for reason in ranking.reasons):
        return fail("--gpus", nothing_fits(ranking, args.gpus, hw).replace(" fits on ", " runs on ", 1))
    if args.json:
        rows = zip(ranking.predictions, goodputs(ranking, cfg, args.gpus, hw, args.mtbf_gpu_hours))
        print(json.dumps([{**p.as_dict(), "replica_groups": replica_groups(p), "goodput": asdict(g)} for p, g in rows],
                         indent=1))
        return 0
    print(header(cfg, args, hw))
    print_table(ranking, args.gpus, hw)
    print_goodput(ranking, cfg, args.gpus, hw, args.mtbf_gpu_hours)
    return 0


def goodputs(ranking, cfg, gpus: int, hw, mtbf_gpu_hours: float) -> list:
    """Each ranked layout's goodput when GPUs fail every `mtbf_gpu_hours` (nanoexp/plan/goodput.py)."""
    parameters = count_parameters(model_shape(cfg))
    return [layout_goodput(p, parameters, gpus, hw, mtbf_gpu_hours) for p in ranking.predictions]


def print_goodput(ranking, cfg, gpus: int, hw, mtbf_gpu_hours: float) -> None:
    rows = [(i, p, g) for i, (p, g) in enumerate(zip(ranking.predictions, goodputs(ranking, cfg, gpus, hw,
                                                                                     mtbf_gpu_hours)), 1)]
    if not rows:
        return
    print(f"goodput, a failure every {mtbf_gpu_hours:,.0f} GPU-hours: {rows[0][2].failures_per_day:.2f} a day "
          "(restart: from checkpoints every Young-Daly interval; groups: fault_tolerance=torchft, one per replica)")
    print(f"{'#':>2} {'layout':<22}{'save stall':>11}{'interval':>11}{'restart':>9}{'groups':>8}{'torchft':>9}")
    for i, p, g in rows:
        print(f"{i:>2} {p.name:<22}{g.save_stall_s:>10.2f}s"
              f"{g.checkpoint_interval_s / 60:>7.1f} min{100 * g.restart:>8.3f}%{replica_groups(p):>8}"
              f"{100 * g.replica_groups:>8.3f}%")
