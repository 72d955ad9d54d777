"""torch.distributed.checkpoint (DCP) folders: torch's own reader reads what nanoexp writes, with Hugging Face's
parameter names, and a checkpoint taken to DCP and back resumes with the original run's losses, bit for bit."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from nanoexp.checkpoint import CheckpointReader
from nanoexp.interop.dcp import convert_from_dcp, convert_to_dcp
from nanoexp.interop.hf import hf_config
from nanoexp.model.shape import model_shape
from tests.helpers import FAST, compose_config, require, tiered, train, train_losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONSTANT_LR = FAST + ["tokens.val_check_interval=0", "optimizer.learning_rate_scheduler.learning_rate=1e-3",
                      "optimizer.learning_rate_scheduler.lr_warmup_steps=0",
                      "optimizer.learning_rate_scheduler.lr_decay_style=constant"]
RUN = CONSTANT_LR + ["tokens.train_steps=4", "checkpoint.checkpoint_interval=2"]
LAYOUTS = {"one process": [], "dp2-zero3": ["parallelism=dp2tp1pp1", "optimizer.zero_stage=3"],
           "tp2pp2": ["parallelism=dp1tp2pp2"]}


def test_torchs_own_reader_reads_the_whole_training_state_under_hugging_face_names(tmp_path):
    """Saved on dp2 with ZeRO-1 (moments in flat pieces on two ranks), converted, read by torch's
    dcp_to_torch_save and a weights-only torch.load: the full weights and moments, transformers' names, the step
    and the data position."""
    transformers = require("transformers")
    train(tmp_path / "run", CONSTANT_LR + ["tokens.train_steps=2", "parallelism=dp2tp1pp1", "optimizer.zero_stage=1"])
    checkpoint = tmp_path / "run" / "checkpoints" / "2"
    convert_to_dcp(str(checkpoint), str(tmp_path / "dcp"))
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    reader = CheckpointReader(str(checkpoint))
    assert sorted(state) == ["model", "optimizer", "train_state"]
    cfg = compose_config(CONSTANT_LR)
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(model_shape(cfg), 256)))
    assert set(state["model"]) == set(hf_model.state_dict())
    for name, tensor in state["model"].items():
        assert torch.equal(tensor, reader.full_tensor(name)), name
        moments = state["optimizer"]["state"][name]
        assert torch.equal(moments["exp_avg"], reader.full_tensor(name, "exp_avg"))
        assert torch.equal(moments["exp_avg_sq"], reader.full_tensor(name, "exp_avg_sq"))
        assert moments["step"].item() == 2.0
    assert {key: value.item() for key, value in state["train_state"].items()} == {
        "step": 2, "consumed_samples": 16, "consumed_tokens": 16 * 32, "skipped_steps": 0}
    info = json.loads((tmp_path / "dcp" / "nanoexp.json").read_text())
    assert info["saved_from"]["layout"]["zero_stage"] == 1 and info["run"] == reader.meta["run"]


@pytest.mark.parametrize("layout", tiered(LAYOUTS, quick=["one process"]))
def test_a_round_trip_through_dcp_resumes_with_the_original_losses(layout, tmp_path):
    """Checkpoint 2 of a run on `layout`, to DCP and back (on the parallel layouts through the scripts, as a user
    runs them), resumes on the same layout (re-sliced from one process's checkpoint) and trains steps 3-4 bit for
    bit as the run did."""
    run = RUN + LAYOUTS[layout]
    original = train_losses(train(tmp_path / "run", run))
    steps = ((convert_to_dcp, "convert_to_dcp.py", tmp_path / "run" / "checkpoints" / "2", tmp_path / "dcp"),
             (convert_from_dcp, "convert_from_dcp.py", tmp_path / "dcp", tmp_path / "back"))
    for convert, script, source, out in steps:
        if layout == "one process":   # in this process: the quick tier's case
            convert(str(source), str(out))
            continue
        done = subprocess.run([sys.executable, f"scripts/{script}", str(source), str(out)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    back = CheckpointReader(str(tmp_path / "back" / "2"))
    assert back.meta["consumed_samples"] == 16 and back.meta["optimizer_steps"] == 2
    resumed = train(tmp_path / "resumed", run + [f"checkpoint.resume_checkpoint_path={tmp_path}/back/2"])
    assert train_losses(resumed) == original[2:]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # dcp.save in one process, as meant
def test_what_convert_from_dcp_refuses(tmp_path):
    """A DCP folder without nanoexp.json (no config), one holding values other than tensors (DCP pickles them),
    and an output folder that is not empty."""
    dcp.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=tmp_path / "bare", no_dist=True)
    with pytest.raises(ValueError, match="has no nanoexp.json"):
        convert_from_dcp(str(tmp_path / "bare"), str(tmp_path / "out"))
    dcp.save({"model": {"w": torch.zeros(2)}, "extra": {"lr": 0.1}}, checkpoint_id=tmp_path / "pickled", no_dist=True)
    (tmp_path / "pickled" / "nanoexp.json").write_text("{}")
    with pytest.raises(ValueError, match=r"holds values that are not tensors \(extra.lr\)"):
        convert_from_dcp(str(tmp_path / "pickled"), str(tmp_path / "out"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "something").write_text("")
    with pytest.raises(ValueError, match="is not empty"):
        convert_from_dcp(str(tmp_path / "bare"), str(tmp_path / "full"))
