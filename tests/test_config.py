"""The schema rejects unknown keys; validate() names the key and the fix for each bad value."""
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf

from nanoexp.config import ConfigError, batch_accumulation, global_batch_size, normalize, stage_data
from nanoexp.parallel.layout import Layout
from nanoexp.validation import validate
from tests.helpers import CONF_DIR, compose_config


def test_defaults_compose_and_validate():
    cfg = compose_config([])
    validate(cfg, world_size=1, tokenizer_vocab_size=257)
    assert global_batch_size(cfg) == 32 and batch_accumulation(cfg) == 8


@pytest.mark.parametrize("layout", sorted(f[:-5] for f in os.listdir(os.path.join(CONF_DIR, "parallelism"))))
def test_every_shipped_layout_keeps_the_global_batch(layout):
    cfg = compose_config([f"parallelism={layout}"])
    validate(cfg, world_size=Layout.from_config(cfg).world_size, tokenizer_vocab_size=257)
    assert global_batch_size(cfg) == 32


def set_values(node, prefix=""):
    """{dotted key: value} of every leaf of a config tree; a key left MISSING counts as not set."""
    values = {}
    for key in node:
        if not OmegaConf.is_missing(node, key):
            child = node[key]
            values.update(set_values(child, f"{prefix}{key}.") if isinstance(child, DictConfig)
                          else {f"{prefix}{key}": child})
    return values


def test_schema_defaults_agree_with_conf():
    """conf/ is where defaults are read: a key that both the bare schema and `python train.py`'s composed
    config set has one value in both, so the schema's default can never silently differ from conf's."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        schema = set_values(compose(config_name="nanoexp_schema"))   # the bare schema still composes alone
    composed = set_values(compose_config([]))
    shared = schema.keys() & composed.keys()
    assert len(shared) > 70   # the walk reached every group
    differing = {key: (schema[key], composed[key]) for key in shared if schema[key] != composed[key]}
    assert not differing, f"schema default vs conf/ (key: (schema, conf)): {differing}"


def test_an_experiment_with_data_stages_composes():
    """conf/experiment/two_stages.yaml: a typed list of stages, each `data` holding only what it overrides."""
    cfg = compose_config(["+experiment=two_stages"])
    assert [(s.name, s.start_training_step, s.data.name) for s in cfg.data_stages] == [
        ("stable", 1, "builtin"), ("anneal", 201, "nanoset")]
    assert list(stage_data(cfg, cfg.data_stages[1]).dataset_folder) == ["data/nanoset/anneal"]
    assert stage_data(cfg, cfg.data_stages[1]).validation_fraction == cfg.data.validation_fraction
    with pytest.raises(ConfigCompositionException):   # a stage's data is typed like the data group
        compose_config(["data_stages=[{name: a, start_training_step: 1, data: {validation_fraction: most}}]"])


def test_unknown_key_is_rejected_with_its_name():
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["model.model_config.hiden_size=64"])
    assert "hiden_size" in str(info.value.__cause__ or info.value)


def test_wrong_type_is_rejected():
    with pytest.raises(ConfigCompositionException):
        compose_config(["tokens.micro_batch_size=four"])


@pytest.mark.parametrize("overrides, key", [
    (["model.model_config.num_attention_heads=5"], "hidden_size"),
    (["model.model_config.num_key_value_heads=3"], "num_key_value_heads"),
    (["tokens.sequence_length=4096"], "max_position_embeddings"),
    (["parallelism.tp=3"], "parallelism.tp=3"),
    (["parallelism.pp=8"], "num_hidden_layers"),
    (["parallelism.pp_engine=gpipe"], "parallelism.pp_engine"),
    (["parallelism.tp_mode=ring"], "parallelism.tp_mode"),
    (["tokens.global_batch_size=30"], "tokens.global_batch_size"),
    (["tokens.micro_batch_size=0"], "tokens.micro_batch_size"),
    (["optimizer.learning_rate_scheduler.lr_decay_style=exp"], "lr_decay_style"),
    (["optimizer.learning_rate_scheduler.lr_warmup_steps=5000"], "lr_warmup_steps"),
    (["optimizer.optimizer_factory.name=sgd"], "optimizer.optimizer_factory.name"),
    (["model.dtype=float16"], "model.dtype"),
])
def test_invalid_values_name_the_key(overrides, key):
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size=Layout.from_config(cfg).world_size, tokenizer_vocab_size=257)
    assert key in str(info.value)


def test_world_size_mismatch_and_small_vocab():
    cfg = compose_config(["parallelism=dp2tp1pp1"])
    with pytest.raises(ConfigError, match="world size is 4"):
        validate(cfg, world_size=4)
    cfg = compose_config(["model.model_config.vocab_size=200"])
    with pytest.raises(ConfigError, match="vocab_size=200"):
        validate(cfg, world_size=1, tokenizer_vocab_size=257)


def test_upper_case_enums_are_normalised_before_a_read_only_validation():
    cfg = compose_config(["parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER", "parallelism.pp_engine=1F1B"])
    before = OmegaConf.to_container(cfg)
    with pytest.raises(ConfigError, match="parallelism.tp_mode=REDUCE_SCATTER"):
        validate(cfg, world_size=2, tokenizer_vocab_size=257)
    assert OmegaConf.to_container(cfg) == before   # validate only reads
    normalize(cfg)
    validate(cfg, world_size=2, tokenizer_vocab_size=257)
    assert cfg.parallelism.tp_mode == "reduce_scatter" and cfg.parallelism.pp_engine == "1f1b"
    assert Layout.from_config(cfg).sequence_parallel


def test_explicit_accumulation_wins():
    cfg = compose_config(["tokens.batch_accumulation_per_replica=2", "parallelism.dp=2"])
    assert global_batch_size(cfg) == 2 * 4 * 2


def test_command_line_errors_are_short(tmp_path):
    """train.py prints one readable message and exits non-zero, with no traceback."""
    root = __file__.rsplit("/tests/", 1)[0]
    for override, needle in [("model.model_config.hiden_size=64", "hiden_size"),
                             ("parallelism.tp=3", "parallelism.tp=3")]:
        proc = subprocess.run([sys.executable, "train.py", override, f"hydra.run.dir={tmp_path}/run"],
                              cwd=root, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0
        assert needle in proc.stderr
        assert "Traceback" not in proc.stderr
