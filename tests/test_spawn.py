"""Local workers started by spawn (parallelism.start_method=spawn, the default with CUDA) stop as
forked ones do: a stop signal makes every rank checkpoint after its step, the command exits 0 with
summary.json status "stopped", and resume=auto continues bit for bit.

Reference: the uninterrupted run of the same config, forked, in this process. Spawn and fork run
the same code on the same data with one thread per rank, so the losses must agree bit for bit.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import FAST, SLOW, train, train_losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A constant LR makes the schedule independent of train_steps, so one run can be continued in pieces.
RUN = FAST + ["parallelism=dp2tp1pp1", "tokens.val_check_interval=0",
              "optimizer.learning_rate_scheduler.learning_rate=1e-3", "optimizer.learning_rate_scheduler.lr_warmup_steps=0",
              "optimizer.learning_rate_scheduler.lr_decay_style=constant"]


def _signal_after_two_steps(run_dir, overrides, signum, to_group: bool) -> int:
    """Run train.py in its own session, signal it once metrics.jsonl has two steps, wait; its exit code."""
    proc = subprocess.Popen([sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        metrics, deadline = run_dir / "metrics.jsonl", time.time() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1].decode()[-2000:]
            time.sleep(0.1)
        if to_group:   # Ctrl-C in a terminal: the launcher and every worker get SIGINT
            os.killpg(proc.pid, signum)
        else:          # SLURM/submitit, kill: only the launching process
            proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr.decode()[-2000:]
        return proc.returncode
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("method, signum, to_group", [
    pytest.param("spawn", signal.SIGTERM, False, marks=SLOW),
    pytest.param("spawn", signal.SIGINT, True, marks=SLOW),
    ("fork", signal.SIGINT, True),
], ids=["spawn-SIGTERM", "spawn-ctrl-c", "fork-ctrl-c"])
def test_stop_signal_checkpoints_and_resume_is_bit_exact(method, signum, to_group, tmp_path):
    run = RUN + [f"parallelism.start_method={method}"]
    _signal_after_two_steps(tmp_path / "run", run + ["tokens.train_steps=400"], signum, to_group)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    stopped_at = summary["train_steps"]
    assert summary["status"] == "stopped" and 2 <= stopped_at < 400
    assert (tmp_path / "run" / "checkpoints" / "latest.txt").read_text().strip() == str(stopped_at)
    assert "WorkerFailed" not in (tmp_path / "run" / "train.log").read_text()

    end = stopped_at + 2
    resumed = train(tmp_path / "run", run + [f"tokens.train_steps={end}"])   # resume=auto, same start method
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "completed"
    by_step = {r["step"]: r["loss"] for r in resumed if "loss" in r}   # a resumed run's lines come later and win
    reference = train_losses(train(tmp_path / "reference", RUN + [f"tokens.train_steps={end}"]))   # forked
    assert [by_step[s] for s in range(1, end + 1)] == reference   # bit for bit
