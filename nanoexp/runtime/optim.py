"""The optimizers (`OPTIMIZERS`), their parameter groups (with µP's per-group learning rates), the learning-rate
schedule, and clipping by the true global norm."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from nanoexp.config import optimizer_name
from nanoexp.model.mup import GROUPS, STANDARD, Parametrization, parametrization_of
from nanoexp.parallel.gradient_sync import GradientSync
from nanoexp.model.placement import value_name
from nanoexp.parallel.sharded_optimizer import ShardedOptimizer
from nanoexp.runtime.muon import MuonWithAdamW, takes_muon
from nanoexp.runtime.muon import hidden_lr_scale as muon_hidden_lr_scale
from nanoexp.runtime.muon import lr_notes as muon_lr_notes
from nanoexp.runtime.muon import problems as muon_problems
from nanoexp.runtime.muon import state_bytes as muon_state_bytes
from nanoexp.runtime.muon import updater as muon_updater


def parameter_groups(model: nn.Module, weight_decay: float, parametrization: Parametrization = STANDARD) -> list[dict]:
    """Weight decay on matrices only: norms (and biases, if any) are 1-D and are not decayed. Each group
    has its `lr_scale` (the µP multiplier on the scheduled rate, see set_lr); standard has two groups,
    matrices and vectors, µP splits the hidden matrices off the matrices."""
    members: dict[str, list] = {group: [] for group in GROUPS}
    for name, param in model.named_parameters():
        members[parametrization.group(value_name(name, param), param.ndim)].append(param)
    return [{"params": params, "weight_decay": parametrization.weight_decay(group, weight_decay),
             "lr_scale": parametrization.lr_scale(group), "group": group}
            for group, params in members.items() if params]


def adamw(cfg) -> tuple[type, dict]:
    """torch's AdamW (foreach, or fused with torch_adam_is_fused), with nanotron's keys."""
    o, f = cfg.optimizer, cfg.optimizer.optimizer_factory
    fused = bool(f.torch_adam_is_fused)
    return torch.optim.AdamW, dict(lr=o.learning_rate_scheduler.learning_rate, betas=(f.adam_beta1, f.adam_beta2),
                                   eps=f.adam_eps, fused=fused or None, foreach=None if fused else True)


def muon(cfg) -> tuple[type, dict]:
    """Muon on the hidden matrices, AdamW (with the adamW keys) on the rest (runtime/muon.py), nanoexp's keys
    muon_* beside nanotron's; both read the scheduled rate and optimizer.weight_decay of each group."""
    f = cfg.optimizer.optimizer_factory
    _, adamw_options = adamw(cfg)
    return MuonWithAdamW, dict(adamw=adamw_options, muon=dict(
        lr=cfg.optimizer.learning_rate_scheduler.learning_rate, momentum=f.muon_momentum, nesterov=f.muon_nesterov,
        ns_steps=f.muon_ns_steps, ns_coefficients=tuple(f.muon_ns_coefficients), adjust_lr_fn=f.muon_adjust_lr_fn))


def muon_rank_options(model: nn.Module, grad_sync: GradientSync | None, zero_stage: int) -> dict:
    """Muon picks its matrices by name and gathers tp (and ZeRO) shards."""
    names = {id(p): value_name(n, p) for n, p in model.named_parameters()}
    options = dict(names=names, tp_group=grad_sync.ctx.tp_group if grad_sync else None)
    if zero_stage >= 1:
        matrices = [p for p in model.parameters() if takes_muon(names[id(p)], p)]
        options["zero"] = (matrices, grad_sync.ctx.dp_cp_group, grad_sync.ctx.edp_group)
    return options


class OptimizerEntry(NamedTuple):
    """An optimizer (optimizer.optimizer_factory.name) and its facts, which the modules that need them ask for
    instead of comparing names:
    build(cfg)                   its torch class and options;
    state_bytes(hidden_share)    bytes of its state per element it updates, `hidden_share` of them in hidden
                                 matrices (the memory estimate, docs/memory.md);
    rank_options(model, grad_sync, zero_stage)   the options it takes from this rank's model and process groups;
    updater(cfg, name, ndim)     what updates a parameter (the learning-rate table's column);
    lr_notes(cfg)                lines the learning-rate table adds under its rows;
    hidden_lr_scale(cfg, m)      under µP, its rate on the hidden matrices at width multiplier m over the scheduled
                                 one (None: AdamW's 1/m, model/mup.py);
    problems(cfg)                why its settings cannot run, one line each naming the key ([] when they can)."""
    build: Callable
    state_bytes: Callable[[float], float]
    rank_options: Callable = lambda model, grad_sync, zero_stage: {}
    updater: Callable[[Any, str, int], str] = lambda cfg, name, ndim: cfg.optimizer.optimizer_factory.name
    lr_notes: Callable[[Any], list[str]] = lambda cfg: []
    hidden_lr_scale: Callable[[Any, float], float | None] = lambda cfg, width_multiplier: None
    problems: Callable[[Any], list[str]] = lambda cfg: []


