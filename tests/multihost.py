"""Two hosts on one machine for the multi-node tests: the fake hosts of scripts/fake_hosts.sh (network namespaces
with their own addresses and host names, one bridge) and torchrun agents started on them."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE_HOSTS = os.path.join(ROOT, "scripts", "fake_hosts.sh")
HOSTS = ("nanoexp-host0", "nanoexp-host1")


def fake_hosts(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", FAKE_HOSTS, *args], capture_output=True, text=True, timeout=120)


def hosts_up() -> bool:
    if os.geteuid() != 0:
        return False
    status = fake_hosts("status").stdout.split()
    return all(host in status for host in HOSTS)


def require_hosts(bring_up: bool = False) -> bool:
    """Two fake hosts: the ones already up, or, when asked (`bring_up`: pytest --fake-hosts, or CI=true), made here
    as root, and then True: the caller takes them down. Otherwise a skip with the reason; under CI=true, where the
    multi-host tests must run, an error. A plain `pytest` never changes the machine's network or /etc/hosts."""
    if hosts_up():
        return False
    ci = os.environ.get("CI") == "true"
    if not (bring_up or ci):
        reason = ("the multi-host tests need two fake hosts: `pytest --fake-hosts` (root) makes them for the run "
                  "and removes them after, or `bash scripts/fake_hosts.sh up 2` beforehand")
    elif os.geteuid() != 0:
        reason = "the multi-host tests need root (network namespaces): run pytest as root"
    elif shutil.which("unshare") is None:
        reason = "the multi-host tests need unshare (util-linux)"
    else:
        result = fake_hosts("up", "2")
        if result.returncode == 0 and hosts_up():
            return True
        fake_hosts("down")
        reason = f"scripts/fake_hosts.sh up 2 failed: {result.stderr.strip()[-500:]}"
    if ci:
        pytest.fail(reason)
    pytest.skip(reason)


def torchrun_on_host(host: int, args: list[str], cwd, env_extra: dict | None = None, **popen) -> subprocess.Popen:
    """A torchrun agent on fake host `host`, in its network and under its host name."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1", **(env_extra or {})}
    command = ["bash", FAKE_HOSTS, "run", str(host), sys.executable, "-m", "torch.distributed.run", *args]
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **popen)


def finish(agents: list[subprocess.Popen], timeout: float) -> list[str]:
    """Every agent's output once all have ended (killed after `timeout` seconds)."""
    outputs = []
    for agent in agents:
        try:
            outputs.append(agent.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            agent.kill()
            outputs.append(agent.communicate()[0] + "\n(killed: timeout)")
    return outputs


def kill_worker(host: int, local_rank: int = 1) -> int:
    """SIGKILL the worker of local rank `local_rank` on fake host `host` (a train.py process in its namespace)."""
    pids = subprocess.run(["ip", "netns", "pids", f"{HOSTS[0][:-1]}{host}"], capture_output=True, text=True).stdout
    for pid in map(int, pids.split()):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if f"LOCAL_RANK={local_rank}".encode() in environ and b"train.py" in cmdline and b"torch.distributed.run" \
                not in cmdline:
            os.kill(pid, 9)
            return pid
    raise RuntimeError(f"no worker of local rank {local_rank} on host {host}")


def wait_for_line(path, text: str, timeout: float = 120) -> None:
    """Until `text` appears in the file at `path` (a run's train.log)."""
    import time
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path) and text in open(path).read():
            return
        time.sleep(0.1)
    raise TimeoutError(f"{text!r} never appeared in {path}")
