"""The rules of every key on its own, before validate's cross-field rules (nanoexp/validation.py): walking a
composed config along the schema (nanoexp.config.NanoexpConfig), each key must be one the schema knows (a key
added with Hydra's `+` is not checked by the schema), be set, and hold a value of its domain: every number of
the right type, every float finite, and each numeric key in the range its entry of DOMAINS gives."""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import typing
from typing import Any, Callable, Iterator, NamedTuple, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from nanoexp.config import NanoexpConfig

Rule = tuple[bool, str]   # (condition, the message shown when it does not hold)


class Domain(NamedTuple):
    """A numeric key's allowed values; null passes where the schema types the key Optional."""
    ok: Callable[[Any], bool]
    allowed: str          # in words: "positive", ">= 0", "in [0, 1)"
    note: str = ""        # what a boundary value or null means, shown in parentheses
    item: str = "value"   # for a list: what its message calls an entry


def at_least(low: int, note: str = "") -> Domain:
    return Domain(lambda value: value >= low, f">= {low}", note)


def positive(note: str = "") -> Domain:
    return Domain(lambda value: value > 0, "positive", note)


SIZE = Domain(lambda value: value > 0, "a positive integer")
FRACTION = Domain(lambda value: 0 <= value < 1, "in [0, 1)")
# general.seed * 1_000_003 seeds torch's generators (nanoexp/model/init.py) and must fit in 64 bits; 2**32 keeps
# it well inside and is the usual range of a seed.
SEED = Domain(lambda seed: 0 <= seed < 2 ** 32, "in [0, 2**32)")
# Every numeric key of the schema, by its dotted name (data_stages[] for each stage). A stage's data keys
# have the data group's domains (null there: the group's value).
DOMAINS: dict[str, Domain] = {
    "general.seed": SEED,
    **{f"tokens.{key}": SIZE for key in ("sequence_length", "micro_batch_size", "global_batch_size", "train_steps")},
    "tokens.batch_accumulation_per_replica": positive("null: global_batch_size / (dp * micro_batch_size)"),
    "tokens.val_check_interval": at_least(0, "0: only at the end"),
    "tokens.limit_val_batches": at_least(0, "0: all held-out data"),
    "model.init_method.std": positive(),
    "model.mup.base_width": positive("the hidden size at which µP equals standard"),
    "model.mup.attention_multiplier": positive(),
    "model.make_vocab_size_divisible_by": SIZE,
    "model.ddp_bucket_cap_mb": positive("MB; null: 25 with NCCL, 4 with gloo"),
    **{f"model.model_config.{key}": SIZE for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                     "num_attention_heads", "vocab_size", "max_position_embeddings")},
    "model.model_config.num_key_value_heads": positive("null: as many as attention heads"),
    "model.model_config.rope_theta": positive(),
    "model.model_config.rms_norm_eps": positive(),
    "model.moe.num_experts": at_least(0, "0: a dense model"),
    "model.moe.top_k": at_least(1),
    "model.moe.moe_intermediate_size": positive("null: model_config.intermediate_size"),
    "model.moe.num_shared_experts": at_least(0),
    "model.moe.layer_frequency": at_least(1),
    "model.moe.aux_loss_coef": at_least(0),
    "model.moe.z_loss_coef": at_least(0),
    "model.moe.capacity_factor": positive("null: dropless"),
    "model.moe.bias_update_rate": positive("null: 0.001, DeepSeek-V3's"),
    "model.moe.seq_aux_loss_coef": at_least(0),
    "optimizer.optimizer_factory.adam_beta1": FRACTION,
    "optimizer.optimizer_factory.adam_beta2": FRACTION,
    "optimizer.optimizer_factory.adam_eps": positive(),
    "optimizer.optimizer_factory.muon_momentum": FRACTION,
    "optimizer.optimizer_factory.muon_ns_steps": Domain(lambda steps: 1 <= steps < 100, "in [1, 100)"),
    "optimizer.optimizer_factory.muon_ns_coefficients": Domain(math.isfinite, "finite", item="coefficient"),
    "optimizer.weight_decay": at_least(0),
    "optimizer.clip_grad": positive("null: no clipping"),
    "optimizer.zero_stage": Domain(lambda stage: stage in (0, 1, 2, 3), "one of 0, 1, 2, 3"),
    "optimizer.zero3_prefetch": at_least(0, "units gathered ahead; 0: none"),
    "optimizer.learning_rate_scheduler.learning_rate": positive(),
    "optimizer.learning_rate_scheduler.lr_warmup_steps": at_least(0),
    "optimizer.learning_rate_scheduler.lr_decay_steps": at_least(1, "train_steps - the step the decay starts at"),
    "optimizer.learning_rate_scheduler.lr_decay_starting_step": at_least(0, "null: where warm-up ends"),
    "optimizer.learning_rate_scheduler.min_decay_lr": at_least(0, "null: half the peak learning_rate"),
    **{f"parallelism.{key}": SIZE for key in ("dp", "tp", "pp", "cp", "pp_virtual_stages")},
    "parallelism.ep": at_least(1, "1: every rank holds every expert"),
    "parallelism.dp_shard": at_least(1, "null: ZeRO shards over all of dp x cp"),
    "parallelism.recompute_every": at_least(1, "1: every layer, as recompute=full"),
    # torch.distributed's clocks overflow on timeouts of about 1e13 s.
    "parallelism.collective_timeout_s": Domain(lambda seconds: 0 < seconds <= 1e9, "positive and at most 1e9",
                                               "seconds"),
    "data.seed": SEED._replace(note="null: general.seed"),
    "data.validation_fraction": Domain(lambda fraction: 0 < fraction < 1, "between 0 and 1"),
    "data.dataset_weights": Domain(lambda weight: weight > 0, "positive", item="weight"),
    "data_stages[].start_training_step": at_least(1),
    "checkpoint.checkpoint_interval": at_least(0, "0: only at the end"),
    "checkpoint.keep_last_n": at_least(1, "null: keep all"),
    "logging.iteration_step_info_interval": positive(),
    "logging.peak_tflops": positive("null: the device's known peak"),
    "logging.profiler.wait": at_least(0),
    "logging.profiler.warmup": at_least(0),
    "logging.profiler.active": at_least(1),
    "eval.interval": at_least(0, "0: only at the end of training"),
    "eval.limit": positive("null: every example"),
    "eval.num_fewshot": at_least(0, "null: the task's default"),
    "eval.batch_size": positive(),
    "eval.bootstrap_iters": at_least(0),
    "fault_injection.nonfinite_loss_at_step": at_least(1, "null: off"),
    "fault_injection.hang_at_step": at_least(1, "null: off"),
    "fault_injection.hang_rank": at_least(0),
    # time.sleep raises OverflowError from about 1e10 s; an hour a step is slower than any host to imitate.
    "fault_injection.slow_step_s": Domain(lambda seconds: 0 <= seconds <= 3600, "between 0 and 3600", "seconds"),
    "fault_injection.slow_start_up_s": Domain(lambda seconds: 0 <= seconds <= 3600, "between 0 and 3600", "seconds"),
    "fault_injection.stall_rank": at_least(0, "null: off"),
    "fault_injection.sigstop_rank": at_least(0, "null: off"),
    "fault_injection.stall_at_step": at_least(1),
    "fault_injection.stall_s": Domain(lambda seconds: 0 <= seconds <= 3600, "between 0 and 3600", "seconds"),
    "fault_injection.skip_collective_rank": at_least(0, "null: off"),
    "fault_injection.wrong_shape_rank": at_least(0, "null: off"),
    "fault_injection.short_pipeline_rank": at_least(0, "null: off"),
    "fault_injection.raise_rank": at_least(0, "null: off"),
    "fault_injection.slow_checkpoint_s": Domain(lambda seconds: 0 <= seconds <= 3600, "between 0 and 3600",
                                                "seconds"),
    "fault_injection.hold_checkpoint_write": at_least(0, "0: off"),
    "fault_injection.kill_group": at_least(0, "null: off"),
    "fault_injection.kill_at_step": at_least(1),
    "fault_tolerance.replica_groups": SIZE,
    "fault_tolerance.min_replicas": SIZE,
    "fault_tolerance.group": at_least(0, "null: every group on this machine"),
    "fault_tolerance.quorum_timeout_s": Domain(lambda seconds: 0 < seconds <= 1e6, "positive and at most 1e6",
                                               "seconds"),
    "fault_tolerance.timeout_s": Domain(lambda seconds: 0 < seconds <= 1e6, "positive and at most 1e6", "seconds"),
    "fault_tolerance.max_restarts": at_least(0, "0: a dead group stays out"),
    "fault_tolerance.sync_every": SIZE,
    "fault_tolerance.outer_lr": positive(),
    "fault_tolerance.outer_momentum": FRACTION,
    "fault_injection.slow_rank": at_least(0, "null: off"),
    "fault_injection.slow_rank_s": Domain(lambda seconds: 0 <= seconds <= 3600, "between 0 and 3600", "seconds"),
    "fault_injection.spike_at_step": at_least(1, "null: off"),
    "fault_injection.flip_gradient_rank": at_least(0, "null: off"),
    "fault_injection.flip_gradient_step": at_least(1),
    "health.every": SIZE,
    "health.straggler_factor": Domain(lambda factor: factor > 1, "above 1", "times the median"),
    "health.straggler_windows": at_least(1),
    "health.spike.window": at_least(1, "steps"),
    "health.spike.z": positive("robust deviations"),
    "health.spike.max_rollbacks": at_least(1),
    "health.replay_every": at_least(0, "0: off"),
    "debug.stall_s": Domain(lambda seconds: 0 <= seconds <= 1e9, "between 0 and 1e9", "seconds, null: auto, 0: off"),
    "debug.flight_recorder_entries": at_least(0, "0: off"),
}


