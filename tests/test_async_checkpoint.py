"""Checkpoints written in the background (checkpoint.async_save): the same files as a synchronous save on every
layout, the snapshot of the step it belongs to, waits that say how long, failures reported, crashes that leave the
previous checkpoint as latest and resume exactly.

A held write (fault_injection.hold_checkpoint_write=2: rank 0's writer starts once step S + 2 has begun) keeps
checkpoint S in flight while the next steps train, however fast the machine, so a snapshot that shared memory with
the live weights would show a later step's values in rank 0's file (which holds weights on every layout here).
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors import safe_open

import nanoexp.checkpoint.save as save_module
from nanoexp.checkpoint import CheckpointError
from nanoexp.launch.workers import WorkerFailed
from tests.helpers import FAST, compose_config, read_metrics, start_error, tiered, train, train_losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONSTANT_LR = FAST + ["tokens.val_check_interval=0", "optimizer.learning_rate_scheduler.learning_rate=1e-3",
                      "optimizer.learning_rate_scheduler.lr_warmup_steps=0",
                      "optimizer.learning_rate_scheduler.lr_decay_style=constant"]
ASYNC = ["checkpoint.async_save=true", "checkpoint.checkpoint_interval=2"]
HELD = ["fault_injection.hold_checkpoint_write=2"]   # checkpoint 2 is written once step 4 has begun
LAYOUTS = {
    "dp2-zero1": ["parallelism=dp2tp1pp1", "optimizer.zero_stage=1"],
    "tp2": ["parallelism=dp1tp2pp1"],
    "pp2": ["parallelism=dp1tp1pp2"],
    "cp2": ["parallelism=dp1cp2tp1pp1"],
    "ep2": ["parallelism=dp2tp1pp1", "parallelism.ep=2", "model=moe_tiny"],
    "dp2-zero2": ["parallelism=dp2tp1pp1", "optimizer.zero_stage=2"],
    "dp2-zero3": ["parallelism=dp2tp1pp1", "optimizer.zero_stage=3"],
}


def checkpoint_contents(folder) -> tuple[dict, dict]:
    """({(file, key): tensor}, meta.json) but for what differs between two runs of the same training: the run and
    its config, Python's and NumPy's global RNG states (seeded from the OS, not by nanoexp: nothing in training
    draws from them), and so the files' sizes and CRC-32s. torch's generator (seeded) is compared."""
    tensors = {}
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with safe_open(os.path.join(folder, file), "pt") as handle:
            tensors.update({(file, key): handle.get_tensor(key) for key in handle.keys() if key != "rng:numpy_keys"})
    meta = json.loads((folder / "meta.json").read_text())
    return tensors, {key: value for key, value in meta.items() if key not in ("run", "config", "files")}


def assert_same_checkpoint(a, b) -> None:
    (tensors_a, meta_a), (tensors_b, meta_b) = checkpoint_contents(a), checkpoint_contents(b)
    assert meta_a == meta_b   # step, data position, index
    assert tensors_a.keys() == tensors_b.keys()
    for key, value in tensors_a.items():
        assert torch.equal(value, tensors_b[key]), key


def checkpoint_records(run_dir) -> dict:
    return {r["step"]: r for r in read_metrics(run_dir) if "checkpoint/stall_sec" in r}


@pytest.mark.parametrize("layout", tiered(LAYOUTS, quick=["dp2-zero1"]))
def test_a_background_checkpoint_is_the_synchronous_one_and_resumes_the_same(layout, tmp_path):
    """Saved in the background while the next two steps train: checkpoint 2 holds the same bytes as the
    synchronous save's, and a resume from it trains steps 3-4 bit for bit as the uninterrupted run did."""
    run = CONSTANT_LR + LAYOUTS[layout] + ["tokens.train_steps=4", "checkpoint.checkpoint_interval=2"]
    sync = train_losses(train(tmp_path / "sync", run))
    background = train_losses(train(tmp_path / "async", run + ASYNC + HELD))
    assert background == sync
    assert checkpoint_records(tmp_path / "async")[2]["checkpoint/published_after_step"] == 4   # in flight meanwhile
    for step in ("2", "4"):
        assert_same_checkpoint(tmp_path / "sync" / "checkpoints" / step, tmp_path / "async" / "checkpoints" / step)
    resumed = train(tmp_path / "resumed", run + [f"checkpoint.resume_checkpoint_path={tmp_path}/async/checkpoints/2"])
    assert train_losses(resumed) == sync[2:]


