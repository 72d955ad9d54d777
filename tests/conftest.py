import copy
import os
import sys
import tempfile

import pytest
import torch

# Tests run several gloo ranks on 2 cores: keep each process to one thread.
torch.set_num_threads(1)
# The machine's cached matmul peak (nanoexp/observe/peak.py) stays the user's: the tests keep their own, per session.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="nanoexp-test-cache-")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# The tiers (markers declared in pyproject.toml): `pytest -m quick` for the inner loop of a change, every test not
# marked slow or service; `pytest` for the whole suite, what CI runs.
def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(name) for name in ("slow", "service")):
            item.add_marker(pytest.mark.quick)


def pytest_addoption(parser):
    parser.addoption("--fake-hosts", action="store_true", help="make the two fake hosts of scripts/fake_hosts.sh "
                     "(root: network namespaces and /etc/hosts lines) for tests/test_multihost.py, and remove them "
                     "after; without it those tests use hosts already up, or skip")


def _canonical(overrides: list[str]) -> tuple[str, ...]:
    """One key for the same run written in another order: Hydra applies a key's last value, groups before keys."""
    last = {}
    for override in overrides:
        last[override.split("=", 1)[0]] = override
    return tuple(sorted(last.values()))


@pytest.fixture(scope="session")
def train_once(tmp_path_factory):
    """`train_once(overrides) -> (run folder, metrics records)`: each distinct run trained once per test session.

    Single-process reference runs are shared by every file that compares against them; the records are copies, the
    folder is shared and must be read only."""
    from tests.helpers import train
    runs = {}

    def run(overrides: list[str]):
        key = _canonical(overrides)
        if key not in runs:
            folder = tmp_path_factory.mktemp("once")
            runs[key] = (folder, train(folder, list(overrides)))
        folder, records = runs[key]
        return folder, copy.deepcopy(records)
    return run


@pytest.fixture(autouse=True)
def _root_log_handlers_stay_the_tests():
    """A run in this process adds handlers to the root logger (its train.log, a console on pytest's captured stream,
    closed after the test): they go with the test, so a later run does not write into a closed file."""
    import logging
    root = logging.getLogger()
    before = list(root.handlers)
    yield
    for handler in [h for h in root.handlers if h not in before]:
        root.removeHandler(handler)
        handler.close()
