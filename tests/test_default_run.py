"""`python train.py` as shipped: the default tiny run must still learn what the README says it does.

The slowest test of the suite (~2.5 min on 2 cores): it guards the tuned defaults (model shape, init,
schedule, step count) against a change that quietly makes the headline run worse. Only the loss is
checked; its time is reported in the README from a measured run, never asserted (machines are noisy).
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The default run takes 41-153 s alone and several times that on a loaded 2-core machine: the run's own 900 s limit,
# not pytest's default 600 s, decides.
@pytest.mark.slow
@pytest.mark.timeout(960)
def test_default_run_reaches_the_documented_eval_loss(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"hydra.run.dir={tmp_path}",
                             "logging.iteration_step_info_interval=1"],   # logging only: the run is unchanged
                            cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["layout"] == "dp1tp1pp1"
    # Measured 1.844 (README; 1.80-1.84 over seeds 42-44). The run is deterministic on one CPU, but another
    # CPU's kernels may sum in another order; 1.9 is the target the defaults were tuned for, ~0.06 above it.
    assert summary["eval_loss"] < 1.9
    with open(tmp_path / "metrics.jsonl") as f:
        first = json.loads(f.readline())
    assert first["step"] == 1 and first["loss"] > 5.0   # measured 6.12, above ln(320) = 5.77 of a uniform guess
