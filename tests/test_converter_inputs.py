"""The converters' bad inputs (scripts/convert_{to,from}_{dcp,hf}.py): each ends in one line naming the file or
folder, exit 2, no traceback, and nothing is written or overwritten (nanoexp.failures.run_tool ends them)."""
import os
import shutil
import subprocess
import sys

import pytest

from nanoexp.failures import run_tool
from nanoexp.interop.dcp import convert_from_dcp, convert_to_dcp
from nanoexp.interop.hf_checkpoint import convert_from_hf, convert_to_hf
from tests.helpers import FAST, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONVERTERS = {"convert_to_dcp.py": convert_to_dcp, "convert_from_dcp.py": convert_from_dcp,
              "convert_to_hf.py": convert_to_hf,
              "convert_from_hf.py": lambda source, out: convert_from_hf(source, out, [])}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A run with its checkpoint, a copy of it with a truncated shard, a DCP folder, and a folder that is not empty."""
    root = tmp_path_factory.mktemp("converters")
    train(root / "run", FAST + ["tokens.train_steps=1", "tokens.val_check_interval=0",
                                "optimizer.learning_rate_scheduler.lr_warmup_steps=0"])
    checkpoint = root / "run" / "checkpoints" / "1"
    shutil.copytree(checkpoint, root / "truncated")
    os.truncate(root / "truncated" / "rank_00000.safetensors", 1000)
    convert_to_dcp(str(checkpoint), str(root / "dcp"))
    (root / "full").mkdir()
    (root / "full" / "keep").write_text("mine")
    return root


def cases(root) -> list[tuple[str, str, str, str]]:
    """(tool, input, output, the one line it must print)."""
    checkpoint, run = root / "run" / "checkpoints" / "1", root / "run"
    shard = root / "truncated" / "rank_00000.safetensors"
    return [
        ("convert_to_dcp.py", run, root / "out",
         f"{run} is not a complete nanoexp checkpoint: {run}/meta.json is missing"),
        ("convert_to_dcp.py", root / "truncated", root / "out",
         f"truncated or mismatched shard {shard}: 1000 bytes, expected {os.path.getsize(checkpoint / shard.name)}"),
        ("convert_to_dcp.py", checkpoint, root / "full",
         f"{root}/full is not empty: give a new folder for the DCP checkpoint"),
        ("convert_from_dcp.py", root / "dcp", root / "full",
         f"{root}/full is not empty: give a new folder for the nanoexp checkpoint"),
        ("convert_from_dcp.py", run, root / "out", f"{run} has no nanoexp.json: give a DCP folder written by "
         "scripts/convert_to_dcp.py (it holds the config of the model)"),
        ("convert_to_hf.py", checkpoint, root / "full",
         f"{root}/full is not empty: give a new folder for the Hugging Face model"),
        ("convert_from_hf.py", run, root / "out",
         f"{run} is not a Hugging Face model folder: {run}/config.json is missing"),
    ]


def assert_nothing_written(root) -> None:
    assert not (root / "out").exists() and os.listdir(root / "full") == ["keep"]
    assert (root / "full" / "keep").read_text() == "mine"


def test_each_bad_input_ends_in_one_line_and_writes_nothing(folders, capsys):
    for tool, source, out, line in cases(folders):
        code = run_tool(tool, lambda: CONVERTERS[tool](str(source), str(out)))
        assert (code, capsys.readouterr().err) == (2, f"{tool}: {line}\n"), (tool, source, out)
        assert_nothing_written(folders)


@pytest.mark.slow
def test_the_scripts_end_the_same_way(folders):
    """Each script, as a user runs it: the same one line on stderr, exit 2, no traceback."""
    for tool, source, out, line in cases(folders):
        done = subprocess.run([sys.executable, f"scripts/{tool}", str(source), str(out)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert (done.returncode, done.stderr) == (2, f"{tool}: {line}\n"), (tool, done.stderr[-3000:])
        assert_nothing_written(folders)
