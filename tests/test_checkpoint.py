"""Checkpoints: exact resume, resume on other layouts, atomicity, damaged shards, stop signals.

References: the uninterrupted run of the same config (bit for bit on the same layout) and the
single-process run (within the parity tolerance of tests/test_parallel.py on other layouts).
"""
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

import nanoexp.checkpoint.save as save_module
from nanoexp.checkpoint import CheckpointError, CheckpointReader
from nanoexp.checkpoint.load import check_compatible
from nanoexp.config import ConfigError
from nanoexp.launch.workers import WorkerFailed
from nanoexp.model.shape import model_shape
from tests.helpers import FAST, compose_config, read_metrics, train, train_losses
from tests.test_parallel import assert_same_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = FAST + ["tokens.val_check_interval=0", "optimizer.learning_rate_scheduler.learning_rate=1e-3",
              "optimizer.learning_rate_scheduler.lr_warmup_steps=2"]
# A constant LR makes the schedule independent of train_steps, so one run can be continued in pieces.
CONSTANT_LR = FAST + ["tokens.val_check_interval=0", "optimizer.learning_rate_scheduler.learning_rate=1e-3",
                      "optimizer.learning_rate_scheduler.lr_warmup_steps=0",
                      "optimizer.learning_rate_scheduler.lr_decay_style=constant"]


def last_by_step(records):
    """metrics.jsonl of a resumed run repeats steps; later lines win."""
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_exact_resume_same_layout_zero1(tmp_path):
    layout = ["parallelism=dp2tp1pp2", "optimizer.zero_stage=1", "tokens.train_steps=6",
              "checkpoint.checkpoint_interval=3"]
    full = train_losses(train(tmp_path / "full", RUN + layout))
    ckpt = tmp_path / "full" / "checkpoints"
    assert sorted(os.listdir(ckpt)) == ["3", "6", "latest.txt"]
    assert (ckpt / "latest.txt").read_text().strip() == "6"
    assert len([f for f in os.listdir(ckpt / "3") if f.endswith(".safetensors")]) == 4   # one shard per rank
    resumed = train_losses(train(tmp_path / "resumed", RUN + layout + [f"checkpoint.resume_checkpoint_path={ckpt}/3"]))
    assert resumed == full[3:]   # bit for bit


@pytest.mark.slow
def test_resume_across_layouts_both_directions(tmp_path):
    tied = CONSTANT_LR + ["model.model_config.tie_word_embeddings=true"]
    reference = train(tmp_path / "ref", tied + ["tokens.train_steps=9"])
    a = train(tmp_path / "a", tied + ["parallelism=dp2tp2pp2", "optimizer.zero_stage=1",
                                      "parallelism.tp_mode=reduce_scatter", "tokens.train_steps=3"])
    b = train(tmp_path / "b", tied + ["tokens.train_steps=6",
                                      f"checkpoint.resume_checkpoint_path={tmp_path}/a/checkpoints/3"])
    c = train(tmp_path / "c", tied + ["parallelism=dp1tp2pp2", "tokens.train_steps=9",
                                      f"checkpoint.resume_checkpoint_path={tmp_path}/b/checkpoints/6"])
    assert_same_steps(a + b + c, reference, steps=range(1, 10))   # losses and gradient norms


@pytest.mark.slow   # 12-45 s under load: out of the quick tier (the whole suite runs it)
def test_any_element_wise_optimizer_is_sharded_and_resumed_on_another_layout(tmp_path, monkeypatch):
    """An optimizer registered beside AdamW (SGD with momentum: a state key AdamW lacks) runs under ZeRO-3 on dp2
    and its checkpoint, saved by state key, resumes on one process without ZeRO, as one process's run."""
    import torch
    from nanoexp.optim.registry import OPTIMIZERS
    monkeypatch.setitem(OPTIMIZERS, "adamw", OPTIMIZERS["adamw"]._replace(
        build=lambda cfg: (torch.optim.SGD, dict(lr=0.1, momentum=0.9))))
    reference = train(tmp_path / "ref", CONSTANT_LR + ["tokens.train_steps=6"])
    a = train(tmp_path / "a", CONSTANT_LR + ["tokens.train_steps=3", "parallelism=dp2tp1pp1", "optimizer.zero_stage=3"])
    assert {kind for _, kind in CheckpointReader(str(tmp_path / "a" / "checkpoints" / "3")).pieces} == {
        "param", "momentum_buffer"}
    b = train(tmp_path / "b", CONSTANT_LR + ["tokens.train_steps=6",
                                             f"checkpoint.resume_checkpoint_path={tmp_path}/a/checkpoints/3"])
    assert_same_steps(a + b, reference, steps=range(1, 7))   # losses and gradient norms


