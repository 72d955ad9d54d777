"""Keys that count only under another setting. Set away from their default where they have no effect, they are
refused, naming the key and what would make it count: nothing a user typed is silently ignored.

Each `Effect` is a key (or every key under a group, but those it names) with the condition under which the run
reads it. The default is the schema's (nanoexp/config.py), which the conf/ groups repeat. Rules of this kind
that need more than "changed where unread" live with their feature (validation.zero_rules, balance_rules).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from omegaconf import OmegaConf

from nanoexp.config import NanoexpConfig, recompute_mode, replica_groups, uses_muon
from nanoexp.config_domains import Rule


@dataclass(frozen=True)
class Effect:
    key: str                              # a dotted key, or a group ending in ".*" (each of its keys)
    counts: Callable[[Any], bool]         # whether the run reads it under `cfg`
    needs: str                            # what would make it count
    besides: tuple[str, ...] = ()         # a group's keys that this entry does not cover


def compares_ranks(cfg: Any) -> bool:
    """Whether the straggler detector runs: on, with ranks doing the same work to compare (nanoexp/health/)."""
    p = cfg.parallelism
    return bool(cfg.health.stragglers) and p.dp * p.cp * p.tp > 1


EFFECTS = (
    Effect("optimizer.optimizer_factory.muon_*", uses_muon, "optimizer.optimizer_factory.name=muon"),
    Effect("model.fp8.*", lambda cfg: cfg.model.fp8.enabled, "model.fp8.enabled=true",
           besides=("enabled", "gather_in_fp8")),   # gather_in_fp8: numerics/fp8.py's problems say more
    Effect("model.moe.*", lambda cfg: cfg.model.moe.num_experts > 0, "model.moe.num_experts > 0",
           besides=("num_experts",)),
    Effect("model.attention_kernel", lambda cfg: cfg.parallelism.cp == 1,
           "parallelism.cp=1 (with cp > 1 attention runs parallelism.cp_mode's kernel)"),
    Effect("parallelism.cp_mode", lambda cfg: cfg.parallelism.cp > 1, "parallelism.cp > 1"),
    Effect("parallelism.tp_mode", lambda cfg: cfg.parallelism.tp > 1, "parallelism.tp > 1"),
    Effect("fault_injection.kill_at_step", lambda cfg: cfg.fault_injection.kill_group is not None,
           "fault_injection.kill_group set"),
    Effect("fault_tolerance.*", lambda cfg: cfg.fault_tolerance.method != "none", "fault_tolerance=torchft",
           besides=("method", "max_restarts", "sync_every", "outer_lr", "outer_momentum")),
    Effect("fault_tolerance.max_restarts", lambda cfg: cfg.fault_tolerance.method != "none" and
           cfg.fault_tolerance.group is None, "fault_tolerance=torchft with fault_tolerance.group=null (the groups "
           "started on this machine, which nanoexp restarts)"),
    Effect("fault_tolerance.sync_every", lambda cfg: cfg.fault_tolerance.semi_sync == "diloco",
           "fault_tolerance.semi_sync=diloco"),
    Effect("fault_tolerance.outer_*", lambda cfg: cfg.fault_tolerance.semi_sync == "diloco",
           "fault_tolerance.semi_sync=diloco"),
    *(Effect(key, compares_ranks, "health.stragglers=true and two or more ranks per pipeline stage (dp x cp x tp)")
      for key in ("health.every", "health.straggler_*")),
    Effect("health.spike.*", lambda cfg: cfg.health.spike.action != "off", "health.spike.action other than off",
           besides=("action", "max_rollbacks")),
    Effect("health.spike.max_rollbacks", lambda cfg: cfg.health.spike.action == "rollback",
           "health.spike.action=rollback"),
    Effect("health.replay_action", lambda cfg: cfg.health.replay_every > 0, "health.replay_every > 0"),
    Effect("parallelism.recompute_every", lambda cfg: recompute_mode(cfg) == "every_k", "parallelism.recompute=every_k"),
    Effect("parallelism.selective_ops", lambda cfg: recompute_mode(cfg) == "selective",
           "parallelism.recompute=selective"),
    # a recomputed layer keeps only what checkpoint holds itself (its input, the kept ops' outputs): nothing to move
    Effect("parallelism.offload_activations", lambda cfg: recompute_mode(cfg) == "none" or (
        recompute_mode(cfg) == "every_k" and cfg.parallelism.recompute_every > 1),
           "parallelism.recompute=none, or every_k with recompute_every > 1 (the layers it does not recompute)"),
)


def effect_rules(cfg: Any) -> list[Rule]:
    """One rule per key of EFFECTS that differs from its default where it is not read."""
    defaults = OmegaConf.structured(NanoexpConfig)
    rules = []
    for effect in EFFECTS:
        if effect.counts(cfg):
            continue
        for key in keys_of(effect, defaults):
            value, default = lookup(cfg, key), lookup(defaults, key)
            if plain(value) != plain(default):
                rules.append((False, f"{key}={plain(value)} has no effect here: it counts with {effect.needs}; "
                                     f"set that, or leave {key} at {plain(default)}"))
    return rules + [batch_size_rule(cfg, defaults)]


def batch_size_rule(cfg: Any, defaults: Any) -> Rule:
    """tokens.batch_accumulation_per_replica sets the batch (dp x micro_batch_size x it): a global_batch_size
    changed beside it must agree."""
    t, dp, groups = cfg.tokens, cfg.parallelism.dp, replica_groups(cfg)
    if t.batch_accumulation_per_replica is None or t.global_batch_size == defaults.tokens.global_batch_size:
        return True, ""
    product = dp * groups * t.micro_batch_size * t.batch_accumulation_per_replica
    return (t.global_batch_size == product, f"tokens.global_batch_size={t.global_batch_size} has no effect beside "
            f"tokens.batch_accumulation_per_replica={t.batch_accumulation_per_replica}, which makes the batch "
            f"parallelism.dp{' x fault_tolerance.replica_groups' if groups > 1 else ''} x micro_batch_size x it = "
            f"{product}: set one of the two")


def keys_of(effect: Effect, defaults: Any) -> list[str]:
    if not effect.key.endswith("*"):
        return [effect.key]
    group, _, stem = effect.key.rpartition(".")
    stem = stem.rstrip("*")
    return [f"{group}.{name}" for name in lookup(defaults, group) if name.startswith(stem)
            and name not in effect.besides]


def lookup(node: Any, key: str) -> Any:
    return functools.reduce(lambda n, part: n[part], key.split("."), node)


def plain(value: Any) -> Any:
    """A config value comparable with ==: lists and dicts as Python's."""
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
