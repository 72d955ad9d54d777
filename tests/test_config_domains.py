"""Every key on its own, checked at start (nanoexp/config_domains.py): each numeric key's domain, declared with its
field in nanoexp/config.py and found by walking the schema here, so that a key added later is covered without a new
test; and keys the schema does not know, however they were added, refused with the nearest known key."""
import copy
import dataclasses
import subprocess
import sys
import typing

import pytest
from omegaconf import OmegaConf

from nanoexp.config import ConfigError, NanoexpConfig
from nanoexp.config_domains import Domain
from nanoexp.validation import validate
from tests.helpers import compose_config

ONE_STAGE = ["data_stages=[{name: a, start_training_step: 1}]"]   # so that a stage's keys are walked too
# Keys whose domain includes -1, each with the reason.
NEGATIVE_ONE_IS_VALID: dict[str, str] = {
    "optimizer.optimizer_factory.muon_ns_coefficients": "Newton–Schulz coefficients may be negative (b = -4.775)",
}


def numeric_leaves(schema=NanoexpConfig, prefix=""):
    """(dotted key, int or float, whether a list of them) of every numeric field of the schema; a stage's as
    data_stages[0]."""
    for key, _, number, listed in numeric_fields(schema, prefix):
        yield key, number, listed


def numeric_fields(schema=NanoexpConfig, prefix=""):
    """(dotted key, field, int or float, whether a list of them) of every numeric field of the schema."""
    for field in dataclasses.fields(schema):
        hint = typing.get_type_hints(schema)[field.name]
        args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        inner = args[0] if typing.get_origin(hint) is typing.Union else hint
        listed = typing.get_args(inner)[0] if typing.get_origin(inner) is list else None
        key = prefix + field.name
        if dataclasses.is_dataclass(inner):
            yield from numeric_fields(inner, key + ".")
        elif dataclasses.is_dataclass(listed):
            yield from numeric_fields(listed, key + "[0].")
        elif inner in (int, float) or listed in (int, float):
            yield key, field, inner if listed is None else listed, listed is not None


LEAVES = list(numeric_leaves())


@pytest.fixture(scope="module")
def base():
    cfg = compose_config(ONE_STAGE)
    validate(cfg, tokenizer_vocab_size=257)   # the unchanged config passes
    return cfg


def problem(cfg) -> str:
    """validate's one-line message for `cfg` (fails unless exactly one rule is broken)."""
    with pytest.raises(ConfigError) as info:
        validate(cfg, tokenizer_vocab_size=257)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def with_value(base, key: str, value):
    cfg = copy.deepcopy(base)
    OmegaConf.update(cfg, key.replace("[0]", ".0"), value, merge=False)
    return cfg


def test_the_walk_reaches_every_group():
    keys = {key for key, _, _ in LEAVES}
    assert len(keys) > 70 and {"general.seed", "data_stages[0].start_training_step", "data.dataset_weights",
                               "fault_injection.slow_step_s", "model.moe.z_loss_coef"} <= keys


def test_every_numeric_key_declares_its_domain():
    """Its field's `key(default, domain)`; a stage's data keys have the data group's domains."""
    fields = {key: field for key, field, _, _ in numeric_fields()}
    assert [key for key, field in fields.items() if not isinstance(field.metadata.get("domain"), Domain)] == []
    assert fields["data_stages[0].data.seed"].metadata == fields["data.seed"].metadata


@pytest.mark.parametrize("key, number, listed", LEAVES, ids=[key for key, _, _ in LEAVES])
def test_an_out_of_domain_number_is_refused_naming_the_key(base, key, number, listed):
    bad = [-1] + ([float("nan"), float("inf"), -float("inf")] if number is float else [])
    for value in bad:
        cfg = with_value(base, key, [value] if listed else value)
        if value == -1 and key in NEGATIVE_ONE_IS_VALID:
            muon = with_value(base, "optimizer.optimizer_factory.name", "muon")   # where the key is read
            # (2, -1, 0): a cubic Newton–Schulz iteration that converges (all three at -1 diverge: muon.problems)
            validate(with_value(muon, key, [2.0, value, 0.0]), tokenizer_vocab_size=257)
            continue
        message = problem(cfg)
        assert f" {key}=" in message, (value, message)


@pytest.mark.parametrize("overrides", [
    ["general.seed=0"], ["tokens.val_check_interval=0"], ["tokens.limit_val_batches=0"], ["optimizer.clip_grad=null"],
    ["optimizer.weight_decay=0"], ["model=moe_tiny", "model.moe.z_loss_coef=0"], ["model=moe_tiny", "model.moe.aux_loss_coef=0"],
    ["eval.num_fewshot=0"],
    ["fault_injection.slow_step_s=0"], ["fault_injection.hang_at_step=1"], ["parallelism.collective_timeout_s=1e9"],
    ["parallelism=dp2tp1pp1", "fault_injection.hang_rank=1"], ["model.ddp_bucket_cap_mb=0.5"],
    ["logging.peak_tflops=12.5"], ["logging.profiler.wait=0", "logging.profiler.warmup=0"],
    ["model=moe_tiny", "model.moe.capacity_factor=1.25"],
])
def test_values_at_the_edge_of_their_domain_pass(overrides):
    validate(compose_config(overrides), tokenizer_vocab_size=257)