@pytest.mark.slow
def test_resume_across_context_parallel_layouts(tmp_path):
    """Saved on cp2 (with dp2 and ZeRO-1), resumed on cp1, saved there and resumed on cp2: the curve stays the
    one-process run's, and the data position (samples and tokens consumed) is exact."""
    reference = train(tmp_path / "ref", CONSTANT_LR + ["tokens.train_steps=6"])
    a = train(tmp_path / "a", CONSTANT_LR + ["parallelism=dp2cp2tp1pp1", "optimizer.zero_stage=1",
                                            "tokens.train_steps=2"])
    b = train(tmp_path / "b", CONSTANT_LR + ["tokens.train_steps=4",
                                            f"checkpoint.resume_checkpoint_path={tmp_path}/a/checkpoints/2"])
    c = train(tmp_path / "c", CONSTANT_LR + ["parallelism=dp1cp2tp1pp1", "tokens.train_steps=6",
                                            f"checkpoint.resume_checkpoint_path={tmp_path}/b/checkpoints/4"])
    meta = json.loads((tmp_path / "a" / "checkpoints" / "2" / "meta.json").read_text())
    assert meta["layout"] == {"dp": 2, "cp": 2, "tp": 1, "pp": 1, "zero_stage": 1} and meta["consumed_samples"] == 16
    assert_same_steps(a + b + c, reference, steps=range(1, 7))   # losses and gradient norms
    assert [r["consumed_tokens"] for r in a + b + c if "loss" in r] == [
        r["consumed_tokens"] for r in reference if "loss" in r]


@pytest.mark.slow   # 12-45 s under load: out of the quick tier (the whole suite runs it)
def test_resume_in_the_middle_of_a_data_stage_same_layout_and_another(tmp_path):
    """Two data stages (built-in corpus, then a Nanoset from step 4). Resumed in the middle of the second stage on
    the same layout the run continues bit for bit; resumed in the first stage on another layout it crosses the
    switch with the uninterrupted run's samples (losses within the parity tolerance)."""
    from tests.data_files import random_documents
    from tests.test_nanoset import write_nanoset

    folder = write_nanoset(tmp_path / "anneal", random_documents(100, seed=4))
    run = RUN + ["tokens.train_steps=6", "checkpoint.checkpoint_interval=2", "data_stages=[{name: stable, "
                 "start_training_step: 1, data: {}}, {name: anneal, start_training_step: 4, data: {name: nanoset, "
                 f"dataset_folder: [{folder}]}}}}]"]
    full_records = train(tmp_path / "full", run)
    full = last_by_step(full_records)
    meta = json.loads((tmp_path / "full" / "checkpoints" / "4" / "meta.json").read_text())
    assert meta["stage_consumed_samples"] == {"stable": 3 * 8, "anneal": 8}   # FAST's global batch: 8
    saved = f"checkpoint.resume_checkpoint_path={tmp_path}/full/checkpoints/"
    same = last_by_step(train(tmp_path / "same", run + [saved + "4"]))
    assert same == {5: full[5], 6: full[6]}   # bit for bit
    other = train(tmp_path / "other", run + ["parallelism=dp2tp1pp1", saved + "2"])
    assert sorted(last_by_step(other)) == [3, 4, 5, 6]
    assert_same_steps(other, full_records, steps=[3, 4, 5, 6])   # losses and gradient norms


