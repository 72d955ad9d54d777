"""The optimizers (`OPTIMIZERS`, optimizer.optimizer_factory.name): each entry's torch class and options and the
facts that validation, the memory estimate, the learning-rate table and µP ask of it."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from nanoexp.config import optimizer_name
from nanoexp.model.mup import Parametrization, parametrization_of
from nanoexp.model.placement import value_name
from nanoexp.optim.muon import MuonWithAdamW, takes_muon
from nanoexp.optim.muon import hidden_lr_scale as muon_hidden_lr_scale
from nanoexp.optim.muon import lr_notes as muon_lr_notes
from nanoexp.optim.muon import problems as muon_problems
from nanoexp.optim.muon import state_bytes as muon_state_bytes
from nanoexp.optim.muon import updater as muon_updater
from nanoexp.parallel.gradient_sync import GradientSync


def adamw(cfg) -> tuple[type, dict]:
    """torch's AdamW (foreach, or fused with torch_adam_is_fused), with nanotron's keys."""
    o, f = cfg.optimizer, cfg.optimizer.optimizer_factory
    fused = bool(f.torch_adam_is_fused)
    return torch.optim.AdamW, dict(lr=o.learning_rate_scheduler.learning_rate, betas=(f.adam_beta1, f.adam_beta2),
                                   eps=f.adam_eps, fused=fused or None, foreach=None if fused else True)


def muon(cfg) -> tuple[type, dict]:
    """Muon on the hidden matrices, AdamW (with the adamW keys) on the rest (optim/muon.py), nanoexp's keys
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
# element-wise (parallel/zero/engine.py); Muon puts its matrices together from the shards (optim/muon.py).
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
