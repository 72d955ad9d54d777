"""Denormals flushed to zero on a CPU (model.flush_denormals, nanoexp/numerics/precision.py): on every thread of
every process of a run, said in the start-up facts, and the process's own mode back after the run."""
import json
import os
import subprocess
import sys

from nanoexp.numerics.precision import flushing_now
from nanoexp.runtime.trainer import Trainer
from tests.helpers import FAST, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# In a process of its own, which a parallel op on two threads leaves with two OpenMP threads (a process forked
# after that hangs a child that uses several, GNU libgomp). 1e-30 x 1e-10 is a float32 denormal; an
# op on 2^20 elements runs on both threads, half each.
EVERY_THREAD = """
import torch
from nanoexp.numerics.precision import set_flush_denormal_everywhere
torch.set_num_threads(2)
x = torch.full((1 << 20,), 1e-30)
kept = lambda: (x * 1e-10 != 0).float().mean().item()
before = kept()
torch.set_flush_denormal(True)
main_thread_only = kept()
set_flush_denormal_everywhere(True)
flushed = kept()
set_flush_denormal_everywhere(False)
print(before, main_thread_only, flushed, kept())
"""


def test_flushing_reaches_every_openmp_thread():
    """torch.set_flush_denormal sets its calling thread's mode only: half of a parallel op keeps its denormals;
    set_flush_denormal_everywhere reaches both threads, and back."""
    out = subprocess.run([sys.executable, "-c", EVERY_THREAD], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert [float(v) for v in out.split()] == [1.0, 0.5, 0.0, 1.0]


def test_every_process_of_a_run_flushes_and_the_caller_gets_its_mode_back(tmp_path, monkeypatch):
    """On one process and on dp2 (forked workers) each rank trains with denormals flushed (seen from inside its
    loop); the facts and summary.json say so; model.flush_denormals=false keeps them; the test process, which ran
    the one-process runs, flushes nothing after them."""
    train_loop = Trainer.train

    def recording(self):
        (tmp_path / f"{self.run_dir.rsplit('/', 1)[-1]}_rank{self.ctx.rank}").write_text(str(flushing_now()))
        return train_loop(self)

    monkeypatch.setattr(Trainer, "train", recording)   # forked workers inherit it
    steps = FAST + ["tokens.train_steps=1", "tokens.val_check_interval=0",
                    "optimizer.learning_rate_scheduler.lr_warmup_steps=0"]
    for name, overrides in {"one": [], "dp2": ["parallelism=dp2tp1pp1"], "off": ["model.flush_denormals=false"]}.items():
        train(tmp_path / name, steps + overrides)
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["denormals_flushed"] == (name != "off")
        log = (tmp_path / name / "logs" / "rank_0.log").read_text()
        assert ("denormals flushed to zero (model.flush_denormals)" in log) == (name != "off")
    seen = {path.name: path.read_text() for path in tmp_path.iterdir() if "_rank" in path.name}
    assert seen == {"one_rank0": "True", "dp2_rank0": "True", "dp2_rank1": "True", "off_rank0": "False"}
    assert not flushing_now()
