"""Launch with torchrun on one machine: two node ranks on loopback (c10d rendezvous), and a restart.

Each "node" is one torchrun agent with 2 processes; together they form a world of 4 running
dp2tp2pp1. Reference: the same training in one process (tests/helpers.train), compared with the
parity tolerances of tests/test_parallel.py. A worker killed under `torchrun --max-restarts=1` restarts
the world, which resumes exactly (nanoexp.launch.rendezvous keeps the rounds' stores apart).
"""
import os
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch.distributed as dist

from nanoexp.launch import rendezvous
from tests.helpers import FAST, read_metrics, train, train_losses
from tests.multihost import wait_for_line
from tests.test_parallel import assert_same_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ["tokens.train_steps=4", "tokens.val_check_interval=0", "optimizer.learning_rate_scheduler.lr_warmup_steps=2",
         "checkpoint.save_final_state=false"]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_torchrun_nodes_on_loopback_train_like_one_process(tmp_path):
    port = free_port()
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    agents = []
    for node_rank in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
                   f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                   "--rdzv-id=nanoexp-test", "--local-addr=127.0.0.1", "--max-restarts=0",
                   os.path.join(ROOT, "train.py"), *FAST, *STEPS, "parallelism=dp2tp2pp1", f"hydra.run.dir={run_dir}"]
        agents.append(subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True))
    outputs = []
    for agent in agents:
        try:
            outputs.append(agent.communicate(timeout=240)[0])
        finally:
            if agent.poll() is None:
                agent.kill()
    for agent, output in zip(agents, outputs):
        assert agent.returncode == 0, output[-3000:]

    records = read_metrics(run_dir)
    assert len(train_losses(records)) == 4
    assert_same_steps(records, train(tmp_path / "reference", FAST + STEPS))   # losses and gradient norms
    # Four ranks wrote their own logs into rank 0's folder; only rank 0 wrote the shared files.
    assert sorted(os.listdir(run_dir / "logs")) == [f"rank_{r}.log" for r in range(4)]
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / ".hydra").exists()


def test_a_lost_peer_becomes_one_line_naming_its_host():
    """gloo's two ways of losing a peer, as a rank sees them (texts from runs across the fake hosts): a closed
    connection names the peer's address, a partition only times out. Other errors are not about a peer."""
    from nanoexp.launch.workers import lost_peer
    closed = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                          "by peer [127.0.0.1]:23721. This is typically caused by a remote worker crashing.")
    assert lost_peer(closed, 15).startswith("lost contact with ") and "(127.0.0.1)" in lost_peer(closed, 15)
    timed_out = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                             "15000ms for recv operation to complete")
    assert "parallelism.collective_timeout_s=15 s" in lost_peer(timed_out, 15)
    assert lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), 15) is None


# -- a restart on one host ---------------------------------------------------------------------------------------
RESTART_RUN = ["tokens.train_steps=12", "tokens.val_check_interval=0", "checkpoint.checkpoint_interval=4",
               "parallelism=dp2tp1pp1", "parallelism.collective_timeout_s=20",
               "fault_injection.slow_step_s=0.3"]   # last: slower steps, so that the kill lands mid-run


def torchrun_restarting(run_dir) -> subprocess.Popen:
    """Plain torchrun, 2 workers, one restart: its agent store shared across the rounds, as by default."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
               os.path.join(ROOT, "train.py"), *FAST, *RESTART_RUN, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return subprocess.Popen(command, cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def kill_local_worker(agent: subprocess.Popen, local_rank: int = 1) -> int:
    """SIGKILL the train.py worker of local rank `local_rank` among the agent's children."""
    for child in psutil.Process(agent.pid).children(recursive=True):
        try:
            environ, cmdline = child.environ(), child.cmdline()
        except psutil.Error:
            continue
        if environ.get("LOCAL_RANK") == str(local_rank) and any(arg.endswith("train.py") for arg in cmdline):
            child.kill()
            return child.pid
    raise RuntimeError(f"no worker of local rank {local_rank} under torchrun ({agent.pid})")


