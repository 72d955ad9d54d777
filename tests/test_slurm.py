"""Sweeps through `hydra/launcher=slurm` on a real SLURM cluster.

The tests run when a cluster answers (`sinfo` lists a node idle, mixed or allocated) and are skipped,
with the reason, otherwise (an error under CI=true): no test installs packages or starts or stops daemons. On a laptop (Debian or
Ubuntu, as root): `bash scripts/local_slurm_start.sh`, then pytest, then `bash scripts/local_slurm_stop.sh`;
`.ci/run` starts the cluster before the test command, so CI runs them. Every job is
`+experiment=e2e_small`: the tests' FAST model, 2 tasks (one per rank), a handful of steps. References: the
same layouts trained locally in this process (tests/helpers.train). Same layout, same reductions, so the
losses agree to rounding noise: measured identical; the 1e-6 tolerance only allows for a BLAS kernel choice.
"""
import csv
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import FAST, read_metrics, train, train_losses
from tests.slurm_cluster import (ROOT, THIS_MACHINE, finish, require_cluster, sacct_states, slurm_job_ids,
                                 start_sweep, task_pids, wait_until)
from tests.test_sweep import E2E_STEPS

pytestmark = pytest.mark.service   # a SLURM cluster or the fake hosts: left out of the quick tier
SAME_LAYOUT_ATOL = 1e-6
CLUSTER = THIS_MACHINE


@pytest.fixture(scope="module")
def slurm():
    """Skips the test unless a SLURM cluster answers (an error under CI=true); see tests/slurm_cluster.py."""
    require_cluster(CLUSTER)


def local_losses(tmp_path, layout: str, *overrides) -> list[float]:
    return train_losses(train(tmp_path / f"local_{layout}", FAST + E2E_STEPS + [f"parallelism={layout}", *overrides]))


def test_sweep_of_two_layouts_completes_with_the_local_losses(slurm, tmp_path):
    sweep = tmp_path / "sweep"
    process = start_sweep(CLUSTER, sweep)   # parallelism=dp2tp1pp1,dp1tp2pp1: both 2 tasks, one job array
    expected = {layout: local_losses(tmp_path, layout) for layout in ("dp2tp1pp1", "dp1tp2pp1")}   # meanwhile
    code, err = finish(process, timeout=240)
    assert code == 0, err[-3000:]
    ids = slurm_job_ids(sweep)
    assert sorted(ids) == [0, 1] and len({i.split("_")[0] for i in ids.values()}) == 1   # one job array
    for job, layout in ((0, "dp2tp1pp1"), (1, "dp1tp2pp1")):
        wait_until(lambda: sacct_states(CLUSTER, ids[job]) == ["COMPLETED"], 60, f"sacct to show job {ids[job]} COMPLETED")
        summary = json.loads((sweep / str(job) / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["layout"] == layout and summary["world_size"] == 2
        np.testing.assert_allclose(train_losses(read_metrics(sweep / str(job))), expected[layout],
                                   atol=SAME_LAYOUT_ATOL, rtol=0)
        # Two SLURM tasks, two ranks, one run folder; only rank 0 wrote metrics and summary.
        assert sorted(os.listdir(sweep / str(job) / "logs")) == ["rank_0.log", "rank_1.log"]


def test_job_killed_from_outside_is_reported_failed(slurm, tmp_path):
    """Job 1 trains 'forever' and its ranks are SIGKILLed (as the OOM killer would): no result is written, yet
    the sweep ends soon after with an error, and the report lists job 1 as failed next to job 0."""
    sweep = tmp_path / "sweep"
    process = start_sweep(CLUSTER, sweep, "parallelism=dp2tp1pp1", "tokens.train_steps=6,100000")
    wait_until(lambda: (sweep / "1" / "metrics.jsonl").exists(), 180, "job 1 to start training")
    job_id = slurm_job_ids(sweep)[1]
    for pid in task_pids(CLUSTER, job_id):
        os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    code, err = finish(process, timeout=120)
    assert code != 0 and "UncompletedJobError" in err and "FAILED" in err, err[-3000:]
    assert time.time() - killed_at < 60   # measured ~15-20 s: submitit polls sacct

    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "summarize_sweep.py"), str(sweep),
                             "--no-plots"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [(r["job"], r["state"]) for r in rows] == [("0", "completed"), ("1", "failed")], result.stdout
    assert f"SLURM job {job_id} ended FAILED" in rows[1]["reason"]


def test_signalled_job_checkpoints_is_requeued_and_ends_with_uninterrupted_losses(slurm, tmp_path):
    """USR2 is what SLURM sends `signal_delay_s` before the time limit (and what submitit expects for a
    preemption): every rank checkpoints after its step, submitit requeues the job, and the requeued job
    resumes from the newest checkpoint in its run folder (checkpoint.resume=auto)."""
    sweep = tmp_path / "sweep"
    # 0.3 s before each step: the signal, sent after step 2, lands well before step 40 on any machine
    # (a fast one trains all 40 steps in a few seconds, and the requeue then resumes a finished run).
    steps = ["parallelism=dp2tp1pp1", "tokens.train_steps=40", "fault_injection.slow_step_s=0.3"]
    process = start_sweep(CLUSTER, sweep, *steps)
    expected = local_losses(tmp_path, "dp2tp1pp1", "tokens.train_steps=40")
    wait_until(lambda: len(read_metrics(sweep / "0")) >= 2 if (sweep / "0" / "metrics.jsonl").exists() else False,
               180, "training to start")
    job_id = slurm_job_ids(sweep)[0]
    CLUSTER.run("scancel", f"--signal={signal.SIGUSR2.name[3:]}", job_id, check=True)
    code, err = finish(process, timeout=240)
    assert code == 0, err[-3000:]

    wait_until(lambda: sacct_states(CLUSTER, job_id) == ["COMPLETED"], 60, f"sacct to show job {job_id} COMPLETED")
    assert "REQUEUED" in sacct_states(CLUSTER, job_id, duplicates=True)
    log = (sweep / "0" / "train.log").read_text()
    assert "stop signal received: checkpoint saved after step" in log and "resum" in log.lower()
    losses = {}
    for record in read_metrics(sweep / "0"):   # steps after the checkpoint appear twice: the resumed run wins
        if "loss" in record:
            losses[record["step"]] = record["loss"]
    assert sorted(losses) == list(range(1, 41))
    np.testing.assert_allclose([losses[s] for s in range(1, 41)], expected, atol=SAME_LAYOUT_ATOL, rtol=0)
    assert json.loads((sweep / "0" / "summary.json").read_text())["status"] == "completed"
