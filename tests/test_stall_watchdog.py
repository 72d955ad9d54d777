"""The stall watchdog on gloo: faults injected through the trainer's hooks (fault_injection.*) are diagnosed in
seconds, naming the right rank, group and step; slow but progressing runs are left alone.

Every faulted run here would otherwise hang until parallelism.collective_timeout_s (600 s), and the wrong-shape
one for ever (gloo ignores its timeout when the ranks posted different sizes)."""
import os
import pathlib
import subprocess
import sys
import time

import psutil
import pytest

from nanoexp.launch.watchdog import stall_limit
from nanoexp.launch.workers import WorkerFailed
from tests.helpers import FAST, compose_config, read_metrics, train

STALL_S = 3   # the watchdog's limit in these runs: every healthy step of FAST takes well under a second
RUN = FAST + ["tokens.train_steps=5", "tokens.val_check_interval=0", f"debug.stall_s={STALL_S}"]
PIPELINE = ["parallelism=dp1tp1pp2"]   # 4 micro-batches of FAST's 2 samples a step: 0..3


def diagnosis(tmp_path, overrides) -> tuple[list[str], float]:
    """The failed run's message as lines (the first is the headline, the next the likeliest cause), and the seconds
    from the start of the run to its end (the fault strikes at step 3, about a second in)."""
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        train(tmp_path, RUN + overrides)
    seconds = time.monotonic() - start
    print(f"{overrides}: ended after {seconds:.1f} s:\n{info.value}")   # the closing note's fault table
    return str(info.value).splitlines(), seconds


@pytest.mark.slow
def test_a_skipped_all_reduce_names_the_rank_that_skipped_it(tmp_path):
    lines, seconds = diagnosis(tmp_path, ["parallelism=dp2tp1pp1", "fault_injection.skip_collective_rank=1"])
    assert lines[0].startswith("rank 0 failed: stall: no rank progressed")
    cause = lines[1]
    assert cause.startswith("  - rank 1 has not posted all_reduce") and "of the dp group (ranks 0, 1)" in cause
    assert "in which rank 0 waits (step 3, loss all-reduce" in cause and "rank 1 went on without it" in cause
    assert seconds < 60
    dumps = tmp_path / "debug" / "fr"
    assert sorted(os.listdir(dumps)) == ["rank_0", "rank_1"] and f"dumps: {dumps}" in lines[-1]
    assert "missing ranks: {1}" in (tmp_path / "debug" / "torchfrtrace.txt").read_text()   # torch's analyzer agrees
    assert (tmp_path / "debug" / "stall.txt").read_text().startswith("stall: no rank progressed")


@pytest.mark.slow
def test_a_different_shape_names_both_shapes(tmp_path):
    lines, seconds = diagnosis(tmp_path, ["parallelism=dp2tp1pp1", "fault_injection.wrong_shape_rank=1"])
    cause = lines[1]
    assert cause.startswith("  - ranks disagree on collective #") and "of the dp group (ranks 0, 1) (step 3" in cause
    assert "rank 0 posted all_reduce of sizes [[]]" in cause and "rank 1 posted all_reduce of sizes [[2]]" in cause
    assert seconds < 60


@pytest.mark.slow
def test_a_pipeline_rank_one_micro_batch_short(tmp_path):
    lines, seconds = diagnosis(tmp_path, PIPELINE + ["fault_injection.short_pipeline_rank=0"])
    cause = lines[1]
    assert cause.startswith("  - rank 1 waits for the receive of micro-batch 3's activation (chunk 0) from rank 0 "
                            "at step 3; rank 0 went on without sending it: it waits in all_reduce")
    assert "of the pp group (ranks 0, 1) (step 3, loss all-reduce" in cause
    assert seconds < 60


@pytest.mark.slow
def test_a_rank_asleep_in_its_compute(tmp_path):
    lines, seconds = diagnosis(tmp_path, ["parallelism=dp2tp1pp1", "fault_injection.stall_rank=1"])
    cause = lines[1]
    assert cause.startswith("  - rank 1 has not posted all_reduce") and "in which rank 0 waits (step 3" in cause
    assert "rank 1 is in its own work, no collective pending: step 3" in cause
    assert seconds < 60