@pytest.mark.slow   # 12-45 s under load: out of the quick tier (the whole suite runs it)
def test_failed_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    run = RUN + ["tokens.train_steps=6", "checkpoint.checkpoint_interval=2", "checkpoint.keep_last_n=2"]
    real_write = save_module.write_file

    def disk_full_at_step_4(path, tensors, metadata):
        if ".tmp-4" in path:
            raise OSError(28, "No space left on device")
        return real_write(path, tensors, metadata)

    monkeypatch.setattr(save_module, "write_file", disk_full_at_step_4)
    with pytest.raises(CheckpointError, match=r"checkpoints/4 .*No space left"):
        train(tmp_path / "run", run)
    ckpt = tmp_path / "run" / "checkpoints"
    assert sorted(os.listdir(ckpt)) == ["2", "latest.txt"]
    first = last_by_step(read_metrics(tmp_path / "run"))   # steps 1-4 (step 4 ran, its save failed)
    monkeypatch.setattr(save_module, "write_file", real_write)
    train(tmp_path / "run", run)   # checkpoint.resume=auto (the default) continues from step 2
    resumed = last_by_step(read_metrics(tmp_path / "run"))
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6] and all(resumed[s] == first[s] for s in (3, 4))   # bit for bit
    assert sorted(os.listdir(ckpt)) == ["4", "6", "latest.txt"]   # keep_last_n=2 pruned step 2


def test_rank_killed_during_save_then_resume(tmp_path, monkeypatch):
    run = RUN + ["parallelism=dp1tp2pp1", "tokens.train_steps=4", "checkpoint.checkpoint_interval=2"]
    real_write = save_module.write_file

    def die_half_way_at_step_4(path, tensors, metadata):
        if ".tmp-4" in path and path.endswith("rank_00001.safetensors"):
            with open(path, "wb") as f:
                f.write(b"\0" * 100)
            os._exit(9)   # a killed process: no exception, no cleanup
        return real_write(path, tensors, metadata)

    monkeypatch.setattr(save_module, "write_file", die_half_way_at_step_4)   # inherited by forked ranks
    with pytest.raises(WorkerFailed):
        train(tmp_path, run)
    first = last_by_step(read_metrics(tmp_path))
    assert (tmp_path / "checkpoints" / "latest.txt").read_text().strip() == "2"
    CheckpointReader(str(tmp_path / "checkpoints" / "2")).full_tensor("model.embed_tokens.weight")
    monkeypatch.setattr(save_module, "write_file", real_write)
    train(tmp_path, run)
    assert last_by_step(read_metrics(tmp_path)) == first   # steps 3-4 redone bit for bit
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    train(root, RUN + ["tokens.train_steps=2"])
    return root / "checkpoints" / "2"


def damaged_copy(saved, tmp_path, damage):
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    shard = folder / "rank_00000.safetensors"
    damage(shard)
    return folder, shard


@pytest.mark.parametrize("damage, message", [
    (lambda f: f.write_bytes(f.read_bytes()[:-10]), "truncated"),
    (lambda f: f.write_bytes(f.read_bytes()[:-10] + b"0123456789"), "corrupt"),
    (lambda f: f.unlink(), "missing shard"),
])
def test_damaged_shard_is_named(saved, tmp_path, damage, message):
    folder, shard = damaged_copy(saved, tmp_path, damage)
    with pytest.raises(CheckpointError, match=message) as error:
        CheckpointReader(str(folder)).full_tensor("model.norm.weight")
    assert str(shard) in str(error.value)


def test_incompatible_model_names_first_mismatching_parameter(saved):
    cfg = compose_config(RUN + ["model.model_config.num_key_value_heads=4"])
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight has shape \(32, 64\)"):
        check_compatible(CheckpointReader(str(saved)), model_shape(cfg))


