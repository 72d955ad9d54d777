import os
import sys
import tempfile

import torch

# Tests run several gloo ranks on 2 cores: keep each process to one thread.
torch.set_num_threads(1)
# The machine's cached matmul peak (nanoexp/observe/peak.py) stays the user's: the tests keep their own, per session.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="nanoexp-test-cache-")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_addoption(parser):
    parser.addoption("--fake-hosts", action="store_true", help="make the two fake hosts of scripts/fake_hosts.sh "
                     "(root: network namespaces and /etc/hosts lines) for tests/test_multihost.py, and remove them "
                     "after; without it those tests use hosts already up, or skip")