@pytest.mark.slow
def test_rank_1_diagnoses_when_rank_0_cannot_run_python(tmp_path):
    """Rank 0 stuck in a call that holds the interpreter lock: its watchdog cannot run, so rank 1's takes over,
    and the diagnosis goes without rank 0's dump."""
    lines, seconds = diagnosis(tmp_path, ["parallelism=dp2tp1pp1", "fault_injection.stall_rank=0",
                                          "fault_injection.stall_s=60", "fault_injection.stall_holds_interpreter=true"])
    assert lines[0].startswith("rank 1 failed: stall: no rank progressed")
    assert lines[1].startswith("  - rank 0 has not posted all_reduce") and "in which rank 1 waits (step 3" in lines[1]
    assert "rank 0 wrote no dump" in lines[1] and lines[-2] == "  - no dump from rank 0: dead, or stuck where " \
        "Python cannot run"
    assert seconds < 60   # (rank 0 may dump later, woken by the launcher's SIGTERM: after the diagnosis)


def stopped_descendants(pid: int) -> list[psutil.Process]:
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    return [c for c in children if c.is_running() and c.status() == psutil.STATUS_STOPPED]


@pytest.mark.slow
def test_a_frozen_rank_0_is_named_and_the_run_ends(tmp_path):
    """Rank 0 stopped (SIGSTOP) also stops the store it hosts, where every watchdog asks; rank 1's watchdog finds
    the store silent, names rank 0 within debug.stall_s + 30 s, and the launcher ends every worker, the stopped one
    too, and exits non-zero. Run as `python train.py`, for the exit code."""
    root = pathlib.Path(__file__).resolve().parent.parent
    output = tmp_path / "output.txt"
    command = [sys.executable, "train.py", *RUN, "parallelism=dp2tp1pp1", "fault_injection.sigstop_rank=0",
               f"hydra.run.dir={tmp_path / 'run'}"]
    frozen, stopped_at = [], None
    with open(output, "w") as out:
        launcher = subprocess.Popen(command, cwd=root, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while launcher.poll() is None and time.monotonic() < deadline:
            if not frozen:
                frozen = stopped_descendants(launcher.pid)
                stopped_at = time.time() if frozen else None
            time.sleep(0.1)
        ended_at = time.time()
    finally:
        for process in [launcher] + frozen:   # nothing left behind, stopped or not (SIGKILL ends a stopped one)
            try:
                process.kill()
            except (ProcessLookupError, psutil.Error):
                pass
        launcher.wait()
    text = output.read_text()
    assert frozen and launcher.returncode == 1, text
    diagnosed_at = (tmp_path / "run" / "debug" / "stall.txt").stat().st_mtime
    print(f"rank 0 stopped; diagnosis after {diagnosed_at - stopped_at:.1f} s, launcher exited after "
          f"{ended_at - stopped_at:.1f} s with code {launcher.returncode}")
    assert "rank 1 failed: stall: rank 0 is frozen: the store it hosts has not answered rank 1 for" in text
    assert "  - rank 0 has not posted all_reduce" in text and "in which rank 1 waits (step 3" in text
    assert diagnosed_at - stopped_at < STALL_S + 30 and ended_at - stopped_at < STALL_S + 30
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in frozen)


def test_a_rank_that_raises_is_reported_at_once(tmp_path):
    start = time.monotonic()
    with pytest.raises(WorkerFailed, match="rank 1 failed: RuntimeError: fault injection: rank 1 raises at step 3"):
        train(tmp_path, RUN + ["parallelism=dp2tp1pp1", "fault_injection.raise_rank=1"])
    assert time.monotonic() - start < 60
    assert not (tmp_path / "debug").exists()   # an error, not a stall: the watchdog had nothing to say


def test_collective_check_mode_stops_a_wrong_shape_before_it_runs(tmp_path):
    with pytest.raises(WorkerFailed, match="Detected mismatch between collectives on ranks"):
        train(tmp_path, RUN + ["parallelism=dp2tp1pp1", "fault_injection.wrong_shape_rank=1",
                               "debug.collectives=check"])
    assert not (tmp_path / "debug").exists()