def test_missing_resume_path_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.resume_checkpoint_path"):
        train(tmp_path, RUN + [f"checkpoint.resume_checkpoint_path={tmp_path}/nope"])


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_checkpoints_exits_cleanly_and_resume_auto_continues(signum, tmp_path):
    run = CONSTANT_LR + ["parallelism=dp2tp1pp1", "tokens.train_steps=400"]
    proc = subprocess.Popen([sys.executable, "train.py", *run, f"hydra.run.dir={tmp_path}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    stopped_at = summary["train_steps"]
    assert summary["status"] == "stopped" and stopped_at < 400
    # The last lines: the summary, then the exact command that resumes the run in its folder.
    assert f"stopped by a signal after step {stopped_at}" in stdout
    assert stdout.rstrip().splitlines()[-1].strip() == shlex.join(
        ["python", "train.py", *run, f"hydra.run.dir={tmp_path}"]), stdout[-1000:]
    assert (tmp_path / "checkpoints" / "latest.txt").read_text().strip() == str(stopped_at)
    records = train(tmp_path, run[:-1] + [f"tokens.train_steps={stopped_at + 2}"])   # resume=auto
    assert [r["step"] for r in records if "loss" in r][-2:] == [stopped_at + 1, stopped_at + 2]
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


def test_requeued_run_continues_from_its_own_checkpoint_not_the_seed(tmp_path, caplog):
    """A job seeded by checkpoint.resume_checkpoint_path and requeued after saving its own checkpoints
    continues from its own latest.txt; the path seeds only the first start."""
    train(tmp_path / "seed", CONSTANT_LR + ["tokens.train_steps=2"])
    job = CONSTANT_LR + ["checkpoint.checkpoint_interval=2", f"checkpoint.resume_checkpoint_path={tmp_path}/seed/checkpoints/2"]
    first = train(tmp_path / "job", job + ["tokens.train_steps=4"])
    assert [r["step"] for r in first if "loss" in r] == [3, 4]   # seeded at step 2
    caplog.clear()
    with caplog.at_level("INFO", logger="nanoexp"):
        requeued = train(tmp_path / "job", job + ["tokens.train_steps=6"])
    assert [r["step"] for r in requeued if "loss" in r][-2:] == [5, 6]   # not 3 again
    assert "this run's own latest checkpoint" in caplog.text


def test_seed_path_inside_the_runs_own_checkpoints_is_refused(tmp_path):
    train(tmp_path, CONSTANT_LR + ["tokens.train_steps=2"])
    with pytest.raises(ConfigError, match=r"inside this run's own checkpoints folder .* latest.txt"):
        train(tmp_path, CONSTANT_LR + ["tokens.train_steps=4", f"checkpoint.resume_checkpoint_path={tmp_path}/checkpoints/2"])


def test_rollback_by_latest_txt_follows_it_and_keeps_the_abandoned_timeline(tmp_path):
    """latest.txt pointed back at step 2 (backing out of a loss spike): resume=auto continues from 2, not
    from the higher-numbered 6; the abandoned 4 and 6 move to abandoned/ (never deleted), and
    keep_last_n prunes only the new timeline. Same layout and seed: steps 3-6 repeat bit for bit."""
    run = RUN + ["tokens.train_steps=6", "checkpoint.checkpoint_interval=2"]
    train(tmp_path, run)
    first = last_by_step(read_metrics(tmp_path))
    ckpt = tmp_path / "checkpoints"
    (ckpt / "latest.txt").write_text("2\n")
    records = train(tmp_path, run + ["checkpoint.keep_last_n=2"])
    assert [r["step"] for r in records if "loss" in r][-4:] == [3, 4, 5, 6]
    assert last_by_step(read_metrics(tmp_path)) == first
    assert sorted(os.listdir(ckpt)) == ["4", "6", "abandoned", "latest.txt"]
    assert sorted(os.listdir(ckpt / "abandoned")) == ["4", "6"]
    CheckpointReader(str(ckpt / "abandoned" / "6")).full_tensor("model.norm.weight")   # intact
    (ckpt / "latest.txt").write_text("5\n")   # no such checkpoint: refused at start, naming the file
    with pytest.raises(ConfigError, match=r"latest.txt names '5', which is not a complete checkpoint"):
        train(tmp_path, run)