# optimizer.optimizer_factory.name (lowercased) -> its entry. ZeRO shards any optimizer whose update is
# element-wise (parallel/sharding.py); Muon puts its matrices together from the shards (runtime/muon.py).
OPTIMIZERS = {
    "adamw": OptimizerEntry(adamw, state_bytes=lambda hidden_share: 8),   # two float32 moments
    "muon": OptimizerEntry(muon, muon_state_bytes, muon_rank_options, lambda cfg, name, ndim: muon_updater(name, ndim),
                           muon_lr_notes, muon_hidden_lr_scale, muon_problems),
}


def optimizer_parametrization(cfg) -> Parametrization:
    """The config's parametrization with the configured optimizer's rate on the hidden matrices (µP only)."""
    p = parametrization_of(cfg)
    if not p.mup:
        return p
    scale = OPTIMIZERS[optimizer_name(cfg)].hidden_lr_scale(cfg, p.width_multiplier)
    return dataclasses.replace(p, hidden_lr_scale=scale)


def build_optimizer(cfg, model: nn.Module, grad_sync: GradientSync | None = None):
    """The configured optimizer over the model's parameter groups, or, with optimizer.zero_stage >= 1, over this
    rank's shard of `grad_sync`'s buffers (ZeRO, parallel/sharded_optimizer.py)."""
    o, entry = cfg.optimizer, OPTIMIZERS[optimizer_name(cfg)]
    optimizer_class, options = entry.build(cfg)
    groups = parameter_groups(model, o.weight_decay, optimizer_parametrization(cfg))
    if o.zero_stage >= 1 and grad_sync is None:
        raise ValueError(f"optimizer.zero_stage={o.zero_stage} shards the buffers of a GradientSync: pass one")
    options |= entry.rank_options(model, grad_sync, o.zero_stage)
    if o.zero_stage >= 1:
        return ShardedOptimizer(grad_sync, groups, optimizer_class, **options)
    return optimizer_class(groups, **options)


def min_decay_lr(cfg) -> float:
    """The rate the decay ends at: optimizer.learning_rate_scheduler.min_decay_lr, or half the peak if null."""
    s = cfg.optimizer.learning_rate_scheduler
    return s.min_decay_lr if s.min_decay_lr is not None else 0.5 * s.learning_rate


def lr_at(step: int, cfg) -> float:
    """The learning rate used by the update of optimizer step `step` (the first step is 1)."""
    s = cfg.optimizer.learning_rate_scheduler
    peak, warmup = s.learning_rate, s.lr_warmup_steps
    if step <= warmup:
        return peak * step / warmup if s.lr_warmup_style == "linear" else peak
    # After warm-up the rate holds at the peak until lr_decay_starting_step (nanotron's), then decays.
    start = warmup if s.lr_decay_starting_step is None else s.lr_decay_starting_step
    decay_steps = s.lr_decay_steps or max(cfg.tokens.train_steps - start, 1)
    progress = min(max(step - start, 0) / decay_steps, 1.0)
    floor = min_decay_lr(cfg)
    if s.lr_decay_style == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if s.lr_decay_style == "linear":
        return peak - (peak - floor) * progress
    return peak


def set_lr(optimizer, lr: float) -> None:
    """Every group trains at the scheduled `lr` times its lr_scale (µP: 1/m for hidden matrices)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


@torch.no_grad()
def clip_gradients(norm_inputs: tuple[list, list, object], max_norm: float | None, device) -> torch.Tensor:
    """Scale the gradients so that the global norm (each parameter counted once across tp and pp) is at
    most max_norm; returns the norm before, on the device (no host read: the trainer reads it with the step's
    other scalars). `norm_inputs`: GradientSync.norm_inputs (the gradients the
    update reads, those counted in the norm, the group their squares are summed over)."""
    grads, counted, group = norm_inputs
    sq = torch.stack([g.float().pow(2).sum() for g in counted]).sum() if counted else torch.zeros((), device=device)
    if group is not None:
        dist.all_reduce(sq, group=group)
    norm = sq.sqrt()
    if max_norm is not None:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm
