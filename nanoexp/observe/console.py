"""What a researcher reads on the console: the facts of a run at its start, its memory after the first
step, one line per logged step with progress and an ETA, the closing summary line, and the command that
resumes a stopped run.

Plain lines, not a progress bar: they read the same in a terminal, in train.log and in a SLURM
log file. Only global rank 0 (and the launching process) prints them; this module only formats.
"""
from __future__ import annotations

import os
import shlex
import sys
import time
from collections import deque

from omegaconf import OmegaConf

from nanoexp.model.llama import count_active_parameters
from nanoexp.model.mup import describe, parametrization_of
from nanoexp.numerics.converters import console_lines
from nanoexp.instruments.moe_metrics import LOAD_IMBALANCE
from nanoexp.observe.memory_estimate import estimate
from nanoexp.runtime.recompute import RecomputePolicy


def duration(seconds: float) -> str:
    """2h03m, 4m05s, 12s."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class StepClock:
    """Elapsed time since training started and the ETA of the remaining steps, from the mean of the
    last `window` step times (the first steps, slower while caches warm up, soon drop out)."""

    def __init__(self, window: int = 20):
        self.start = time.perf_counter()
        self.recent: deque[float] = deque(maxlen=window)

    def record(self, step_seconds: float) -> None:
        self.recent.append(step_seconds)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def eta(self, remaining_steps: int) -> float:
        return remaining_steps * sum(self.recent) / len(self.recent) if self.recent else 0.0


def step_line(record: dict, total_steps: int, clock: StepClock) -> str:
    """`step 10/240 | loss 2.3456 | lr 0.004 | grad_norm 0.512 | 7,012 tokens/s | 312 MB | 0m07s, ETA 2m31s`; a
    mixture of experts adds its layers' expert loads, the busiest expert's over the mean (`load max/mean 1.31 1.24`)."""
    step = record["step"]
    loads = [value for key, value in record.items() if key.startswith(LOAD_IMBALANCE)]
    return (f"step {step}/{total_steps} | loss {record['loss']:.4f} | lr {record['lr']:.3g} | "
            f"grad_norm {record['grad_norm']:.3f} | "
            + (f"load max/mean {' '.join(f'{load:.2f}' for load in loads)} | " if loads else "")
            + f"{record['tokens_per_sec']:,.0f} tokens/s | {record['peak_memory_mb']:,.0f} MB | "
            f"{duration(clock.elapsed())}, ETA {duration(clock.eta(total_steps - step))}")


def checkpoint_line(record: dict, root: str) -> str:
    """`saved checkpoint <root>/40 | written in 1.20 s, training waiting`; in the background (checkpoint.async_save):
    `... | written in the background in 1.20 s, published after step 42 | training stalled 0.05 s (0.00 s of it
    waiting for the write)`."""
    saved = f"saved checkpoint {os.path.join(root, str(record['step']))}"
    if not record["checkpoint/background"]:
        return f"{saved} | written in {record['checkpoint/write_sec']:.2f} s, training waiting"
    return (f"{saved} | written in the background in {record['checkpoint/write_sec']:.2f} s, published after step "
            f"{record['checkpoint/published_after_step']} | training stalled {record['checkpoint/stall_sec']:.2f} s "
            f"({record['checkpoint/wait_sec']:.2f} s of it waiting for the write)")


def summary_line(summary: dict, summary_path: str) -> str:
    """One line with what a run ended with and where its summary.json is."""
    def number(key, fmt):
        value = summary.get(key)
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    mfu = summary.get("mfu")
    mfu = "- (the peak is wrong)" if summary.get("peak_refuted") else "-" if mfu is None else f"{100 * mfu:.1f}%"
    return (f"{summary.get('status', '?')} | {summary.get('train_steps', 0)} steps | final loss "
            f"{number('final_loss', '.4f')} | eval loss {number('eval_loss', '.4f')} | "
            f"{duration(summary.get('wall_seconds') or 0)} | {number('tokens_per_sec', ',.0f')} tokens/s | "
            f"MFU {mfu} | {summary_path}")


def resume_command(overrides: list[str], run_dir: str) -> str:
    """The command line that continues a stopped run in its own folder (checkpoint.resume=auto)."""
    kept = [o for o in overrides if not o.startswith("hydra.run.dir=")]
    script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else "train.py"
    return shlex.join(["python", script, *kept, f"hydra.run.dir={run_dir}"])


def run_facts(cfg, layout, shape, num_parameters: int, accumulation: int, data: str, peak,
              converted_linears: int = 0, tf32: bool = False, flush_denormals: bool = False,
              device=None, ranks_per_node: int | None = None) -> list[str]:
    """The lines that say what a run is: model, parametrization, number format (`converted_linears`: how many
    linears of rank 0's model a format converted, each enabled format's own line on `device`; whether matmuls run
    in TF32, denormals are flushed), initial weights, layout (and where hybrid sharding's shard groups lie on nodes of `ranks_per_node`
    ranks, default one node), global batch, data (`data`: describe_data's words) and the peak MFU is measured
    against."""
    p, t = cfg.parallelism, cfg.tokens
    global_batch = layout.dp * t.micro_batch_size * accumulation
    active = count_active_parameters(shape)
    lines = [f"model: {num_parameters:,} parameters{f', {active:,} active per token' if shape.moe else ''} (hidden "
             f"{shape.hidden_size}, {shape.num_hidden_layers} layers, {shape.num_attention_heads} heads / "
             f"{shape.num_key_value_heads} KV heads, vocabulary {shape.vocab_size}), {cfg.model.dtype}"
             + (" (matmuls in TF32: model.allow_tf32)" if tf32 else "")
             + ("; denormals flushed to zero (model.flush_denormals)" if flush_denormals else "")]
    if shape.moe:
        moe = shape.moe
        balance = {"aux_loss": f"aux loss x {moe.aux_loss_coef:g}", "none": "none",
                   "bias": f"routing bias, rate {moe.bias_update_rate:g}"}[moe.balance]
        seq = f", sequence loss x {moe.seq_aux_loss_coef:g}" if moe.seq_aux_loss_coef else ""
        lines.append(f"mixture of experts: 1 layer in {moe.layer_frequency}, {moe.num_experts} experts of width "
                     f"{moe.intermediate_size}, top-{moe.top_k}{' normalized' if moe.normalize_top_k else ''}, "
                     f"{moe.num_shared_experts} shared, {moe.expert_kernel} kernel; balance: {balance}{seq}; "
                     f"z-loss x {moe.z_loss_coef:g}")
    if cfg.model.parametrization == "mup":
        lines.append(f"parametrization: {describe(parametrization_of(cfg), shape.hidden_size, shape.head_dim)}")
    lines += console_lines(cfg, converted_linears, device, layout.pp)
    recompute = RecomputePolicy.from_config(cfg).describe(shape.num_hidden_layers)
    lines += [recompute + activation_estimates(cfg, layout, shape, device)] if recompute else []
    if cfg.model.init_method.path:
        lines.append(f"initial weights: Hugging Face model {cfg.model.init_method.path} (model.init_method.path)")
    parts = [f"{layout.world_size} process{'es' if layout.world_size > 1 else ''}"]
    parts += [f"pipeline {layout.schedule}"] if layout.pp > 1 else []
    parts += [f"tensor parallel {p.tp_mode}"] if layout.tp > 1 else []
    parts += [f"context parallel {layout.cp_mode}: {layout.local_tokens(t.sequence_length)} tokens per rank"
              ] if layout.cp > 1 else []
    parts += [f"expert parallel: {shape.moe.num_experts // layout.ep} experts per rank, "
              f"{layout.edp} cop{'ies' if layout.edp > 1 else 'y'} of each"] if layout.ep > 1 else []
    lines.append(f"layout: {layout.name} ({', '.join(parts)})")
    if layout.replicas > 1:
        lines.append(hybrid_sharding_line(layout, int(cfg.optimizer.zero_stage), ranks_per_node or layout.world_size))
    lines.append(f"global batch: {global_batch} sequences x {t.sequence_length} tokens = "
                 f"{global_batch * t.sequence_length:,} tokens per step (dp {layout.dp} x micro-batch "
                 f"{t.micro_batch_size} x accumulation {accumulation})")
    lines.append(f"data: {data}")
    lines.append("peak for MFU: " + (f"{peak.tflops:.3g} TFLOP/s ({peak.source})" if peak.tflops else peak.source))
    return lines


def hybrid_sharding_line(layout, stage: int, ranks_per_node: int) -> str:
    """Hybrid sharding: the shard groups, which ranks hold them, whether each lies inside a node."""
    if layout.shard_size == 1:
        return (f"hybrid sharding with shard groups of one rank (dp_shard 1, cp 1): nothing is sharded, each of the "
                f"{layout.replicas} replicas holds the whole model state and gradients are all-reduced (as ZeRO-0)")
    blocks = layout.shard_blocks()
    ranks = ", ".join(f"{b.start}-{b.stop - 1}" for b in blocks[:4]) + (", ..." if len(blocks) > 4 else "")
    per_tp = " (one group per tp rank in each)" if layout.tp > 1 else ""
    where = (f"some cross nodes of {ranks_per_node} ranks: their gathers and reduce-scatters go over the network"
             if layout.shard_groups_cross_nodes(ranks_per_node) else f"each inside a node of {ranks_per_node} ranks")
    return (f"hybrid sharding: ZeRO-{stage} over shard groups of {layout.shard_size} ranks (dp_shard "
            f"{layout.dp_shard} x cp {layout.cp}), {layout.replicas} replicas of each shard, all-reduced across them "
            f"once a step; shard groups in ranks {ranks}{per_tp}, {where}")


def describe_data(name: str, train_samples: int | None, sequence_length: int, val_samples: int, rounds: int,
                  global_batch: int) -> str:
    """What the data of a stage is: training samples per epoch (None: a stream), and what each evaluation
    reads of the held-out samples in `rounds` global batches."""
    train = (f"{train_samples:,} training samples per epoch ({train_samples * sequence_length:,} tokens)"
             if train_samples is not None else "streamed training samples (length unknown until read)")
    evaluated = min(val_samples, rounds * global_batch)
    padding = " (the last batch padded)" if evaluated < rounds * global_batch else ""
    return (f"{name}: {train}; held-out {val_samples:,} samples, each evaluation reads {evaluated:,} of them in "
            f"{rounds} global batch(es){padding}")


def activation_estimates(cfg, layout, shape, device=None) -> str:
    """"; estimated activations ... (without recomputation: ...)": the busiest stage's, as memory_estimate counts them."""
    device_type = getattr(device, "type", "cpu")
    plain = OmegaConf.merge(cfg, {"parallelism": {"recompute": "none", "recompute_layer": False,
                                                  "offload_activations": False}})
    ours, none = (max(estimate(c, shape, r, device_type)["activations"] for r in range(layout.pp)) / 2**20
                  for c in (cfg, plain))
    return f"; estimated activations {ours:,.0f} MB a rank at most (without recomputation: {none:,.0f} MB)"


def memory_line(memory: dict, baseline_mb: float, peak_mb: float) -> str:
    """Rank 0's memory after its first step, by kind (summary.json's `memory` of one rank)."""
    return (f"memory of rank 0: parameters {memory['parameters_mb']:.1f} MB, gradients {memory['gradients_mb']:.1f} "
            f"MB, optimizer state {memory['optimizer_mb']:.1f} MB, activations {memory['activations_mb']:.1f} MB "
            f"({memory['activations_per_micro_batch_mb']:.2f} MB per micro-batch x "
            f"{memory['micro_batches_in_flight']} in flight); runtime baseline {baseline_mb:.0f} MB, peak so far "
            f"{peak_mb:.0f} MB")
