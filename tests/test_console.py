"""What `python train.py` prints and leaves behind, run as a user runs it (a subprocess)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_py(*args, cwd=ROOT):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_debug_fast_run_tells_what_it_is_how_far_and_how_it_ended(tmp_path):
    result = train_py("debug=fast", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    for fact in (f"run folder: {tmp_path / 'run'}", "model: 541,536 parameters (hidden 96, 4 layers",
                 "layout: dp1tp1pp1 (1 process)", "global batch: 32 sequences x 128 tokens = 4,096 tokens per step",
                 "data: builtin: 37,541 training samples per epoch", "held-out 1,968 samples",
                 "starting from step 1", "peak for MFU: ", "nanoexp/peaks.json"):
        assert fact in out, fact
    # measured now, or read from today's measurement of an earlier run (nanoexp/observe/peak.py node_peak)
    assert "float32 matmuls on" in out or "float32 measurement on" in out
    steps = [line for line in out.splitlines() if "| loss " in line]
    assert [line.split("step ")[1].split(" |")[0] for line in steps] == ["1/4", "2/4", "3/4", "4/4"]
    assert all(", ETA " in line for line in steps)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    last = out.rstrip().splitlines()[-1]
    assert "completed | 4 steps | final loss" in last and last.endswith(str(tmp_path / "run" / "summary.json"))
    assert f"eval loss {summary['eval_loss']:.4f}" in last and summary["mfu"] > 0
    assert summary["peak_tflops"] > 0 and "kept in" in summary["peak_source"]   # the machine's best, cached
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["2", "4", "latest.txt"]


@pytest.mark.slow
def test_refused_run_leaves_no_folder_but_never_removes_an_existing_one(tmp_path):
    result = train_py("tokens.train_steps=5", cwd=tmp_path)   # warm-up 20 > 5 steps
    assert result.returncode == 2 and "use debug=fast" in result.stderr
    assert os.listdir(tmp_path) == []   # no outputs/<date>/<time>/ with an empty train.log
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    result = train_py("tokens.train_steps=5", f"hydra.run.dir={existing}", cwd=tmp_path)
    assert result.returncode == 2 and (existing / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_missing_local_hf_file_fails_fast_without_the_hub(tmp_path):
    """`data/nope.jsonl` (no ./) is a local path, not a Hub name: one line, no retries."""
    result = train_py("data=hf", "data.hf_dataset_or_datasets=data/nope.jsonl", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == ("nanoexp: data: data.hf_dataset_or_datasets=data/nope.jsonl: "
                                                      "data/nope.jsonl: no such file or folder")
