"""Replica groups across the two fake hosts (scripts/fake_hosts.sh): the lighthouse and group 0 on host 0, group 1
on host 1, each a `train.py` of its own with fault_tolerance.group and the lighthouse's address, sharing the run
folder as a cluster's file system. Group 1's rank is killed in step 3 (min_replicas=2: group 0 waits), host 1
starts it again as a job script's loop would, it copies group 0's state across the hosts and the run is the
failure-free one. Root is needed (skipped with the reason otherwise; an error under CI=true)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import FAST, read_metrics, train_losses
from tests.multihost import FAKE_HOSTS, HOSTS, ROOT, fake_hosts, require_hosts
from tests.test_replica_groups import BASE, assert_same_training

pytestmark = [pytest.mark.service, pytest.mark.skipif(importlib.util.find_spec("torchft") is None and
                                                      os.environ.get("CI") != "true", reason="pip install -e '.[ft]'")]
PORT = 29517


@pytest.fixture(scope="module")
def two_hosts(request):
    made = require_hosts(bring_up=request.config.getoption("--fake-hosts"))
    yield
    if made:
        fake_hosts("down")


def on_host(host: int, command: list[str], log) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1", "PYTHONPATH": ROOT}
    return subprocess.Popen(["bash", FAKE_HOSTS, "run", str(host), *command], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def test_a_group_on_another_host_dies_comes_back_and_heals_across_hosts(two_hosts, tmp_path, train_once):
    run = BASE + ["tokens.train_steps=6"]
    plain_dir, plain = train_once(run + ["parallelism=dp2tp1pp1"])
    lighthouse = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    group = [sys.executable, "train.py", *run, "fault_tolerance=torchft", "fault_tolerance.min_replicas=2",
             f"fault_tolerance.lighthouse=http://{HOSTS[0]}:{PORT}", "fault_injection.kill_group=1",
             f"hydra.run.dir={tmp_path}"]
    with open(tmp_path.parent / "hosts.log", "w") as log:
        server = on_host(0, [lighthouse, "--min_replicas", "2", "--bind", f"[::]:{PORT}", "--heartbeat_timeout_ms",
                             "2000"], log)
        try:
            first = on_host(0, group + ["fault_tolerance.group=0"], log)
            codes = [on_host(1, group + ["fault_tolerance.group=1"], log).wait(timeout=300)]
            codes.append(on_host(1, group + ["fault_tolerance.group=1"], log).wait(timeout=300))   # its loop
            codes.append(first.wait(timeout=300))
        finally:
            server.terminate()
            server.wait()
    assert codes[0] != 0 and codes[1:] == [0, 0], open(tmp_path.parent / "hosts.log").read()[-3000:]
    groups = [json.load(open(tmp_path / f"group_{g}" / "summary.json")) for g in (0, 1)]
    assert groups[0]["hosts"] == [HOSTS[0]] and groups[1]["hosts"] == [HOSTS[1]]
    assert groups[0]["state_crc32"] == groups[1]["state_crc32"] and groups[1]["fault_tolerance"]["heals"] == 1
    ft = read_metrics(tmp_path / "group_0")
    assert train_losses(ft) == pytest.approx(train_losses(plain), rel=1e-5)
    assert_same_training(plain, ft, plain_dir, tmp_path, 6)
