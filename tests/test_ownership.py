"""One owner per run: workers die with their launcher, a live run's folders refuse a second run, a crashed run
never blocks the next, and a config error under torchrun is said once."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

import nanoexp.launch.run_lock as run_lock
from nanoexp.checkpoint.save import complete_steps
from nanoexp.launch.run_lock import FolderLock, RunFolderBusy, own_folders
from tests.helpers import FAST, read_metrics, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOW_DP2 = FAST + ["parallelism=dp2tp1pp1", "tokens.train_steps=8", "tokens.val_check_interval=0",
                   "checkpoint.checkpoint_interval=2", "fault_injection.slow_step_s=1"]


def start(run_dir, overrides: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(path, text: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not (os.path.exists(path) and text in open(path).read()):
        assert time.time() < deadline, f"{text!r} never appeared in {path}"
        time.sleep(0.1)


def step_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}   # a repeated step: the last


@pytest.mark.slow
def test_a_killed_launcher_takes_its_workers_and_the_rerun_resumes_exactly(tmp_path):
    """SIGKILL of a dp2 run's launcher after step 3: within 10 s no worker is left and no checkpoint newer than
    those on disk at the kill appears; the same command run again resumes from that checkpoint (one read of
    latest.txt) and ends with an uninterrupted run's losses, bit for bit."""
    run_dir = tmp_path / "run"
    launcher = start(run_dir, SLOW_DP2)
    wait_for(run_dir / "train.log", "step 3/8")
    workers = psutil.Process(launcher.pid).children(recursive=True)
    assert len(workers) >= 2
    launcher.send_signal(signal.SIGKILL)
    seen = complete_steps(run_dir / "checkpoints")
    launcher.wait()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, [p.pid for p in alive]
    assert complete_steps(run_dir / "checkpoints") == seen == [2]
    rerun = start(run_dir, SLOW_DP2)
    _, stderr = rerun.communicate(timeout=180)
    assert rerun.returncode == 0, stderr[-3000:]
    assert f"resuming from {run_dir}/checkpoints/2" in (run_dir / "train.log").read_text()
    reference = train(tmp_path / "reference", [o for o in SLOW_DP2 if "slow_step" not in o])
    assert step_losses(run_dir) == {r["step"]: r["loss"] for r in reference if "loss" in r}


@pytest.mark.slow
def test_a_second_run_in_a_live_runs_folders_is_refused_before_it_writes(tmp_path):
    """Same run folder, or a run folder of its own but the live run's checkpoints_path: exit 2 with one line
    naming the live run's PID and host; the live run's .hydra/ is untouched, and it goes on (it trains until
    stopped, so that a slow machine cannot let it finish before the second run starts)."""
    run_dir = tmp_path / "live"
    live = start(run_dir, SLOW_DP2 + ["tokens.train_steps=1000"])
    wait_for(run_dir / "train.log", "step 1/1000")
    before = {name: (run_dir / name).read_bytes() for name in (".hydra/overrides.yaml", ".hydra/config.yaml")}
    for second_dir, extra in [(run_dir, []), (tmp_path / "other", [f"checkpoint.checkpoints_path={run_dir}/checkpoints"])]:
        second = start(second_dir, FAST + ["tokens.train_steps=2"] + extra)
        stdout, stderr = second.communicate(timeout=120)
        assert second.returncode == 2, (second_dir, stdout[-3000:], stderr[-2000:])
        (line,) = [line for line in stderr.splitlines() if line.startswith("nanoexp:")]
        assert f"PID {live.pid} on host {socket.gethostname()}" in line and "in use by another nanoexp run" in line
    assert not (tmp_path / "other").exists()   # the refused run's own folder is removed
    assert {name: (run_dir / name).read_bytes() for name in before} == before
    live.send_signal(signal.SIGTERM)
    _, stderr = live.communicate(timeout=180)
    assert live.returncode == 0, stderr[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "stopped"
    steps = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
    assert steps == list(range(1, len(steps) + 1))   # one run's steps, once each


def test_the_lock_is_released_at_the_end_and_by_a_crash(tmp_path):
    with own_folders([str(tmp_path / "a"), str(tmp_path / "a")]):   # the same folder once
        with pytest.raises(RunFolderBusy, match=f"PID {os.getpid()}"):
            # flock is per open file: a second lock from this process collides like another process's
            with own_folders([str(tmp_path / "a")]):
                pass
    assert FolderLock(str(tmp_path / "a")).owner() is None
    record = json.loads((tmp_path / "a" / run_lock.LOCK_FILE).read_text())
    assert record["released"] is True
    crashed = subprocess.run([sys.executable, "-c", "import os, sys; from nanoexp.launch.run_lock import own_folders\n"
                              f"with own_folders([{str(tmp_path / 'b')!r}]): os._exit(9)"], cwd=ROOT)
    assert crashed.returncode == 9
    assert FolderLock(str(tmp_path / "b")).owner() is None   # the kernel dropped its flock
    with own_folders([str(tmp_path / "b")]):
        pass


def lease(folder, **record) -> FolderLock:
    folder.mkdir(exist_ok=True)
    (folder / run_lock.LOCK_FILE).write_text(json.dumps({"pid": 1, "started": time.time(), **record}))
    return FolderLock(str(folder))


def test_without_working_locks_a_fresh_lease_is_a_live_owner(tmp_path, monkeypatch):
    """Where flock does not reach other hosts, the record's heartbeat decides: fresh from another host, or from
    a live process here, is an owner; stale, released or a dead process is not."""
    now = time.time()
    assert lease(tmp_path / "a", host="elsewhere", heartbeat=now).owner()["host"] == "elsewhere"
    assert lease(tmp_path / "b", host="elsewhere", heartbeat=now - run_lock.LEASE_S - 1).owner() is None
    assert lease(tmp_path / "c", host="elsewhere", heartbeat=now, released=True).owner() is None
    monkeypatch.setattr(run_lock, "try_flock", lambda fd: False)   # a file system without flock
    here = socket.gethostname()
    assert lease(tmp_path / "d", host=here, heartbeat=now, pid=os.getppid()).owner() is not None
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert lease(tmp_path / "e", host=here, heartbeat=now, pid=dead.pid).owner() is None
    with own_folders([str(tmp_path / "e")]):   # takes it over
        assert json.loads((tmp_path / "e" / run_lock.LOCK_FILE).read_text())["pid"] == os.getpid()


@pytest.mark.slow
def test_a_config_error_under_torchrun_is_said_once(tmp_path):
    """Every rank sees the same error: rank 0 prints it, and torchrun's report shows it (every rank's error file)
    instead of a pointer to torchrun's docs."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "train.py", *FAST, "parallelism=dp4tp1pp1", f"hydra.run.dir={tmp_path}/run"], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    said = "parallelism.dp*cp*tp*pp = 4*1*1*1 = 4 but the world size is 2"
    (printed,) = [line for line in result.stderr.splitlines() if line.startswith("nanoexp:")]
    assert said in printed
    report = result.stderr[result.stderr.index("train.py FAILED"):]
    assert said in report[report.index("Root Cause"):] and "To enable traceback" not in report
