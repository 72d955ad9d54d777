"""A SLURM cluster as the SLURM tests see it: the commands its clients run, and where they run them.

Two clusters are made by scripts/local_slurm_start.sh: this machine as one node (clients run here, with the
default configuration), and, with NANOEXP_SLURM_HOSTS=2, the two fake hosts of scripts/fake_hosts.sh as two
nodes (clients run on host 0, the head node, with that cluster's SLURM_CONF)."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Cluster:
    prefix: tuple[str, ...] = ()          # what runs a client command where the clients live
    env: dict = field(default_factory=dict)
    start: str = "bash scripts/local_slurm_start.sh"   # how to make it, for the skip message

    def command(self, *args: str) -> list[str]:
        return [*self.prefix, *args]

    def environ(self) -> dict:
        return {**os.environ, "OMP_NUM_THREADS": "1", **self.env}

    def run(self, *args: str, check: bool = False, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*args), env=self.environ(), capture_output=True, text=True, check=check,
                              timeout=timeout)


THIS_MACHINE = Cluster()
FAKE_HOSTS = Cluster(prefix=("bash", os.path.join(ROOT, "scripts", "fake_hosts.sh"), "run", "0"),
                     env={"SLURM_CONF": "/tmp/nanoexp-slurm-hosts/etc/slurm.conf"},
                     start="NANOEXP_SLURM_HOSTS=2 bash scripts/local_slurm_start.sh")


def cluster_state(cluster: Cluster, nodes: int = 1) -> str | None:
    """None when the cluster answers with `nodes` nodes that can run jobs, else why the tests cannot run."""
    if shutil.which("sinfo") is None:
        return "no SLURM here (sinfo not found)"
    if cluster.env.get("SLURM_CONF") and not os.path.exists(cluster.env["SLURM_CONF"]):
        return f"no {cluster.env['SLURM_CONF']}"
    try:
        result = cluster.run("sinfo", "-h", "-N", "-o", "%T")
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 30 s"
    if result.returncode != 0:
        return f"no SLURM controller answers ({(result.stderr.strip().splitlines() or ['sinfo failed'])[-1]})"
    states = result.stdout.split()   # a suffix such as "idle*" (not responding) means the node cannot run jobs
    ready = [s for s in states if s in ("idle", "mixed", "allocated")]
    if len(ready) < nodes:
        return f"fewer than {nodes} SLURM node(s) idle, mixed or allocated (states: {', '.join(states) or 'none'})"
    return None


def require_cluster(cluster: Cluster, nodes: int = 1, wait_s: float = 0) -> None:
    """Skips the test, with the reason, unless the cluster answers, waiting up to `wait_s` for its nodes to respond;
    under CI=true (where .ci/run starts both clusters) a missing cluster is an error, so the SLURM tests are never
    skipped silently there."""
    deadline = time.time() + wait_s
    while (reason := cluster_state(cluster, nodes)) is not None and time.time() < deadline:
        time.sleep(1)
    if reason is None:
        return
    message = f"{reason}: start one with `{cluster.start}` (root, Debian/Ubuntu)"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def start_sweep(cluster: Cluster, sweep_dir, *overrides) -> subprocess.Popen:
    command = cluster.command(sys.executable, os.path.join(ROOT, "train.py"), "-m", "+experiment=e2e_small",
                              "hydra/launcher=slurm", f"hydra.sweep.dir={sweep_dir}", *overrides)
    return subprocess.Popen(command, cwd=os.path.dirname(sweep_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=cluster.environ())


def finish(process: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        _, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
    return process.returncode, err


def slurm_job_ids(sweep_dir) -> dict[int, str]:
    """Sweep job number -> SLURM job id: "<array>_<task>" for task n of a job array, or the plain id of a
    one-job sweep (submitit submits no array then), from submitit's job folders."""
    ids = {}
    for pickle_path in glob.glob(os.path.join(sweep_dir, ".submitit", "*", "*_submitted.pkl")):
        name = os.path.basename(os.path.dirname(pickle_path))
        ids[int(name.split("_")[1]) if "_" in name else 0] = name
    return ids


def sacct_states(cluster: Cluster, job_id: str, duplicates: bool = False) -> list[str]:
    output = cluster.run("sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id, *(["-D"] if duplicates else [])).stdout
    return [line.split()[0] for line in output.splitlines() if line]


def task_pids(cluster: Cluster, job_id: str) -> list[int]:
    """PIDs of the processes of the job's first step on the head node (the srun tasks: our ranks)."""
    raw_id = cluster.run("squeue", "-h", "-o", "%A", "-j", job_id).stdout.strip()
    listing = cluster.run("scontrol", "listpids", raw_id, check=True).stdout
    rows = [line.split() for line in listing.splitlines()[1:]]
    pids = [int(row[0]) for row in rows if len(row) >= 3 and row[2] == "0"]
    assert pids, listing
    return pids


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.5)
