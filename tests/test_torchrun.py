"""Multi-node launch with torchrun, on one machine: two node ranks on loopback, c10d rendezvous.

Each "node" is one torchrun agent with 2 processes; together they form a world of 4 running
dp2tp2pp1. Reference: the same training in one process (tests/helpers.train), compared with the
parity tolerances of tests/test_parallel.py.
"""
import os
import subprocess
import sys

import numpy as np

from tests.helpers import FAST, read_metrics, train, train_losses
from tests.test_parallel import FIRST_STEP_ATOL, LATER_STEP_ATOL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ["tokens.train_steps=4", "tokens.val_check_interval=0", "optimizer.learning_rate_scheduler.lr_warmup_steps=2",
         "checkpoint.save_final_state=false"]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    losses = train_losses(read_metrics(run_dir))
    expected = train_losses(train(tmp_path / "reference", FAST + STEPS))
    assert len(losses) == 4
    assert abs(losses[0] - expected[0]) < FIRST_STEP_ATOL
    np.testing.assert_allclose(losses, expected, atol=LATER_STEP_ATOL, rtol=0)
    # Four ranks wrote their own logs into rank 0's folder; only rank 0 wrote the shared files.
    assert sorted(os.listdir(run_dir / "logs")) == [f"rank_{r}.log" for r in range(4)]
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / ".hydra").exists()


def test_a_lost_peer_becomes_one_line_naming_its_host():
    """gloo's two ways of losing a peer, as a rank sees them (texts from runs across the fake hosts): a closed
    connection names the peer's address, a partition only times out. Other errors are not about a peer."""
    from nanoexp.launch import lost_peer
    closed = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                          "by peer [127.0.0.1]:23721. This is typically caused by a remote worker crashing.")
    assert lost_peer(closed, 15).startswith("lost contact with ") and "(127.0.0.1)" in lost_peer(closed, 15)
    timed_out = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                             "15000ms for recv operation to complete")
    assert "parallelism.collective_timeout_s=15 s" in lost_peer(timed_out, 15)
    assert lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), 15) is None
