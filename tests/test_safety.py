"""Safe by default: nothing unpickled, W&B off and its key never written, no writes outside the run."""
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def python_sources():
    for folder in ("nanoexp", "scripts", "benchmarks"):
        yield from (ROOT / folder).rglob("*.py")
    yield ROOT / "train.py"


# torch's flight recorder hands its records over as pickle bytes made in the same process: decoded there, and
# written for torch's analyzer; nanoexp reads the JSON copies (nanoexp/observe/flight_recorder.py).
DECODES_TORCHS_OWN_BYTES = ROOT / "nanoexp" / "observe" / "flight_recorder.py"


def test_no_unpickling_anywhere():
    """Checkpoints and data are read with safetensors, JSON, numpy memmaps or weights_only loads."""
    assert "pickle.loads(_raw_trace(" in DECODES_TORCHS_OWN_BYTES.read_text()   # its one decode: torch's bytes
    for path in python_sources():
        text = path.read_text()
        assert "pickle.load(" not in text and "Unpickler" not in text, path   # no file is ever unpickled
        if path != DECODES_TORCHS_OWN_BYTES:
            assert "import pickle" not in text and "pickle.loads" not in text, path
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, (path, call)
        for call in re.findall(r"np\.load\([^)]*\)", text):
            assert "allow_pickle=True" not in call, (path, call)


def test_wandb_is_off_by_default_and_its_key_never_lands_in_the_run(tmp_path):
    secret = "0123456789abcdef-not-a-real-key"
    run_dir = tmp_path / "run"
    before = {p for p in ROOT.rglob("*") if "__pycache__" not in p.parts and ".git" not in p.parts}
    env = dict(os.environ, WANDB_API_KEY=secret)
    proc = subprocess.run(
        [sys.executable, "train.py", "tokens.train_steps=3", "tokens.val_check_interval=0",
         "optimizer.learning_rate_scheduler.lr_warmup_steps=1", "model.model_config.num_hidden_layers=2",
         "tokens.global_batch_size=8", "tokens.limit_val_batches=1", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert written and not (run_dir / "wandb").exists()          # disabled: no W&B files at all
    for path in written:
        assert secret.encode() not in path.read_bytes(), path
    # Nothing new in the repository: the run wrote only into its run folder.
    after = {p for p in ROOT.rglob("*") if "__pycache__" not in p.parts and ".git" not in p.parts}
    assert not {p for p in after - before if ".pytest_cache" not in p.parts}
