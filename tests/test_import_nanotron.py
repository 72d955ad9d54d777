"""The nanotron importer (nanoexp/interop/nanotron.py, scripts/import_nanotron_config.py) on nanotron configs written
for these tests (tests/nanotron_configs/): the experiment composes, validates and trains with the source's layout,
shapes, schedule, steps and data stages; every key without a counterpart is listed with its reason; a file that is
not a nanotron config is refused and nothing is written."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from nanoexp.interop.nanotron import Import, NotANanotronConfig, write_experiment
from nanoexp.checks import check_config
from nanoexp.run import run
from nanoexp.validation import validate
from tests.data_files import random_documents, write_jsonl
from tests.helpers import CONF_DIR, read_metrics
from tests.test_nanoset import write_nanoset

SOURCES = __file__.rsplit("/", 1)[0] + "/nanotron_configs/"
LR = "optimizer.learning_rate_scheduler."


@pytest.fixture
def conf(tmp_path):
    """A copy of conf/ that the importer writes its experiments into (conf/experiment/<name>.yaml)."""
    shutil.copytree(CONF_DIR, tmp_path / "conf")
    return tmp_path / "conf"


def imported(conf, source: str, name: str, edit=lambda text: text):
    """Import tests/nanotron_configs/<source> (DATA -> the test's folder) as the experiment <name>; return (the
    Import, or the NotANanotronConfig that refused the file; the experiment's text; a function composing
    `+experiment=<name>` with overrides)."""
    nanotron = conf.parent / f"{name}.nanotron.yaml"
    nanotron.write_text(edit(open(SOURCES + source).read()).replace("DATA", str(conf.parent)))
    out = conf / "experiment" / f"{name}.yaml"
    try:
        result = write_experiment(str(nanotron), name, str(out))[0]
    except NotANanotronConfig as error:
        result = error

    def composed(overrides=()):
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            return compose(config_name="config", overrides=[f"+experiment={name}", *overrides])
    return result, out.read_text() if out.exists() else None, composed


def not_carried_over(text: str) -> str:
    return text.split("# Not carried over")[1].split("# Nothing to set")[0]


def test_hf_stages_on_a_sequence_parallel_pipeline(tmp_path, conf):
    write_jsonl(tmp_path / "web.jsonl", random_documents(200, seed=1))
    write_jsonl(tmp_path / "curated.jsonl", random_documents(200, seed=2), key="content")
    imp, text, composed = imported(conf, "hf_two_stages.yaml", "hf_stages")
    assert isinstance(imp, Import)
    printed = "\n".join(imp.dropped)   # what the script prints under "not carried over"
    for listed in ("lighteval = ", "s3_upload = ", "parallelism.tp_linear_async_communication = true",
                   "data_stages[0].data.num_loading_workers = 2", "logging.log_level = \"warning\"",
                   "profiler.profiler_export_path = ", "general.ignore_sanity_checks = true"):
        assert listed in not_carried_over(text) and listed in printed, listed
    cfg = composed()
    p, m = cfg.parallelism, cfg.model.model_config
    assert (p.dp, p.tp, p.pp, p.pp_engine, p.tp_mode) == (1, 2, 2, "1f1b", "reduce_scatter")
    assert (m.hidden_size, m.intermediate_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads,
            m.vocab_size, m.rope_theta, m.tie_word_embeddings) == (64, 128, 4, 4, 2, 257, 500000.0, True)
    assert cfg.model.make_vocab_size_divisible_by == 64   # nanotron pads to a multiple of 32 x tp
    assert (cfg.model.dtype, cfg.model.init_method.std, cfg.general.seed) == ("bfloat16", 0.05, 7)
    prof = cfg.logging.profiler   # nanotron's profiler defaults: 3 skipped + 1 waiting step, 1 warm-up, 1 recorded
    assert (prof.enabled, prof.wait, prof.warmup, prof.active) == (True, 4, 1, 1)
    assert (cfg.tokens.train_steps, cfg.tokens.micro_batch_size, cfg.tokens.batch_accumulation_per_replica,
            cfg.tokens.global_batch_size) == (5, 2, 2, 4)
    assert [(s.name, s.start_training_step, s.data.text_column_name) for s in cfg.data_stages] == [
        ("Stable Training Stage", 1, "text"), ("Annealing Phase", 4, "content")]
    check_config(cfg, world_size=4)
    run(cfg, str(tmp_path / "run"))
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["stage"] for r in records] == ["Stable Training Stage"] * 3 + ["Annealing Phase"] * 2
    # The source's schedule: warm-up to 1e-3 at step 1, the peak until lr_decay_starting_step=3, a 2-step cosine.
    expected = [1e-3, 1e-3, 1e-3, 1e-4 + 0.9e-3 * 0.5, 1e-4]
    assert all(math.isclose(r["lr"], e, rel_tol=1e-12) for r, e in zip(records, expected)), [r["lr"] for r in records]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["status"], summary["layout"], summary["train_steps"]) == ("completed", "dp1tp2pp2", 5)
    assert (tmp_path / "checkpoints" / "4" / "meta.json").exists()   # checkpoints_path and interval carried over


def test_nanoset_forms_and_nanotron_defaults(tmp_path, conf):
    web = write_nanoset(tmp_path / "web", random_documents(200, seed=3))
    code_folder = write_nanoset(tmp_path / "code", random_documents(100, seed=4))
    imp, text, composed = imported(conf, "nanoset_forms.yaml", "nanosets")
    assert isinstance(imp, Import)
    assert "parallelism.expert_parallel_size = 2" in not_carried_over(text)
    assert "seed = " not in not_carried_over(text)   # the weights' seed and the data's, both carried over
    cfg = composed()
    tokens = [json.load(open(f"{f}/metadata.json"))["num_tokens"] for f in (web, code_folder)]
    assert [(s.data.name, list(s.data.dataset_folder), s.data.dataset_weights and list(s.data.dataset_weights))
            for s in cfg.data_stages] == [("nanoset", [web], None),
                                         ("nanoset", [web, code_folder], tokens),   # nanotron blends a list by size
                                         ("nanoset", [web, code_folder], [0.8, 0.2])]
    lr = cfg.optimizer.learning_rate_scheduler
    # nanotron's defaults where the file is silent: afab, linear decay over train - warm-up, min = the peak.
    assert (cfg.parallelism.pp_engine, lr.lr_decay_style, lr.lr_decay_steps, lr.min_decay_lr) == (
        "afab", "linear", 4, 3e-3)
    assert (cfg.general.seed, cfg.optimizer.zero_stage, cfg.optimizer.clip_grad,
            cfg.model.model_config.num_key_value_heads, cfg.checkpoint.save_final_state) == (42, 1, None, None, False)
    assert [s.data.seed for s in cfg.data_stages] == [1234, 1234, 1234]
    check_config(cfg, world_size=2)
    run(cfg, str(tmp_path / "run"))
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["stage"] for r in records] == ["one folder"] * 2 + ["a list"] * 2 + ["weighted"] * 2
    assert [r["lr"] for r in records] == [1.5e-3] + [3e-3] * 5
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["layout"] == "dp2tp1pp1"


def test_context_parallel_size_becomes_cp(conf):
    def cp2(text):
        return text.replace("  dp: 2\n", "  dp: 1\n  context_parallel_size: 2\n", 1)
    imp, text, composed = imported(conf, "nanoset_forms.yaml", "cp", edit=cp2)
    assert isinstance(imp, Import) and "parallelism.context_parallel_size =" not in text   # mapped, not listed
    cfg = composed()
    assert (cfg.parallelism.dp, cfg.parallelism.cp) == (1, 2)
    validate(cfg, world_size=2)   # dp * cp * tp * pp = 2; the sequence (32) divides by 2 * cp


def test_the_weights_seed_and_each_stages_data_seed_are_carried_over(conf):
    """nanotron seeds the weights with general.seed and each stage's samples with its data.seed: so does the
    imported experiment (once both were folded into one seed, the stages' for the weights too)."""
    def seeds(text):
        return text.replace("  seed: 42", "  seed: 7", 1).replace("seed: 1234", "seed: 11", 1)

    imp, text, composed = imported(conf, "nanoset_forms.yaml", "seeds", edit=seeds)
    cfg = composed()
    assert isinstance(imp, Import)
    assert cfg.general.seed == 7 and [s.data.seed for s in cfg.data_stages] == [11, 1234, 1234]
    assert "seed = " not in not_carried_over(text)
    refused = imported(conf, "nanoset_forms.yaml", "seeds")[0]   # an existing experiment needs --force
    assert isinstance(refused, NotANanotronConfig) and "seeds.yaml exists: pass --force to replace it" in str(refused)


def test_decay_length_of_a_schedule_with_a_late_decay_start(conf):
    """nanotron's null lr_decay_steps with lr_decay_starting_step set is train_steps - warm-up - the start
    (its lr_scheduler_builder): warm-up 10, the peak until 40, decay over 50 steps; the last step's rate is
    min_decay_lr (the importer once wrote train_steps - warm-up, 90, and the run ended above it)."""
    from nanoexp.optim.schedule import lr_at

    def late_decay(text):
        return (text.replace("    lr_warmup_steps: 2\n", "    lr_warmup_steps: 10\n    lr_decay_starting_step: 40\n"
                             "    lr_decay_style: cosine\n    min_decay_lr: 3.0e-4\n", 1)
                .replace("  train_steps: 6\n", "  train_steps: 100\n", 1))
    imp, _, composed = imported(conf, "nanoset_forms.yaml", "late_decay", edit=late_decay)
    cfg = composed()
    lr = cfg.optimizer.learning_rate_scheduler
    assert isinstance(imp, Import)
    assert (lr.lr_warmup_steps, lr.lr_decay_starting_step, lr.lr_decay_steps) == (10, 40, 50)
    assert lr_at(40, cfg) == 3e-3 and lr_at(90, cfg) == lr_at(100, cfg) == 3e-4


@pytest.mark.parametrize("edit, needle", [
    (lambda t: "model: [unclosed\n", "is not YAML"),
    (lambda t: "- a list\n- of things\n", "is not a nanotron config: expected a mapping of sections"),
    (lambda t: t.replace("parallelism:", "parallelism_settings:"), "is not a nanotron config: no parallelism section"),
    (lambda t: t.replace("model_config:", "config:"), "no model.model_config section"),
    (lambda t: t.replace("dp: 2", "dp: two"), "parallelism.dp: expected an integer, got 'two'"),
    (lambda t: t.replace("learning_rate: 3e-3", "learning_rate: fast"), LR + "learning_rate: expected a number"),
    (lambda t: t.replace("tokens:", "tokens: 5\nunused:"), "section tokens is 5, expected a mapping"),
    (lambda t: t.replace("dataset_folder: DATA/web", "dataset_folder: 5"),
     "data_stages[0].data.dataset.dataset_folder: expected a folder, a list of folders or a folder: weight mapping"),
], ids=["not yaml", "a list", "no parallelism", "no model_config", "dp not an int", "lr not a number",
        "section not a mapping", "folder not a path"])
def test_not_a_nanotron_config_is_refused_and_nothing_written(edit, needle, conf):
    refused, text, _ = imported(conf, "nanoset_forms.yaml", "bad", edit)
    assert isinstance(refused, NotANanotronConfig) and text is None
    assert needle in str(refused) and len(str(refused).splitlines()) == 1, refused


@pytest.mark.slow
def test_the_script_writes_the_experiment_or_says_in_one_line_why_not(tmp_path):
    """scripts/import_nanotron_config.py as a user runs it: the experiment and what was not carried over (exit 0);
    a file that is not a nanotron config: one line on stderr, exit code 2, nothing written."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                          "import_nanotron_config.py")
    source = tmp_path / "nanotron.yaml"
    source.write_text(open(SOURCES + "nanoset_forms.yaml").read().replace("DATA", str(tmp_path)))
    out = tmp_path / "imported.yaml"
    result = subprocess.run([sys.executable, script, str(source), "--name", "imported", "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}" in result.stdout and "parallelism.expert_parallel_size = 2" in result.stdout
    assert "parallelism.expert_parallel_size = 2" in not_carried_over(out.read_text())
    source.write_text("model: [unclosed\n")
    result = subprocess.run([sys.executable, script, str(source), "--name", "bad", "--out", str(tmp_path / "bad.yaml")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and not (tmp_path / "bad.yaml").exists()
    assert result.stderr.startswith("import_nanotron_config: ") and "is not YAML" in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
