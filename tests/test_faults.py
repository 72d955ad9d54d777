"""Faults during a run: non-finite losses, a rank that hangs in a collective. Nothing hangs. A failure whose cause
is known ends train.py with one line and no traceback, on one process as on many."""
import errno
import json
import re
import time

import pytest

import nanoexp.checkpoint.save as save_module
from nanoexp.launch.workers import WorkerFailed
from tests.helpers import FAST, train, train_py

RUN = FAST + ["tokens.train_steps=5", "tokens.val_check_interval=0"]


def test_nonfinite_loss_stops_with_the_step_number(tmp_path):
    with pytest.raises(FloatingPointError, match="at step 3"):
        train(tmp_path, RUN + ["fault_injection.nonfinite_loss_at_step=3"])
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["status"] == "failed" and "step 3" in summary["error"]
    assert summary["train_steps"] == 2   # the last completed step


def test_nonfinite_step_is_skipped_when_asked(tmp_path):
    records = train(tmp_path, RUN + ["fault_injection.nonfinite_loss_at_step=3", "optimizer.skip_nonfinite_steps=true"])
    steps = {r["step"]: r for r in records if "loss" in r}
    assert [steps[s]["skipped_steps"] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    assert steps[3]["loss"] != steps[3]["loss"]            # NaN was logged for the skipped step
    assert all(steps[s]["loss"] < 10 for s in (4, 5))      # the weights were not poisoned
    reference = {r["step"]: r["loss"] for r in train(tmp_path / "ref", RUN) if "loss" in r}
    assert steps[2]["loss"] == reference[2] and steps[4]["loss"] != reference[4]
    # The count survives a resume: continue the same run from its final checkpoint to step 7.
    resumed = train(tmp_path, RUN + ["fault_injection.nonfinite_loss_at_step=3", "optimizer.skip_nonfinite_steps=true",
                                     "tokens.train_steps=7", "checkpoint.resume=auto"])
    assert [r["skipped_steps"] for r in resumed if "loss" in r and r["step"] > 5] == [1, 1]


def test_nonfinite_loss_on_a_pipeline_stops_every_rank(tmp_path):
    start = time.time()
    with pytest.raises(WorkerFailed, match="at step 2"):
        train(tmp_path, RUN + ["parallelism=dp2tp1pp2", "fault_injection.nonfinite_loss_at_step=2"])
    assert time.time() - start < 60


@pytest.mark.slow
def test_hung_rank_becomes_an_error_after_the_collective_timeout(tmp_path):
    start = time.time()
    with pytest.raises(WorkerFailed) as info:
        train(tmp_path, RUN + ["parallelism=dp2tp1pp1", "fault_injection.hang_at_step=2", "fault_injection.hang_rank=1",
                               "parallelism.collective_timeout_s=3"])
    assert time.time() - start < 60
    assert "rank 0 failed" in str(info.value)   # the rank left waiting reports the timeout


@pytest.mark.parametrize("fault, layout, error", [
    (["fault_injection.nonfinite_loss_at_step=5"], "dp1tp1pp1", FloatingPointError),
    pytest.param(["fault_injection.hang_at_step=5", "fault_injection.hang_rank=1", "parallelism.collective_timeout_s=3"],
                 "dp2tp1pp1", WorkerFailed, marks=pytest.mark.slow),
], ids=["nonfinite", "hang"])
def test_resume_after_a_fault_reaches_the_unfaulted_loss(fault, layout, error, tmp_path):
    """Nothing lost: checkpoints every 2 steps, a fault at step 5, then resume=auto in the same
    run folder continues from checkpoint 4 and ends exactly where an unfaulted run ends."""
    run = RUN[:] + ["tokens.train_steps=6", "checkpoint.checkpoint_interval=2", f"parallelism={layout}"]
    expected = [r["loss"] for r in train(tmp_path / "unfaulted", run) if "loss" in r]
    with pytest.raises(error):
        train(tmp_path / "faulted", run + fault)
    assert (tmp_path / "faulted" / "checkpoints" / "latest.txt").read_text().strip() == "4"
    records = train(tmp_path / "faulted", run + ["checkpoint.resume=auto"])
    last_loss = {r["step"]: r["loss"] for r in records if "loss" in r}   # later lines win
    assert [last_loss[s] for s in range(1, 7)] == expected   # bit for bit: same layout, exact resume


def said(capsys) -> list[str]:
    """What train.py printed on stderr, as lines; the console log on stdout holds no traceback either."""
    printed = capsys.readouterr()
    assert "Traceback" not in printed.out, printed.out[-3000:]
    return printed.err.strip().splitlines()


@pytest.mark.parametrize("layout", ["dp1tp1pp1", "dp2tp1pp1"])
def test_a_nonfinite_loss_ends_train_py_with_one_line(layout, tmp_path, capsys):
    code = train_py(RUN + [f"parallelism={layout}", "fault_injection.nonfinite_loss_at_step=2"], tmp_path)
    lines = said(capsys)   # on dp2 both ranks stop: the first to report is named
    assert code == 1 and len(lines) == 1 and re.fullmatch(
        r"nanoexp: rank [01] failed: FloatingPointError: non-finite loss nan or gradient norm nan at step 2 \(set "
        r"optimizer\.skip_nonfinite_steps=true to skip such steps\)", lines[0]), lines


def test_a_full_disk_and_a_damaged_checkpoint_end_train_py_with_one_line(tmp_path, capsys, monkeypatch):
    """A save on a full disk (at step 2), a shard whose bytes changed (its CRC-32, found when it is read) and one that
    is no safetensors file at all (found by its header before any work)."""
    real_write = save_module.write_file
    monkeypatch.setattr(save_module, "write_file", lambda *args: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    run = RUN + ["tokens.train_steps=2", "checkpoint.checkpoint_interval=1"]
    assert train_py(run, tmp_path) == 1
    assert said(capsys) == [f"nanoexp: rank 0 failed: CheckpointError: could not save checkpoint {tmp_path}/checkpoints/"
                            "1 (rank 0: OSError: [Errno 28] No space left on device); earlier checkpoints are intact"]
    monkeypatch.setattr(save_module, "write_file", real_write)
    assert train_py(run, tmp_path) == 0
    shard = tmp_path / "checkpoints" / "2" / "rank_00000.safetensors"
    intact = shard.read_bytes()
    shard.write_bytes(intact[:-8] + bytes(b ^ 0xFF for b in intact[-8:]))   # same size, other bytes
    capsys.readouterr()
    assert train_py(run[:-2] + ["tokens.train_steps=3"], tmp_path) == 1
    assert said(capsys) == [f"nanoexp: rank 0 failed: CheckpointError: corrupt shard {shard}: its CRC-32 differs from "
                            "the one in meta.json"]
    shard.write_bytes(bytes(len(intact)))
    assert train_py(run[:-2] + ["tokens.train_steps=3"], tmp_path) == 2
    lines = said(capsys)
    assert len(lines) == 1 and lines[0].startswith(f"nanoexp: checkpoint: unreadable shard {shard}: ")
