"""Multi-node runs across two hosts made on one machine (scripts/fake_hosts.sh: network namespaces with their own
addresses and host names): torchrun's plain c10d rendezvous across them trains the same model as one process.

Each host runs one torchrun agent with 2 processes (world 4). Reference: the same training in one process,
compared with the parity tolerances of tests/test_parallel.py. Root is needed (skipped with the reason
otherwise; an error under CI=true)."""
import json
import subprocess

import pytest

from tests.helpers import FAST, read_metrics, train, train_losses
from tests.multihost import (HOSTS, ROOT, fake_hosts, finish, kill_worker, require_hosts, torchrun_on_host,
                             wait_for_line)
from tests.test_parallel import assert_same_steps

pytestmark = pytest.mark.service   # a SLURM cluster or the fake hosts: left out of the quick tier
STEPS = ["tokens.train_steps=4", "tokens.val_check_interval=0", "optimizer.learning_rate_scheduler.lr_warmup_steps=2",
         "checkpoint.save_final_state=false"]
RENDEZVOUS = ["--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d", "--max-restarts=0"]


@pytest.fixture(scope="module")
def two_hosts(request):
    made = require_hosts(bring_up=request.config.getoption("--fake-hosts"))
    yield
    if made:
        fake_hosts("down")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("one_process"), FAST + STEPS)


def torchrun_everywhere(tmp_path, layout: list[str], rdzv_id: str, port: int) -> list[str]:
    args = [*RENDEZVOUS, f"--rdzv_endpoint={HOSTS[0]}:{port}", f"--rdzv_id={rdzv_id}", "train.py", *FAST, *STEPS,
            *layout, f"hydra.run.dir={tmp_path / 'run'}"]
    agents = [torchrun_on_host(host, args, cwd=ROOT) for host in (0, 1)]
    return finish(agents, timeout=240)


@pytest.mark.parametrize("layout, port", [
    (["parallelism=dp2tp2pp1"], 29411),                              # tp inside a host, dp across
    (["parallelism=dp1tp2pp2"], 29412),                              # pp across hosts
    (["parallelism=dp1cp2tp2pp1", "parallelism.tp_mode=reduce_scatter"], 29413),   # the cp ring across hosts
], ids=["dp2tp2pp1", "dp1tp2pp2", "dp1cp2tp2pp1-sp"])
def test_torchrun_across_two_hosts_trains_like_one_process(two_hosts, reference, layout, port, tmp_path):
    outputs = torchrun_everywhere(tmp_path, layout, f"nanoexp-{layout[0][12:]}", port)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed", outputs[0][-3000:] + outputs[1][-3000:]
    records = read_metrics(tmp_path / "run")
    assert len(train_losses(records)) == len(train_losses(reference)) == 4
    assert_same_steps(records, reference)   # losses and gradient norms
    # One run folder (rank 0's, on the shared file system), the hosts recorded, each node's peak in the MFU's.
    assert sorted(summary["hosts"]) == list(HOSTS) and summary["world_size"] == 4
    assert "the sum of 2 nodes' peaks" in summary["peak_source"]
    logs = sorted((tmp_path / "run" / "logs").iterdir())
    assert [log.name for log in logs] == [f"rank_{r}.log" for r in range(4)]
    said = [next(host for host in HOSTS if f"on {host}]" in log.read_text()) for log in logs]
    assert sorted(said) == [HOSTS[0]] * 2 + [HOSTS[1]] * 2   # each log says its rank's host


# -- faults across hosts ---------------------------------------------------------------------------------------
FAULT_RUN = ["tokens.train_steps=16", "tokens.val_check_interval=0", "checkpoint.checkpoint_interval=4",
             "optimizer.learning_rate_scheduler.lr_warmup_steps=2", "fault_injection.slow_step_s=0.3",
             "parallelism=dp2tp2pp1", "parallelism.collective_timeout_s=15"]


def start_fault_run(run_dir, port: int, restarts: int, rdzv_id: str) -> list:
    args = ["--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d", f"--rdzv_endpoint={HOSTS[0]}:{port}",
            f"--rdzv_id={rdzv_id}", f"--max-restarts={restarts}", "train.py", *FAST, *FAULT_RUN,
            f"hydra.run.dir={run_dir}"]
    return [torchrun_on_host(host, args, cwd=ROOT) for host in (0, 1)]   # plain torchrun: its agent store shared


def step_losses(run_dir) -> dict[int, float]:
    """The loss of every step; a step trained twice (before a failure and after the resume) keeps its last."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(two_hosts, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    outputs = finish(start_fault_run(run_dir, 29421, 0, "nanoexp-uninterrupted"), timeout=240)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed", outputs[0][-3000:]
    return step_losses(run_dir)


def test_a_killed_worker_restarts_the_world_which_resumes_exactly(uninterrupted, tmp_path):
    """Plain torchrun --max-restarts=1: SIGKILL of a worker on host 1 at step 7 restarts every host's workers, which
    meet in a store of their round's own (nanoexp.launch.rendezvous), resume from checkpoint 4 and end with the
    uninterrupted run's losses, bit for bit (same layout)."""
    run_dir = tmp_path / "run"
    agents = start_fault_run(run_dir, 29422, 1, "nanoexp-restart")
    wait_for_line(run_dir / "train.log", "step 7/16")
    kill_worker(1)
    outputs = finish(agents, timeout=240)
    assert all(agent.returncode == 0 for agent in agents), outputs[0][-3000:] + outputs[1][-3000:]
    log = (run_dir / "train.log").read_text()
    assert "resuming from" in log and f"{run_dir}/checkpoints/4" in log
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in log   # no workaround to warn about: plain torchrun recovers
    assert step_losses(run_dir) == uninterrupted