def finished(agent: subprocess.Popen, timeout: float = 120) -> str:
    try:
        return agent.communicate(timeout=timeout)[0]
    finally:
        if agent.poll() is None:
            agent.kill()


def step_losses_of(records: list[dict]) -> dict[int, float]:
    """The loss of every step; a step trained twice (before a failure and after the resume) keeps its last."""
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.slow
def test_a_killed_worker_under_plain_torchrun_restarts_and_resumes_exactly(tmp_path):
    """torchrun --standalone --max-restarts=1: SIGKILL of local rank 1 at step 6 restarts both workers, which
    resume from checkpoint 4 and end with an uninterrupted run's losses, bit for bit. The uninterrupted run has
    local workers (the same 2 ranks and threads, quicker to start than torchrun's) and no slowed steps."""
    uninterrupted = step_losses_of(train(tmp_path / "uninterrupted", FAST + RESTART_RUN[:-1]))
    run_dir = tmp_path / "restarted" / "run"
    run_dir.parent.mkdir()
    agent = torchrun_restarting(run_dir)
    wait_for_line(run_dir / "train.log", "step 6/12", timeout=60)
    kill_local_worker(agent)
    output = finished(agent)
    assert agent.returncode == 0, output[-3000:]   # without a round's own store: refused, or a hang until timeout
    log = (run_dir / "train.log").read_text()
    assert "resuming from" in log and f"{run_dir}/checkpoints/4" in log
    assert sorted(uninterrupted) == list(range(1, 13))
    assert step_losses_of(read_metrics(run_dir)) == uninterrupted


# -- the round's store, in one process ----------------------------------------------------------------------------
def agent_store() -> tuple[dist.TCPStore, dict]:
    """A stand-in for torchrun's agent store, and the environment its workers would see."""
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return agent, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


def joining(rank: int, environ: dict) -> tuple[threading.Thread, dict]:
    found = {}
    thread = threading.Thread(target=lambda: found.update(store=rendezvous.round_store(rank, 20, environ)))
    thread.start()
    return thread, found


def test_ranks_pass_over_a_dead_rounds_store_and_meet_in_the_new_one():
    agent, environ = agent_store()
    assert rendezvous.uses_agent_store(environ)
    # SLURM tasks, local workers, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: env:// as before
    assert not rendezvous.uses_agent_store({})
    assert not rendezvous.uses_agent_store({"TORCHELASTIC_USE_AGENT_STORE": "False"})
    dead = free_port()   # the previous round's rank 0 is gone: its server refuses
    agent.set(rendezvous.ANNOUNCEMENT, f"127.0.0.1:{dead}:0123456789abcdef")
    thread, found = joining(1, environ)
    time.sleep(1.0)   # rank 1 reads the stale announcement, and again, until rank 0 replaces it
    assert thread.is_alive()
    store = rendezvous.round_store(0, 20, environ)
    thread.join(timeout=10)
    found["store"].set("from rank 1", "hello")
    assert store.get("from rank 1") == b"hello"


def test_a_live_store_with_another_nonce_is_not_this_rounds():
    """The port of a dead round's store taken again by the new rank 0's: the nonce tells them apart."""
    agent, environ = agent_store()
    store = rendezvous.round_store(0, 20, environ)
    agent.set(rendezvous.ANNOUNCEMENT, agent.get(rendezvous.ANNOUNCEMENT).decode()[:-16] + "0" * 16)   # stale nonce
    thread, found = joining(1, environ)
    time.sleep(1.0)
    assert thread.is_alive()
    fresh = rendezvous.round_store(0, 20, environ)   # the new round's rank 0 announces its own: rank 1 takes it
    thread.join(timeout=10)
    found["store"].set("from rank 1", "hello")
    assert fresh.get("from rank 1") == b"hello" and not store.check(["from rank 1"])


def test_without_rank_0_a_rank_gives_up_within_the_timeout():
    agent, environ = agent_store()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="rank 0 never announced"):
        rendezvous.round_store(1, 1.0, environ)
    assert time.monotonic() - started < 5
