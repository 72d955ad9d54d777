"""A stop signal before the first step ends the run at once (nanoexp/launch/signals.py): exit 128 + the signal's
number (130 for Ctrl-C, 143 for SIGTERM), one line, no checkpoint; from the first step on, the run checkpoints
after its step instead (tests/test_checkpoint.py, tests/test_spawn.py)."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from nanoexp.launch.signals import StopBeforeTraining, handle_stop_signals, stop_requested, training_started
from nanoexp.launch.workers import spawn_local
from tests.helpers import FAST

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The requirement is 5 s. Measured here (2 cores, load 5-7): 0.05-2.3 s; the bound is twice the requirement, so
# that a machine busy with other tests does not fail it, and still far below what a start-up holding the
# interpreter took (over 35 s, and minutes, before the peak measurement moved to a child process).
EXIT_WITHIN_S = 10.0


def test_a_signal_ends_the_start_up_and_is_recorded_once_training():
    with handle_stop_signals():
        with pytest.raises(StopBeforeTraining) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)   # the handler raises here, at once
        assert stop.value.exit_code == 143 and "stopped by SIGTERM before the first step" in str(stop.value)
    with handle_stop_signals():
        training_started()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        assert stop_requested()   # recorded: the trainer stops after its step


def _start_up_forever(rank, world_size, device):
    time.sleep(60)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_still_starting_end_with_the_launcher(method):
    """The launcher is signalled while its workers start (a spawned one is importing torch then): it forwards the
    signal, each worker ends its start-up with 128 + the signal's number, and the launcher's run ends as stopped."""
    start = time.perf_counter()
    with handle_stop_signals():
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(StopBeforeTraining) as stop:
            spawn_local(2, _start_up_forever, (), timeout_s=60, method=method)
    assert stop.value.signum == signal.SIGTERM and time.perf_counter() - start < 1.0 + EXIT_WITHIN_S


def _signal_during_start_up(run_dir, overrides, signum) -> tuple[int, float, str]:
    """train.py with an FP8 model whose start-up lasts a minute, signalled 3 s in: exit code, seconds to exit
    after the signal, stderr."""
    proc = subprocess.Popen([sys.executable, "train.py", *FAST, "model.fp8.enabled=true",
                             "fault_injection.slow_start_up_s=60", *overrides, f"hydra.run.dir={run_dir}"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        time.sleep(3)
        sent = time.perf_counter()
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
        return proc.returncode, time.perf_counter() - sent, stderr
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp1tp1pp1", "dp2tp1pp1"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_3_s_into_an_fp8_start_up_ends_the_run(signum, layout, tmp_path):
    code, seconds, stderr = _signal_during_start_up(tmp_path, [f"parallelism={layout}"], signum)
    assert code == 128 + signum, stderr[-2000:]
    assert seconds < EXIT_WITHIN_S
    assert stderr.strip() == (f"nanoexp: stopped by {signal.Signals(signum).name} before the first step: nothing was "
                              "trained, no checkpoint written")
    assert not (tmp_path / "metrics.jsonl").exists() or "loss" not in (tmp_path / "metrics.jsonl").read_text()
    assert not (tmp_path / "checkpoints").exists() or not os.listdir(tmp_path / "checkpoints")
