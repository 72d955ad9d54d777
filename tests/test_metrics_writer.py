"""The metric writer with the real wandb package, offline (no network, no account): the W&B run gets
the whole resolved config, a name, group and tags; a resumed run continues the same W&B run; W&B is
off unless asked."""
import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from nanoexp.observe.metrics import MetricsWriter
from nanoexp.run import HydraJob, fill_wandb_identity
from tests.helpers import compose_config

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