@pytest.mark.slow   # 12-45 s under load: out of the quick tier (the whole suite runs it)
def test_the_snapshot_is_of_its_step(tmp_path):
    """One process: checkpoint 2 is written while steps 3 and 4 train (published after step 4) and holds step 2's
    state, the synchronous run's checkpoint 2, whose weights differ from step 4's."""
    run = CONSTANT_LR + ["tokens.train_steps=4", "checkpoint.checkpoint_interval=2"]
    train(tmp_path / "sync", run)
    train(tmp_path / "async", run + ASYNC + HELD)
    sync, background = tmp_path / "sync" / "checkpoints", tmp_path / "async" / "checkpoints"
    assert_same_checkpoint(sync / "2", background / "2")
    assert not torch.equal(*(checkpoint_contents(sync / s)[0]["rank_00000.safetensors", "model.norm.weight"]
                             for s in ("2", "4")))   # a later step's weights would differ
    records = checkpoint_records(tmp_path / "async")
    assert records[2]["checkpoint/background"] and records[2]["checkpoint/published_after_step"] == 4
    assert not records[4]["checkpoint/background"]   # the last step's save: the run waits for it anyway


def test_a_save_due_while_one_is_written_waits_for_it_and_says_how_long(tmp_path, caplog):
    """The manager alone, one process: the write of checkpoint 2 is held until a timer lets it go half a second
    after checkpoint 4 is due; the save of 4 waits for it, publishes it first and logs the wait."""
    from nanoexp.checkpoint import CheckpointManager, Progress
    from nanoexp.parallel.context import ParallelContext
    from nanoexp.runtime.build import build_model
    from nanoexp.runtime.optim import build_optimizer

    cfg = compose_config(FAST + ASYNC + [f"checkpoint.checkpoints_path={tmp_path}"])
    ctx = ParallelContext()
    model = build_model(cfg, ctx)
    optimizer = build_optimizer(cfg, model)
    manager, released = CheckpointManager(cfg, ctx, str(tmp_path)), threading.Event()
    manager.save(2, model, optimizer, Progress(), before_write=released.wait)
    assert manager.writing() and not (tmp_path / "2").exists()
    threading.Timer(0.5, released.set).start()
    with caplog.at_level("INFO", logger="nanoexp"):
        manager.save(4, model, optimizer, Progress())
    first, = manager.saved()
    assert first["step"] == 2 and first["checkpoint/wait_sec"] >= 0.4
    assert "checkpoint 4 is due while checkpoint 2 is still being written: waited 0." in caplog.text
    assert (tmp_path / "latest.txt").read_text().strip() == "2"   # 4 is in flight now
    manager.finish_write()
    assert (tmp_path / "latest.txt").read_text().strip() == "4" and manager.saved()[0]["step"] == 4


@pytest.mark.slow   # 12-45 s under load: out of the quick tier (the whole suite runs it)
def test_a_failed_background_write_is_reported_and_the_previous_checkpoint_stays_latest(tmp_path, monkeypatch):
    run = CONSTANT_LR + ASYNC + ["tokens.train_steps=6"]
    real_write = save_module.write_file

    def disk_full_at_step_4(path, tensors, metadata):
        if ".tmp-4" in path:
            raise OSError(28, "No space left on device")
        return real_write(path, tensors, metadata)

    monkeypatch.setattr(save_module, "write_file", disk_full_at_step_4)
    with pytest.raises(CheckpointError, match=r"checkpoints/4 \(rank 0: OSError: .*No space left"):
        train(tmp_path, run)
    assert (tmp_path / "checkpoints" / "latest.txt").read_text().strip() == "2"
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "latest.txt"]
    first = {r["step"]: r["loss"] for r in read_metrics(tmp_path) if "loss" in r}
    monkeypatch.setattr(save_module, "write_file", real_write)
    train(tmp_path, run)   # resume=auto: from step 2
    resumed = {r["step"]: r["loss"] for r in read_metrics(tmp_path) if "loss" in r}
    assert all(resumed[s] == first[s] for s in first if s > 2)   # redone bit for bit