@pytest.mark.slow
def test_slow_but_progressing_runs_raise_no_alarm(tmp_path):
    """Each longer than the limit: a first step (rank 1 asleep in it), two checkpoint saves (rank 0 asleep in
    them while rank 1 waits), and evaluations of 40 batches (progress at every batch)."""
    records = train(tmp_path, FAST + [
        "parallelism=dp2tp1pp1", "tokens.train_steps=4", "debug.stall_s=1",
        "fault_injection.stall_rank=1", "fault_injection.stall_at_step=1", "fault_injection.stall_s=2.5",
        "checkpoint.checkpoint_interval=2", "fault_injection.slow_checkpoint_s=2.5",
        "tokens.val_check_interval=2", "tokens.limit_val_batches=40"])
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    assert not (tmp_path / "debug").exists()
    assert read_metrics(tmp_path)[-1]["step"] == 4


def test_the_automatic_limit_follows_the_slowest_step():
    assert stall_limit(None, None) == 60 and stall_limit(None, 2.0) == 60 and stall_limit(None, 30.0) == 300
    assert stall_limit(5, 30.0) == 5   # a set limit holds


def test_groups_are_named_by_the_layout():
    from nanoexp.parallel.context import ParallelContext
    from nanoexp.parallel.layout import Layout
    ctx = ParallelContext.__new__(ParallelContext)   # its naming only: no process group is made
    ctx.layout, ctx.dp, ctx.cp, ctx.tp, ctx.pp = Layout(dp=2, tp=2, pp=2), 2, 1, 2, 2
    assert ctx.describe_group("tp_group", [4, 5]) == "tp group of pp stage 1, dp rank 0"
    assert ctx.describe_group("dp_group", [0, 2]) == "dp group of pp stage 0, tp rank 0"
    assert ctx.describe_group("pp_group", [1, 5]) == "pp group of dp rank 0, tp rank 1"
    assert ctx.describe_group("model_parallel_group", [0, 1, 4, 5]) == "model-parallel group of dp rank 0"


def test_the_heartbeat_marks_each_phase_of_a_step(tmp_path):
    """The watchdog's marks wrap the trainer's phases from outside (nanoexp/runtime/seams.py): a step beats them in
    the loop's order, and the first step is a long phase, which ends the start-up's."""
    from nanoexp.checks import check_config
    from nanoexp.runtime.seams import mark_phases
    from nanoexp.instruments.heartbeat import HEARTBEAT
    from nanoexp.parallel.context import ParallelContext
    from nanoexp.runtime.trainer import Trainer
    cfg = compose_config(FAST + ["tokens.train_steps=2", "tokens.val_check_interval=0",
                                 "checkpoint.save_final_state=false"])
    check_config(cfg, world_size=1)
    HEARTBEAT.reset()
    trainer = Trainer(cfg, ParallelContext(), str(tmp_path))
    mark_phases(trainer)
    trainer.train()
    beats = {step: [where for _, beat_step, where in HEARTBEAT._beats if beat_step == step] for step in (1, 2)}
    phases = ["forward and backward", "gradient sync", "loss all-reduce", "gradient norm", "stop-signal check",
              "optimizer step"]
    assert beats[1][:3 + len(phases)] == ["reading the batch", "first step", *phases, "after first step"]
    assert beats[2][:1 + len(phases)] == ["reading the batch", *phases]
    assert beats[2][-1] == "end of training" and HEARTBEAT.phase is None and HEARTBEAT.slowest_step_s > 0


def test_nothing_wraps_the_loop_when_the_watchdog_and_faults_are_off():
    from types import SimpleNamespace

    from nanoexp.config import FaultInjectionConfig
    from nanoexp.launch.fault_injection import FaultInjection
    from nanoexp.launch.watchdog import StallWatchdog
    trainer = SimpleNamespace()
    one_rank = SimpleNamespace(rank=0, world_size=1)
    StallWatchdog(SimpleNamespace(debug=SimpleNamespace(stall_s=None)), one_rank, "unused").watch(trainer)
    FaultInjection(FaultInjectionConfig(), rank=0).install(trainer)
    assert vars(trainer) == {}   # a wrapper would have been set on the instance
