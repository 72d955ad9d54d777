"""Soak: long runs keep resident memory flat and leave no stray processes or open ports."""
import os
import signal
import subprocess
import sys

import numpy as np
import psutil
import pytest

from tests.helpers import read_metrics, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A model so small that a step costs a few milliseconds: thousands of steps in seconds.
MICRO = ["model.model_config.hidden_size=32", "model.model_config.intermediate_size=64",
         "model.model_config.num_hidden_layers=2", "model.model_config.num_attention_heads=2",
         "model.model_config.num_key_value_heads=2", "tokens.sequence_length=16", "tokens.global_batch_size=4",
         "tokens.micro_batch_size=2", "tokens.limit_val_batches=1", "tokens.val_check_interval=0",
         "logging.tensorboard=false", "logging.iteration_step_info_interval=50",
         "optimizer.learning_rate_scheduler.lr_warmup_steps=10", "checkpoint.save_final_state=false"]
# A leak is memory that grows with every step and never stops; what the allocator caches and the runtime warms up
# grows for a while and stops. peak_memory_mb on CPU is the high-water RSS (VmHWM, nanoexp/instruments/memory.py): as
# every step reaches the same transient peak on top of what is live, it rises with a leak at the leak's rate (once the
# freed holes of the heap are full). So the bound is on its growth per step after the warm-up, the least-squares slope
# over the logged steps. Measured on 2 cores: 0.07-0.09 KB/step (3 runs) over steps 300-3000 of one process,
# 0.13-0.31 (5 runs) over steps 550-1000 of dp2's rank 0; a leak of 1 KB a step (a bytearray(1024) kept every step)
# makes them 1.11 and 1.29. 0.6 KB/step: twice the most measured without a leak, half the least with one.
LEAK_BOUND_KB_PER_STEP = 0.6


def our_ports() -> set:
    return {c.laddr for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


def growth_per_step_kb(records, after_step) -> float:
    """The least-squares slope of the high-water RSS over the steps logged from `after_step` on, in KB a step."""
    steps = np.array([(r["step"], r["peak_memory_mb"]) for r in records if "loss" in r and r["step"] >= after_step])
    assert len(steps) >= 9, len(steps)
    return float(np.polyfit(steps[:, 0], steps[:, 1], 1)[0] * 1024)


def assert_flat_memory(records, after_step):
    slope = growth_per_step_kb(records, after_step)
    assert slope < LEAK_BOUND_KB_PER_STEP, (slope, [(r["step"], r["peak_memory_mb"]) for r in records if "loss" in r])


@pytest.mark.slow
def test_single_process_soak(tmp_path):
    ports_before = our_ports()
    records = train(tmp_path, MICRO + ["tokens.train_steps=3000"])
    assert_flat_memory(records, after_step=300)
    assert our_ports() == ports_before


def session_members(sid: int) -> list[psutil.Process]:
    """The live processes of session `sid` (a launcher started with start_new_session and whatever it started)."""
    members = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getsid(proc.pid) == sid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, PermissionError):
            pass
    return members


@pytest.mark.slow
def test_multi_process_soak_leaves_nothing_behind(tmp_path):
    # In a fresh interpreter, in a session of its own: workers forked from pytest's own process carry the whole
    # suite's heap, whose pages the collector touches as it trains (measured in the full suite: 1.06 KB/step, a
    # slope no leak made, against 0.09 in a fresh interpreter, 2 runs). The flight recorder keeps a ring of its last collectives: 100
    # entries fill by step 25 at dp2's 4 collectives a step, where the default 2000 would still be filling in the
    # measured window (a bound, not a leak).
    overrides = MICRO + ["tokens.train_steps=1000", "parallelism=dp2tp1pp1", "debug.flight_recorder_entries=100",
                         f"hydra.run.dir={tmp_path}"]
    launcher = subprocess.Popen([sys.executable, "train.py", *overrides], cwd=ROOT, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 0, stderr[-2000:]
    # rank 0's high-water RSS grows ~2 MB until step 500 (whatever the speed of a step), then stays flat
    assert_flat_memory(read_metrics(tmp_path), after_step=550)
    # nothing of the run is left: no process of its session, hence no port it listened on
    assert not session_members(launcher.pid), [p.cmdline() for p in session_members(launcher.pid)]
    assert os.path.exists(tmp_path / "summary.json")
