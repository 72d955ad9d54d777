"""torch.distributed.checkpoint (DCP) folders: torch's own reader reads what nanoexp writes, with Hugging Face's
parameter names, and a checkpoint taken to DCP and back resumes with the original run's losses, bit for bit."""
import dataclasses
import json
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import Metadata

from nanoexp.checkpoint import CheckpointReader
from nanoexp.config import ConfigError
from nanoexp.interop.dcp import MetadataReader, MetadataUnpickler, convert_from_dcp, convert_to_dcp, read_dcp
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
    (tmp_path / "pickled" / "nanoexp.json").write_text('{"config": {}, "global_batch_size": 8}')
    with pytest.raises(ValueError, match=r"holds values that are not tensors \(extra.lr\)"):
        convert_from_dcp(str(tmp_path / "pickled"), str(tmp_path / "out"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "something").write_text("")
    with pytest.raises(ValueError, match="is not empty"):
        convert_from_dcp(str(tmp_path / "bare"), str(tmp_path / "full"))


# -- the index reader: every folder torch writes, no crafted one ---------------------------------------------------
def assert_read_as_torch_reads(folder) -> None:
    """The restricted unpickler gives the index torch's own pickle.load gives (the dataclasses compare by value)."""
    with open(folder / ".metadata", "rb") as f:
        torchs = pickle.load(f)   # noqa: S301 - a folder this test wrote, as reference
    with open(folder / ".metadata", "rb") as f:
        assert MetadataUnpickler(f).load() == torchs
    assert MetadataReader(str(folder)).read_metadata().state_dict_metadata == torchs.state_dict_metadata


def torch_writes() -> dict[str, dict]:
    """States as torch users save them in one process: every dtype DCP stores, odd shapes and strides, nested
    dicts with values that are not tensors (which DCP pickles beside the tensors)."""
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int32,
              torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]
    return {"dtypes": {str(d): torch.arange(6).reshape(2, 3).to(d) for d in dtypes},
            "shapes": {"scalar": torch.tensor(3), "empty": torch.zeros(0), "transposed": torch.zeros(4, 3).t(),
                       "channels_last": torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)},
            "values": {"model": {"w": torch.ones(2)}, "lr": 0.1, "name": "run", "steps": [1, 2], "nested": {"a": 1}}}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_index_reader_reads_every_folder_torch_writes_in_one_process(tmp_path):
    """DCP's .metadata is read with MetadataUnpickler (an allow-list of DCP's classes) as torch reads it, for every
    dtype, shape and nesting; the tensors of a folder of tensors come back equal."""
    for name, state in torch_writes().items():
        dcp.save(state, checkpoint_id=tmp_path / name, no_dist=True)
        assert_read_as_torch_reads(tmp_path / name)
    flat = read_dcp(str(tmp_path / "dtypes"))
    for name, tensor in torch_writes()["dtypes"].items():
        assert flat[name].dtype == tensor.dtype and torch.equal(flat[name].view(torch.uint8), tensor.view(torch.uint8))


def save_sharded(rank: int, world_size: int, folder: str) -> None:
    """Two ranks save DTensor shards (and a replicated bf16 tensor) and an FSDP2 model with its AdamW state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world_size,))
    dcp.save({"w": distribute_tensor(torch.arange(24.0).reshape(6, 4), mesh, [Shard(0)]),
              "r": distribute_tensor(torch.ones(3, dtype=torch.bfloat16), mesh, [Replicate()]), "step": 3},
             checkpoint_id=f"{folder}/dtensor")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=f"{folder}/fsdp2")


def test_the_index_reader_reads_sharded_folders_of_two_ranks(tmp_path):
    from tests.distributed import run_distributed
    run_distributed(save_sharded, 2, str(tmp_path))
    for name in ("dtensor", "fsdp2"):
        assert_read_as_torch_reads(tmp_path / name)


class Crafted:
    """A pickle that calls `function(*args)` when loaded: what a crafted .metadata holds."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_crafted_index_is_refused_naming_the_class_and_never_runs(tmp_path):
    """A .metadata naming os.system, builtins.exec or subprocess.Popen (alone, or inside a real index) is refused
    in one line naming it, before the call; the marker file it would write never appears."""
    marker = tmp_path / "ran"
    index = torch_index(tmp_path / "real")
    payloads = {f"{os.system.__module__}.system": Crafted(os.system, f"touch {marker}"),
                "builtins.exec": Crafted(exec, f"open({str(marker)!r}, 'w')"),
                "subprocess.Popen": Crafted(subprocess.Popen, ["touch", str(marker)])}
    for name, payload in payloads.items():
        inside = Metadata(index.state_dict_metadata, payload, index.storage_data)   # as its planner data
        for where, value in (("alone", payload), ("inside", inside)):
            folder = tmp_path / f"{name}-{where}"
            folder.mkdir()
            (folder / ".metadata").write_bytes(pickle.dumps(value))
            with pytest.raises(ConfigError) as error:
                read_dcp(str(folder))
            assert str(error.value) == (f"{folder}/.metadata: it names {name}, which DCP's index never holds (a "
                                        "crafted or foreign file): refused, nothing of it ran")
            assert not marker.exists()


def torch_index(folder):
    """The index of a one-tensor folder that torch wrote."""
    dcp.save({"w": torch.ones(3)}, checkpoint_id=folder, no_dist=True)
    with open(folder / ".metadata", "rb") as f:
        return pickle.load(f)   # noqa: S301 - the folder this test wrote


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_index_whose_data_files_are_not_the_folders_is_refused(tmp_path):
    """A data file outside the folder (a crafted path), missing, or shorter than the index reads: one line naming
    the file, nothing read."""
    index = torch_index(tmp_path / "real")
    [(key, info)] = index.storage_data.items()
    data_file = tmp_path / "real" / info.relative_path
    cases = {"outside": (dataclasses.replace(info, relative_path="../real/" + info.relative_path),
                         "names a data file outside its folder ('../real/"),
             "missing": (info, f"missing {tmp_path}/missing/{info.relative_path}: {tmp_path}/missing/.metadata "
                               "lists it"),
             "truncated": (info, f"truncated {tmp_path}/truncated/{info.relative_path}: 10 bytes, ")}
    for name, (entry, message) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / ".metadata").write_bytes(pickle.dumps(Metadata(index.state_dict_metadata, {}, {key: entry})))
        if name == "truncated":
            (folder / info.relative_path).write_bytes(data_file.read_bytes()[:10])
        with pytest.raises(ConfigError, match=re.escape(message)):
            read_dcp(str(folder))