def test_without_restarts_a_lost_worker_ends_every_rank_cleanly(two_hosts, tmp_path):
    """No restarts: the other ranks end within seconds with one line each naming the host they lost contact with,
    and the last checkpoint stays the one before the failure."""
    import time
    run_dir = tmp_path / "run"
    agents = start_fault_run(run_dir, 29423, 0, "nanoexp-lost-worker")
    wait_for_line(run_dir / "train.log", "step 7/16")
    kill_worker(1)
    killed = time.time()
    outputs = finish(agents, timeout=120)
    assert time.time() - killed < 15   # gloo sees the closed connections at once, well within the timeout
    lines = {int(line.split()[2]): line for output in outputs for line in output.splitlines()
             if line.startswith("nanoexp: rank")}
    assert sorted(lines) == [0, 1, 2] and all("lost contact with nanoexp-host" in line for line in lines.values())
    # Rank 3 (dp1 tp1, on host 1) shares groups with rank 1 (dp) and rank 2 (tp): they name its host. Rank 0 only
    # talks to ranks 1 and 2 and names whichever of them stopped first.
    assert all(f"lost contact with {HOSTS[1]}" in lines[rank] for rank in (1, 2)), "\n".join(lines.values())
    assert (run_dir / "checkpoints" / "latest.txt").read_text().strip() == "4"
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"


def test_a_partition_ends_cleanly_and_a_resume_after_it_finishes_the_run(uninterrupted, tmp_path):
    """Host 1's link goes down at step 7: every rank ends within parallelism.collective_timeout_s (15 s) plus a
    little, one line each; with the link back, a resume in the same folder reaches the uninterrupted losses."""
    import time
    run_dir = tmp_path / "run"
    agents = start_fault_run(run_dir, 29424, 0, "nanoexp-partition")
    wait_for_line(run_dir / "train.log", "step 7/16")
    subprocess.run(["ip", "-n", f"{HOSTS[1]}", "link", "set", "eth0", "down"], check=True)
    cut = time.time()
    try:
        wait_for_line(run_dir / "summary.json", '"status": "failed"', timeout=60)
        ended = time.time() - cut
        outputs = finish(agents[:1], timeout=60)
        # Host 1's workers have timed out too, but its agent waits on the rendezvous store across the cut: stop it.
        agents[1].terminate()
        outputs += finish(agents[1:], timeout=10)
    finally:
        subprocess.run(["ip", "-n", f"{HOSTS[1]}", "link", "set", "eth0", "up"], check=True)
    assert ended < 15 + 10, ended
    lines = [line for output in outputs for line in output.splitlines() if line.startswith("nanoexp: rank")]
    assert sum("collective_timeout_s=15" in line for line in lines) >= 2, lines   # host 0's ranks, at least
    assert (run_dir / "checkpoints" / "latest.txt").read_text().strip() == "4"
    outputs = finish(start_fault_run(run_dir, 29425, 0, "nanoexp-after-partition"), timeout=240)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed", outputs[0][-3000:]
    assert step_losses(run_dir) == uninterrupted


# -- hybrid sharding across hosts (docs/multi-node.md#hybrid-sharding-across-hosts) --------------------------------
@pytest.mark.slow
def test_hybrid_sharding_keeps_zero3_inside_a_host(two_hosts, tmp_path):
    """dp4 ZeRO-3 on 2 hosts x 2 processes: with shard groups of 2 (one per host) only the replica all-reduce and
    the loss scalars cross the boundary, by the counter's ring rule; full sharding's ring over the 4 ranks crosses
    on half of them. Both equal the formula (plan.traffic) up to the world group's few bytes (< 100, no formula)."""
    from benchmarks.bench_hybrid_hosts import BASE, run_case
    crossed = {}
    for name, extra, port in (("hybrid", ["parallelism.dp_shard=2"], 29431), ("full", [], 29432)):
        (tmp_path / name).mkdir()
        results = run_case([*FAST, *BASE, *extra], 1, str(tmp_path / name), port, timeout=240)
        assert sorted(r["host"] for r in results) == [HOSTS[0]] * 2 + [HOSTS[1]] * 2
        for r in results:
            assert 0 <= r["crossed"] - r["crossed_formula"] < 100, r
        crossed[name] = sum(r["crossed"] for r in results)
        if name == "hybrid":   # every rank's replica goes to the other host; no shard group byte crosses
            assert all(r["crossed_formula"] == r["formula"]["replica"] + (r["sent"]["dp"] if r["rank"] % 2 else 0)
                       for r in results), results
        else:
            assert crossed[name] > 0
    assert crossed["hybrid"] < crossed["full"] / 3