@pytest.mark.parametrize("overrides, message", [
    (["fault_injection.hang_rank=2", "parallelism=dp2tp1pp1"], "fault_injection.hang_rank=2: must be below "
     "dp*cp*tp*pp = 2"),
    (["parallelism.collective_timeout_s=1e12"],
     "parallelism.collective_timeout_s=1000000000000.0: must be positive and at most 1e9"),
    (["fault_injection.slow_step_s=1e10"], "fault_injection.slow_step_s=10000000000.0: must be between 0 and 3600"),
    (["general.seed=4294967296"], "general.seed=4294967296: must be in [0, 2**32)"),
    (["model.model_config.num_key_value_heads=0"], "num_key_value_heads=0: must be positive or null"),
    (["model.ddp_bucket_cap_mb=0"], "model.ddp_bucket_cap_mb=0.0: must be positive or null"),
    (["model.moe.router=sigmoid"], "model.moe.router=sigmoid: allowed values are"),   # on a dense model too
    (["model.moe.top_k=0"], "model.moe.top_k=0: must be >= 1"),
    (["data.dataset_weights=[0.5,nan]"], "data.dataset_weights=[0.5, nan]: every weight must be finite and positive"),
    (["data_stages=[{name: a, start_training_step: 1, data: {validation_fraction: 1.5}}]"],
     "data_stages[0].data.validation_fraction=1.5: must be between 0 and 1 or null"),
])
def test_a_bad_value_names_the_key_and_the_fix(overrides, message):
    assert message in problem(compose_config(overrides))


@pytest.mark.parametrize("overrides, message", [
    (["+model.model_config.hiden_size=64"],
     "model.model_config.hiden_size: not a key of nanoexp's config (did you mean model.model_config.hidden_size?)"),
    (["+logging.profiler.wiat=3"], "logging.profiler.wiat: not a key of nanoexp's config (did you mean "
     "logging.profiler.wait?)"),
    (["+model.hidden_size=64"], "model.hidden_size: not a key of nanoexp's config (did you mean "
     "model.model_config.hidden_size?)"),
    (["+trainer.steps=3"],   # a new section, named once
     "trainer: not a key of nanoexp's config: remove it (nanoexp/config.py lists the keys)"),
    (["+experiment=two_stages", "+data_stages.1.data.nmae=web"],
     "data_stages[1].data.nmae: not a key of nanoexp's config (did you mean data_stages[1].data.name?)"),
    (["+experiment=two_stages", "+data_stages.0.strat_training_step=1"], "data_stages[0].strat_training_step: not a "
     "key of nanoexp's config (did you mean data_stages[0].start_training_step?)"),
])
def test_an_added_unknown_key_is_refused_with_the_nearest_key(overrides, message):
    assert problem(compose_config(overrides)) == f"invalid config: {message}"


def test_a_config_the_schema_does_not_type_is_walked_too():
    """A checkpoint's saved config, as offline evaluation validates it: plain, so only the walk sees its keys."""
    plain = OmegaConf.create(OmegaConf.to_container(compose_config([])))
    validate(plain, tokenizer_vocab_size=257)
    misspelled = copy.deepcopy(plain)
    misspelled.merge_with(OmegaConf.from_dotlist(["eval.limt=4"]))
    assert "eval.limt: not a key of nanoexp's config (did you mean eval.limit?)" in problem(misspelled)
    wrong_type = copy.deepcopy(plain)
    wrong_type.merge_with(OmegaConf.from_dotlist(["eval.limit=four"]))
    assert "eval.limit=four: must be an integer, positive or null" in problem(wrong_type)


@pytest.mark.parametrize("override, needle", [
    ("+model.model_config.hiden_size=64", "did you mean model.model_config.hidden_size?"),
    ("model.model_config.rope_theta=-1", "model.model_config.rope_theta=-1.0: must be positive"),
])
def test_train_py_stops_with_one_line(override, needle, tmp_path):
    root = __file__.rsplit("/tests/", 1)[0]
    proc = subprocess.run([sys.executable, "train.py", "debug=fast", override, f"hydra.run.dir={tmp_path}/run"],
                          cwd=root, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("nanoexp: invalid config: "), proc.stderr
    assert needle in lines[0] and not (tmp_path / "run").exists()
