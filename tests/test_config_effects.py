"""Keys without effect (each field's `counts` in nanoexp/config.py, checked by nanoexp/config_domains.py): changed
where the run does not read them, they are refused in one line naming the key and what would make it count; where
they count, the same values pass."""
from __future__ import annotations

import dataclasses
import os
import re

import pytest

from nanoexp.config import CONF_DIR, NanoexpConfig, normalize
from nanoexp.config_domains import field_types, schema_keys, unwrap
from nanoexp.validation import validate
from tests.helpers import compose_config

pytestmark = pytest.mark.quick

CASES = [   # (overrides that set a key where it is not read, the key, what makes it count, overrides that make it count)
    (["optimizer.optimizer_factory.muon_ns_steps=3"], "optimizer.optimizer_factory.muon_ns_steps",
     "optimizer.optimizer_factory.name=muon", ["optimizer.optimizer_factory.name=muon"]),
    (["model.fp8.recipe=rowwise"], "model.fp8.recipe", "model.fp8.enabled=true", ["model.fp8.enabled=true"]),
    (["model.fp8.filter_fqns=[lm_head]"], "model.fp8.filter_fqns", "model.fp8.enabled=true",
     ["model.fp8.enabled=true"]),
    (["model.attention_kernel=sdpa", "parallelism.cp=2"], "model.attention_kernel", "parallelism.cp=1",
     ["parallelism.cp=1"]),
    (["parallelism.cp_mode=all_gather"], "parallelism.cp_mode", "parallelism.cp > 1", ["parallelism.cp=2"]),
    (["parallelism.tp_mode=reduce_scatter"], "parallelism.tp_mode", "parallelism.tp > 1", ["parallelism.tp=2"]),
    (["model.moe.top_k=1"], "model.moe.top_k", "model.moe.num_experts > 0", ["model.moe.num_experts=4"]),
    (["tokens.batch_accumulation_per_replica=2", "tokens.global_batch_size=64"], "tokens.global_batch_size",
     "tokens.batch_accumulation_per_replica=2", ["tokens.global_batch_size=8"]),   # 1 x micro-batch 4 x 2
]


def problem(overrides) -> str:
    cfg = compose_config(overrides)
    normalize(cfg)
    with pytest.raises(Exception) as info:
        validate(cfg)
    return str(info.value)


@pytest.mark.parametrize("overrides, key, needs, fix", CASES, ids=[case[1] for case in CASES])
def test_a_key_without_effect_is_refused_naming_what_makes_it_count(overrides, key, needs, fix):
    message = problem(overrides)
    assert "\n" not in message and f"{key}=" in message and needs in message and "no effect" in message, message
    cfg = compose_config(overrides + fix)   # the same value, where it counts
    normalize(cfg)
    validate(cfg)


def test_a_key_left_at_its_default_is_never_refused():
    """The shipped defaults (conf/ repeats the schema's) pass with a MoE, cp, tp or FP8 (the fields' `counts`
    conditions)."""
    for overrides in ([], ["model=moe_tiny"], ["parallelism.cp=2"], ["parallelism.tp=2"], ["model.fp8.enabled=true"]):
        cfg = compose_config(overrides)
        normalize(cfg)
        validate(cfg)


@pytest.mark.parametrize("group", ["model", "parallelism", "optimizer"])
def test_every_shipped_option_passes(group):
    """No config group option of conf/ sets a key where its own settings do not read it."""
    for name in sorted(name for name in os.listdir(os.path.join(CONF_DIR, group)) if name.endswith(".yaml")):
        cfg = compose_config([f"{group}={name.removesuffix('.yaml')}"])   # conf/model/shared/: a part of each
        normalize(cfg)
        validate(cfg)


def conditions(schema=NanoexpConfig):
    """Every `counts` of the schema's fields."""
    for field in dataclasses.fields(schema):
        inner = unwrap(field_types(schema)[field.name])[0]
        if dataclasses.is_dataclass(inner):
            yield from conditions(inner)
        elif field.metadata.get("counts"):
            yield field.metadata["counts"]


def test_what_makes_a_key_count_names_keys_of_the_schema():
    """Each `needs` starts from a key (or a group choice, fault_tolerance=torchft) of the schema."""
    known = set(schema_keys(NanoexpConfig))
    needs = {counts.needs for counts in conditions()}
    assert len(needs) > 10
    for text in needs:
        assert re.match(r"[\w.]+", text).group(0) in known, text