def schema_rules(cfg: Any) -> list[Rule]:
    """One rule per key of `cfg`: known to the schema, set, and (a number) in its domain."""
    return [key_rule(key, hint, value) for key, hint, value in walk(cfg, NanoexpConfig)]


def walk(node: Any, schema: type, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(key, type, value) of every leaf of config `node`, typed by the dataclass `schema`; the type is None for
    a key the schema does not know, the value MISSING for one not set (???)."""
    types = field_types(schema)
    for name in node:
        key, hint = f"{prefix}{name}", types.get(name)
        if hint is None or OmegaConf.is_missing(node, name):
            yield key, hint, MISSING
            continue
        value, inner = node[name], unwrap(hint)[0]
        if dataclasses.is_dataclass(inner) and isinstance(value, DictConfig):
            yield from walk(value, inner, key + ".")
        elif dataclasses.is_dataclass(element(inner)) and value is not None:
            for i, item in enumerate(value):
                yield from walk(item, element(inner), f"{key}[{i}].")
        else:
            yield key, hint, value


def key_rule(key: str, hint: Any, value: Any) -> Rule:
    if hint is None:
        return False, unknown_key(key)
    if value is MISSING:
        return False, f"{key}=???: must be set (it has no default)"
    number, optional = unwrap(hint)
    is_list = typing.get_origin(number) is list
    number = element(number) if is_list else number
    if number not in (int, float):
        return True, ""
    return number_rule(key, number, is_list, optional, value)


def number_rule(key: str, number: type, is_list: bool, optional: bool, value: Any) -> Rule:
    """The rule of a numeric key (a list's: of each entry) from its domain: the type, finite, the range."""
    domain = domain_of(key)
    allowed = domain.allowed + (" or null" if optional else "") + (f" ({domain.note})" if domain.note else "")
    if value is None:   # only a config the schema does not type (a checkpoint's) holds null in a non-Optional key
        return optional, f"{key}=None: must be {allowed}"
    values = list(value) if is_list else [value]
    wrong_type = [v for v in values if isinstance(v, bool) or not isinstance(v, int if number is int else (int, float))]
    nonfinite = [v for v in values if isinstance(v, float) and not math.isfinite(v)]
    if not wrong_type and not nonfinite and all(domain.ok(v) for v in values):
        return True, ""
    must = requirement(number, wrong_type, nonfinite)
    if is_list:
        return False, f"{key}={values}: every {domain.item} must be {must}{domain.allowed}"
    return False, f"{key}={value}: must be {must}{allowed}"


def requirement(number: type, wrong_type: list, nonfinite: list) -> str:
    """What a value failed before its range: its type (in a config the schema does not type), or being finite."""
    if wrong_type:
        return "an integer, " if number is int else "a number, "
    return "finite and " if nonfinite else ""


def domain_of(key: str) -> Domain:
    return DOMAINS[re.sub(r"\[\d+\]", "[]", re.sub(r"^data_stages\[\d+\]\.data\.", "data.", key))]


def unknown_key(key: str) -> str:
    """The message for a key the schema does not know, with the nearest known key (in the same stage)."""
    if key == "plan":   # +plan=topK is a sweep's (hydra_plugins/nanoexp_sweeper.py)
        return "plan: +plan=topK runs the planner's top K layouts as a sweep: add -m (python train.py -m +plan=top4)"
    stage = re.match(r"data_stages\[\d+\]", key)
    nearest = difflib.get_close_matches(re.sub(r"\[\d+\]", "[]", key), schema_keys(NanoexpConfig), n=1)
    if not nearest:
        return f"{key}: not a key of nanoexp's config: remove it (nanoexp/config.py lists the keys)"
    suggestion = nearest[0].replace("data_stages[]", stage.group(0)) if stage else nearest[0]
    return f"{key}: not a key of nanoexp's config (did you mean {suggestion}?)"


@functools.cache
def schema_keys(schema: type, prefix: str = "") -> tuple[str, ...]:
    """Every key of the schema, dotted, with data_stages[] for a stage's."""
    keys: list[str] = []
    for name, hint in field_types(schema).items():
        key, inner = prefix + name, unwrap(hint)[0]
        keys.append(key)
        if dataclasses.is_dataclass(inner):
            keys += schema_keys(inner, key + ".")
        elif dataclasses.is_dataclass(element(inner)):
            keys += schema_keys(element(inner), key + "[].")
    return tuple(keys)


@functools.cache
def field_types(schema: type) -> dict[str, Any]:
    return typing.get_type_hints(schema)


def unwrap(hint: Any) -> tuple[Any, bool]:
    """(the type inside Optional, whether null is allowed)."""
    if typing.get_origin(hint) is typing.Union:
        inner = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return inner[0], len(inner) < len(typing.get_args(hint))
    return hint, False


def element(hint: Any) -> Optional[Any]:
    """A List[X]'s X (None for any other type)."""
    return typing.get_args(hint)[0] if typing.get_origin(hint) is list else None
