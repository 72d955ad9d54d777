"""The metric writer with the real wandb package, offline (no network, no account): the W&B run gets
the whole resolved config, a name, group and tags; a resumed run continues the same W&B run; W&B is
off unless asked. metrics.jsonl after a crash mid-write: the next record starts a line of its own, and the reader
skips the lines that are not records, saying how many once."""
import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from nanoexp.observe.metrics import MetricsWriter, read_metrics
from nanoexp.run import HydraJob, fill_wandb_identity
from tests.helpers import FAST, compose_config, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WANDB_ENV = {"WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}


def wandb_cfg(job: HydraJob, *overrides):
    cfg = compose_config(["logging.wandb.mode=offline", "logging.tensorboard=false", "parallelism=dp2tp1pp1",
                          *overrides])
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    fill_wandb_identity(cfg, job)
    return cfg


def test_wandb_run_carries_config_name_group_tags_and_resumes(tmp_path, monkeypatch):
    for key, value in WANDB_ENV.items():
        monkeypatch.setenv(key, value)
    job = HydraJob(overrides=["parallelism=dp2tp1pp1", "optimizer.zero_stage=1"],
                   override_dirname="optimizer.zero_stage=1,parallelism=dp2tp1pp1", sweep_dir="outputs/multirun/x")
    cfg = wandb_cfg(job, "optimizer.zero_stage=1")
    ids = []
    for step in (1, 2):   # the first run, then a run resumed into the same folder
        writer = MetricsWriter(str(tmp_path), cfg)
        run = writer.wandb
        assert run.name == "optimizer.zero_stage=1,parallelism=dp2tp1pp1"
        assert run.group == "outputs/multirun/x" and list(run.tags) == ["dp2tp1pp1"]
        logged = dict(run.config)
        assert logged["optimizer"]["zero_stage"] == 1 and logged["parallelism"]["dp"] == 2
        assert logged["model"]["model_config"]["hidden_size"] == cfg.model.model_config.hidden_size
        writer.write({"step": step, "loss": 1.0 / step})
        ids.append(run.id)
        writer.close()
    assert ids[0] == ids[1] == (tmp_path / "wandb_run_id.txt").read_text()
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{ids[0]}/run-{ids[0]}.wandb"))   # W&B's own record
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert lines == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]   # appended, full precision


def test_wandb_name_without_overrides_is_general_run(tmp_path):
    cfg = wandb_cfg(HydraJob())
    assert (cfg.logging.wandb.name, cfg.logging.wandb.group, list(cfg.logging.wandb.tags)) == ("default", None,
                                                                                               ["dp2tp1pp1"])
    cfg = wandb_cfg(HydraJob(override_dirname="a=1"), "logging.wandb.name=mine", "logging.wandb.tags=[x]")
    assert cfg.logging.wandb.name == "mine" and list(cfg.logging.wandb.tags) == ["x"]   # set values win


def test_wandb_disabled_by_default(tmp_path):
    MetricsWriter(str(tmp_path), compose_config(["logging.tensorboard=false"])).close()
    assert not (tmp_path / "wandb_run_id.txt").exists() and not (tmp_path / "wandb").exists()


@pytest.mark.slow
def test_train_py_with_wandb_offline(tmp_path):
    """The README's command, end to end, with the wandb release that `pip install -e .` resolves."""
    result = subprocess.run([sys.executable, "train.py", "debug=fast", "logging.wandb.mode=offline",
                             f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, **WANDB_ENV, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    run_id = (tmp_path / "wandb_run_id.txt").read_text()
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


def broken_file(run_dir) -> None:
    """metrics.jsonl as a crash leaves it: a garbage line in the middle, the last record cut mid-write."""
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\nnot json\n{"step": 2, "loss": 2.')


def test_a_record_after_a_partial_line_is_a_line_of_its_own_and_the_reader_skips_the_broken(tmp_path, caplog):
    broken_file(tmp_path)
    writer = MetricsWriter(str(tmp_path), compose_config(["logging.tensorboard=false"]))
    writer.write({"step": 2, "loss": 2.25})
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[-2:] == ['{"step": 2, "loss": 2.', '{"step": 2, "loss": 2.25}']
    with caplog.at_level("WARNING", logger="nanoexp"):
        assert read_metrics(str(tmp_path)) == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25}]
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path}/metrics.jsonl: 2 unreadable lines skipped (not a JSON record: a crash mid-write leaves a "
        "partial one)"]
    assert read_metrics(str(tmp_path / "nothing")) == []


@pytest.mark.slow
def test_a_run_resumed_after_a_crash_mid_write_records_its_steps(tmp_path):
    """The resumed step's record is read back, not glued to the partial line the crash left."""
    run = FAST + ["tokens.val_check_interval=0", "checkpoint.checkpoint_interval=2"]
    train(tmp_path, run + ["tokens.train_steps=2"])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 1.')   # step 3 cut mid-write by the crash
    steps = [r["step"] for r in train(tmp_path, run + ["tokens.train_steps=4"]) if "loss" in r]
    assert steps == [1, 2, 3, 4]
