"""benchmarks/bench_gpu.sh, the one script for the lent GPU's fifteen minutes, exercised on CPU: its dry run takes
the same steps on tiny shapes and must leave a compact $OUT within the command's 600 s limit."""
import importlib.metadata
import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND_LIMIT_S = 600   # one device command's limit
FILES_BACK = 8          # the files a device command can return


@pytest.mark.slow
def test_the_dry_run_fits_the_loan(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(["bash", "benchmarks/bench_gpu.sh", "--dry-run"], cwd=ROOT, capture_output=True,
                            text=True, env={**os.environ, "OUT": str(out)}, timeout=COMMAND_LIMIT_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["bench_gpu.log", "results.json"]   # well under FILES_BACK; no run folders
    runs = json.loads((out / "results.json").read_text())
    names = [run["name"] for run in runs]
    assert names[:3] == ["smoke", "mb2", "mb4"] and set(names[3:]) <= {"fp8_mb2"}
    for run in runs:
        assert run["exit_code"] == 0 and run["summary"]["status"] == "completed", run
        assert run["ended_s"] <= 540 and len(run["log_tail"]) > 0
    assert "smoke: loss" in result.stdout and "OK" in result.stdout


@pytest.mark.slow
def test_runs_that_would_overrun_the_budget_are_skipped_and_said_so(tmp_path):
    """A 40 s budget holds the smoke test at most and skips the rest, each skip said; nothing ends past it."""
    result = subprocess.run(["bash", "benchmarks/bench_gpu.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "OUT": str(tmp_path), "BUDGET_S": "40"}, timeout=COMMAND_LIMIT_S)
    runs = json.loads((tmp_path / "results.json").read_text()) if (tmp_path / "results.json").exists() else []
    skipped = [line.split()[1].rstrip(":") for line in result.stdout.splitlines() if line.endswith("s budget")]
    assert skipped and "fp8_mb2" in skipped + [run["name"] for run in runs]
    assert [run["name"] for run in runs] + skipped == ["smoke", "mb2", "mb4", "fp8_mb2"][:len(runs) + len(skipped)]
    assert all(run["ended_s"] <= 40 for run in runs)


def test_the_carried_wheels_are_the_versions_installed_here():
    """The pure-Python pins of benchmarks/gpu_wheels.txt are what this suite ran with (torchao's is for torch 2.11)."""
    lines = [line.split("==") for line in open(os.path.join(ROOT, "benchmarks", "gpu_wheels.txt"))
             if line.strip() and not line.startswith("#")]
    pins = dict(lines)
    for name in ("hydra-core", "omegaconf", "antlr4-python3-runtime"):
        assert pins[name].strip() == importlib.metadata.version(name), name
