"""SLURM across two hosts made on one machine: the fake hosts' cluster of scripts/local_slurm_start.sh
(NANOEXP_SLURM_HOSTS=2: one slurmd per fake host, the controller and accounting on host 0). Sweeps are submitted
from host 0, as from a cluster's login node; every job spans both nodes (hydra.launcher.nodes=2, 2 tasks each).

References: one process for the two-node sweep (parity tolerances of tests/test_parallel.py, since the layouts
differ), the same layout trained locally for the requeued job (same reductions: SAME_LAYOUT_ATOL)."""
import json

import numpy as np
import pytest

from tests.helpers import FAST, read_metrics, train, train_losses
from tests.multihost import HOSTS
from tests.slurm_cluster import (FAKE_HOSTS, finish, require_cluster, sacct_states, slurm_job_ids, start_sweep,
                                 wait_until)
from tests.test_parallel import assert_same_steps
from tests.test_slurm import SAME_LAYOUT_ATOL
from tests.test_sweep import E2E_STEPS

pytestmark = pytest.mark.service   # a SLURM cluster or the fake hosts: left out of the quick tier
TWO_NODES = ["hydra.launcher.nodes=2"]   # tasks per node: the world size (4) over the nodes


@pytest.fixture(scope="module")
def two_node_slurm():
    # After tests/test_multihost.py's partition, host 1 answers the controller's next ping (every 20 s, see
    # local_slurm_start.sh's SlurmdTimeout); until then sinfo shows it "idle*".
    require_cluster(FAKE_HOSTS, nodes=2, wait_s=60)


def assert_ran_on_both_hosts(run_dir, job_id: str) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 4
    assert sorted(summary["hosts"]) == list(HOSTS)
    node_list = FAKE_HOSTS.run("sacct", "-n", "-X", "-P", "-o", "NodeList", "-j", job_id).stdout.split()
    assert node_list[-1] == "nanoexp-host[0-1]", node_list
    logs = [(run_dir / "logs" / f"rank_{rank}.log").read_text() for rank in range(4)]
    assert [f"on {HOSTS[rank // 2]}]" in log for rank, log in enumerate(logs)] == [True] * 4   # 2 ranks a node


def test_two_node_sweep_trains_like_one_process(two_node_slurm, tmp_path):
    sweep = tmp_path / "sweep"
    process = start_sweep(FAKE_HOSTS, sweep, "parallelism=dp2tp2pp1,dp1tp2pp2", *TWO_NODES)
    reference = train(tmp_path / "one_process", FAST + E2E_STEPS)   # meanwhile
    code, err = finish(process, timeout=300)
    assert code == 0, err[-3000:]
    ids = slurm_job_ids(sweep)
    assert sorted(ids) == [0, 1]
    for job in (0, 1):
        wait_until(lambda: sacct_states(FAKE_HOSTS, ids[job]) == ["COMPLETED"], 60, f"job {ids[job]} COMPLETED")
        assert_ran_on_both_hosts(sweep / str(job), ids[job])
        records = read_metrics(sweep / str(job))
        assert len(train_losses(records)) == len(train_losses(reference)) == 6
        assert_same_steps(records, reference)   # losses and gradient norms


def test_usr2_reaches_both_nodes_and_the_requeued_job_resumes_exactly(two_node_slurm, tmp_path):
    """scancel --signal=USR2 signals every task on both nodes: each rank's log says the signal reached it, the
    ranks checkpoint after the same step, submitit requeues the job and it resumes to the uninterrupted losses."""
    sweep = tmp_path / "sweep"
    steps = ["parallelism=dp2tp2pp1", "tokens.train_steps=40", "fault_injection.slow_step_s=0.3"]
    process = start_sweep(FAKE_HOSTS, sweep, *steps, *TWO_NODES)
    expected = train_losses(train(tmp_path / "local", FAST + E2E_STEPS + steps[:2]))
    wait_until(lambda: (sweep / "0" / "metrics.jsonl").exists() and len(read_metrics(sweep / "0")) >= 2, 180,
               "training to start")
    job_id = slurm_job_ids(sweep)[0]
    FAKE_HOSTS.run("scancel", "--signal=USR2", job_id, check=True)
    code, err = finish(process, timeout=300)
    assert code == 0, err[-3000:]

    wait_until(lambda: sacct_states(FAKE_HOSTS, job_id) == ["COMPLETED"], 60, f"job {job_id} COMPLETED")
    assert "REQUEUED" in sacct_states(FAKE_HOSTS, job_id, duplicates=True)
    assert_ran_on_both_hosts(sweep / "0", job_id)
    for rank in range(4):
        assert "SIGUSR2 reached this rank" in (sweep / "0" / "logs" / f"rank_{rank}.log").read_text(), rank
    losses = {r["step"]: r["loss"] for r in read_metrics(sweep / "0") if "loss" in r}   # the resumed run wins
    assert sorted(losses) == list(range(1, 41))
    np.testing.assert_allclose([losses[s] for s in range(1, 41)], expected, atol=SAME_LAYOUT_ATOL, rtol=0)