def test_a_failure_every_rank_raises_waits_for_the_write_in_flight(tmp_path):
    """A non-finite loss at step 3 ends the run on every rank before checkpoint 2, written in the background, is
    published at a step's end: the failure publishes it first."""
    run = CONSTANT_LR + ASYNC + ["parallelism=dp2tp1pp1", "tokens.train_steps=6",
                                 "fault_injection.nonfinite_loss_at_step=3"]
    with pytest.raises(WorkerFailed, match="at step 3"):
        train(tmp_path, run)
    assert (tmp_path / "checkpoints" / "latest.txt").read_text().strip() == "2"
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "latest.txt"]


def test_a_worker_killed_during_the_background_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """Rank 1 is killed (SIGKILL) half-way through writing checkpoint 4 in its writer thread: checkpoint 2 stays
    latest, and the run resumed from it redoes steps 3-6 bit for bit."""
    run = CONSTANT_LR + ASYNC + ["parallelism=dp2tp1pp1", "optimizer.zero_stage=1", "tokens.train_steps=6"]
    real_write = save_module.write_file

    def killed_half_way_at_step_4(path, tensors, metadata):
        if ".tmp-4" in path and path.endswith("rank_00001.safetensors"):
            with open(path, "wb") as f:
                f.write(b"\0" * 100)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(path, tensors, metadata)

    monkeypatch.setattr(save_module, "write_file", killed_half_way_at_step_4)   # inherited by forked ranks
    with pytest.raises(WorkerFailed):
        train(tmp_path, run)
    first = {r["step"]: r["loss"] for r in read_metrics(tmp_path) if "loss" in r}
    assert (tmp_path / "checkpoints" / "latest.txt").read_text().strip() == "2"
    monkeypatch.setattr(save_module, "write_file", real_write)
    train(tmp_path, run)
    resumed = {r["step"]: r["loss"] for r in read_metrics(tmp_path) if "loss" in r}
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6] and all(resumed[s] == first[s] for s in first)
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


def start_train_py(run: list[str], run_dir) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "train.py", *run, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(condition, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)


def workers_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


@pytest.mark.slow
def test_the_launcher_killed_during_the_background_write_leaves_the_previous_checkpoint(tmp_path):
    """SIGKILL of the process that started the run while checkpoint 4 is being written (checkpoint 2 published):
    its workers die with it, checkpoint 2 stays latest, and the run resumed from it trains steps 3-6 as the
    uninterrupted run does, bit for bit."""
    run = CONSTANT_LR + ASYNC + ["parallelism=dp2tp1pp1", "optimizer.zero_stage=3", "tokens.train_steps=6",
                                 "fault_injection.slow_checkpoint_s=5"]
    reference = train_losses(train(tmp_path / "reference", run[:-1]))
    run_dir, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
    proc = start_train_py(run, run_dir)
    wait_for(lambda: (ckpt / ".tmp-4").is_dir() and (ckpt / "latest.txt").is_file())
    workers = workers_of(proc.pid)
    proc.kill()
    proc.wait(timeout=60)
    wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in workers), timeout=30)
    assert (ckpt / "latest.txt").read_text().strip() == "2" and not (ckpt / "4").exists()
    records = train(run_dir, run[:-1])   # resume=auto
    assert [r["step"] for r in records if "loss" in r][-4:] == [3, 4, 5, 6]
    assert train_losses(records)[-4:] == reference[2:]


@pytest.mark.slow
def test_sigterm_waits_for_the_write_in_flight_and_saves_its_step(tmp_path):
    """SIGTERM while checkpoint 2 is being written: the run publishes it, saves the step it stops after, and exits
    0, leaving no temporary folder."""
    run = CONSTANT_LR + ASYNC + ["parallelism=dp2tp1pp1", "tokens.train_steps=400",
                                 "fault_injection.slow_checkpoint_s=3"]
    ckpt = tmp_path / "checkpoints"
    proc = start_train_py(run, tmp_path)
    wait_for(lambda: (ckpt / ".tmp-2").is_dir())
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    stopped_at = json.loads((tmp_path / "summary.json").read_text())["train_steps"]
    assert stopped_at > 2 and {"2", str(stopped_at)} <= set(os.listdir(ckpt))
    assert not [name for name in os.listdir(ckpt) if name.startswith(".tmp-")]
    assert (ckpt / "latest.txt").read_text().strip() == str(stopped_at)


def test_asynchronous_saves_need_an_interval():
    message = start_error(compose_config(FAST + ["checkpoint.async_save=true"]))
    assert message.startswith("invalid config: checkpoint.async_save=true: checkpoint.checkpoint_interval=0")
