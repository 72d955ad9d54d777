"""What is checked about checkpoints before any work, and how a resume picks its checkpoint: a checkpoint loads
only into the model it came from (unless checkpoint.load_strict=false), a damaged one is named by its file, the
checkpoints folder must be a writable folder with room for one, a failed save is a CheckpointError, and a resume
reads latest.txt once."""
import json
import os
import shutil
from collections import namedtuple

import pytest
import torch

import nanoexp.checkpoint.manager as manager_module
from nanoexp.checkpoint import CheckpointError, CheckpointManager, CheckpointReader
from nanoexp.config import ConfigError
from nanoexp.launch.workers import setup_device
from nanoexp.runtime.build import build_model
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from tests.helpers import FAST, compose_config, read_metrics, train

RUN = FAST + ["tokens.val_check_interval=0", "tokens.train_steps=2"]


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    root = tmp_path_factory.mktemp("four_layers")
    train(root, RUN)
    return root / "checkpoints" / "2"


@pytest.fixture(scope="module")
def moe_with_a_shared_expert(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    train(root, RUN + ["model=moe_tiny"])
    return root / "checkpoints" / "2"


@pytest.mark.parametrize("change, message", [
    (["model.model_config.num_hidden_layers=2"], "parameter model.layers.2.input_layernorm.weight is not in this "
     "model (model.model_config.num_hidden_layers is 4 in the checkpoint, 2 here)"),
    (["model.model_config.num_hidden_layers=6"], "parameter model.layers.4.input_layernorm.weight is missing "
     "(model.model_config.num_hidden_layers is 4 in the checkpoint, 6 here)"),
    (["model.model_config.intermediate_size=64"], "model.layers.0.mlp.gate_proj.weight has shape (128, 64), the "
     "model expects (64, 64) (model.model_config.intermediate_size is 128 in the checkpoint, 64 here)"),
])
def test_a_checkpoint_of_another_shape_is_refused_at_start(four_layers, tmp_path, change, message):
    with pytest.raises(ConfigError) as error:
        train(tmp_path, RUN + change + [f"checkpoint.resume_checkpoint_path={four_layers}"])
    assert message in str(error.value) and "checkpoint.load_strict=false" in str(error.value)
    assert not (tmp_path / "metrics.jsonl").exists()   # refused before any step


def test_a_moe_checkpoint_without_its_shared_expert_is_refused(moe_with_a_shared_expert, tmp_path):
    with pytest.raises(ConfigError, match=r"shared_experts?\..* is not in this model \(model\.moe\.num_shared_experts "
                                          r"is 1 in the checkpoint, 0 here\)"):
        train(tmp_path, RUN + ["model=moe_tiny", "model.moe.num_shared_experts=0",
                               f"checkpoint.resume_checkpoint_path={moe_with_a_shared_expert}"])


def loaded_model(cfg, folder):
    """One process's model with `folder` restored into it, as the trainer restores it."""
    ctx = ParallelContext(Layout.from_config(cfg), setup_device(0, 1))
    model = build_model(cfg, ctx)
    optimizer = torch.optim.AdamW(model.parameters())
    CheckpointManager(cfg, ctx, str(folder.parent.parent)).restore(model, optimizer)
    return model, optimizer


@pytest.mark.parametrize("layers", [2, 6])
def test_load_strict_false_loads_the_parameters_both_have(four_layers, tmp_path, layers):
    """Fewer layers: the first two load, the checkpoint's others are dropped; more layers: the first four load,
    the new ones keep their initial values (and start with fresh optimizer state). Then training goes on."""
    overrides = RUN + [f"model.model_config.num_hidden_layers={layers}", "checkpoint.load_strict=false",
                       f"checkpoint.resume_checkpoint_path={four_layers}"]
    cfg = compose_config(overrides)
    model, optimizer = loaded_model(cfg, four_layers)
    fresh = build_model(cfg, ParallelContext(Layout.from_config(cfg), setup_device(0, 1)))
    reader = CheckpointReader(str(four_layers))
    for (name, param), (_, initial) in zip(model.named_parameters(), fresh.named_parameters()):
        expected = reader.full_tensor(name) if reader.has(name, "param") else initial
        assert torch.equal(param.detach(), expected), name
        assert (param in optimizer.state) == reader.has(name, "param"), name
    records = train(tmp_path, overrides + ["tokens.train_steps=3"])
    assert [r["step"] for r in records if "loss" in r] == [3]


@pytest.mark.parametrize("damage, message", [
    (lambda folder: (folder / "meta.json").write_text((folder / "meta.json").read_text()[:200]),
     "damaged {folder}/meta.json: not valid JSON"),
    (lambda folder: (folder / "meta.json").write_text(json.dumps({"format_version": 1, "step": 2})),
     "damaged {folder}/meta.json: it lacks files, index, config"),
    (lambda folder: (folder / "rank_00000.safetensors").write_bytes(b"\0" * 10),
     "truncated or mismatched shard {folder}/rank_00000.safetensors: 10 bytes"),
    (lambda folder: (folder / "rank_00000.safetensors").unlink(), "missing shard {folder}/rank_00000.safetensors"),
], ids=["truncated-meta", "meta-without-keys", "short-shard", "missing-shard"])
def test_a_damaged_checkpoint_is_named_before_any_work(four_layers, tmp_path, damage, message):
    folder = tmp_path / "ckpt"
    shutil.copytree(four_layers, folder)
    damage(folder)
    with pytest.raises(ConfigError, match="checkpoint: ") as error:
        train(tmp_path / "run", RUN + [f"checkpoint.resume_checkpoint_path={folder}"])
    assert message.format(folder=folder) in str(error.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_unusable_checkpoints_folder_is_named_before_any_work(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("")
    for path, message in [(tmp_path / "a_file", "is a file, not a folder"),
                          (tmp_path / "a_file" / "below", f"{tmp_path / 'a_file'} is a file, not a folder"),
                          ("/proc/nanoexp-checkpoints", "cannot write into /proc")]:
        with pytest.raises(ConfigError, match=f"checkpoint.checkpoints_path={path}: .*{message}"):
            train(tmp_path / "run", RUN + [f"checkpoint.checkpoints_path={path}"])
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(manager_module.shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 2**20, 2**20))
    with pytest.raises(ConfigError, match=r"0\.00 GiB free on its file system, one checkpoint of this model takes "
                                          r"about 0\.00 GiB"):
        train(tmp_path / "run", RUN)   # 188,992 parameters x 12 bytes = 2.2 MB > 1 MB free
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_save_that_cannot_make_its_folder_is_a_checkpoint_error(tmp_path):
    """The first save finds a file where its temporary folder goes: a CheckpointError naming the checkpoint, not a
    raw traceback, and the run's summary says failed."""
    (tmp_path / "checkpoints").mkdir(parents=True)
    (tmp_path / "checkpoints" / ".tmp-2").write_text("in the way")
    with pytest.raises(CheckpointError, match=r"could not save checkpoint .*checkpoints/2 .*FileExistsError"):
        train(tmp_path, RUN)
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


def test_a_resume_reads_latest_txt_once(tmp_path):
    """Step, data position and weights come from the checkpoint latest.txt named when the run started, even if the
    file changes afterwards."""
    train(tmp_path, RUN + ["tokens.train_steps=4", "checkpoint.checkpoint_interval=2"])
    cfg = compose_config(RUN + ["tokens.train_steps=6"])
    ctx = ParallelContext(Layout.from_config(cfg), setup_device(0, 1))
    manager = CheckpointManager(cfg, ctx, str(tmp_path))
    (tmp_path / "checkpoints" / "latest.txt").write_text("2\n")
    assert manager.where_to_start().step == 4
    model = build_model(cfg, ctx)
    manager.restore(model, torch.optim.AdamW(model.parameters()))
    reader = CheckpointReader(str(tmp_path / "checkpoints" / "4"))
    assert torch.equal(model.model.norm.weight.detach(), reader.full_tensor("model.norm.weight"))
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [1, 2, 3, 4]


def rewrite_shard(folder, change) -> None:
    """Apply `change` to the tensors of rank 0's shard of `folder` and record the new file in meta.json (size and
    CRC-32), as a tool that rewrote the checkpoint would."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from nanoexp.checkpoint.load import file_crc32
    shard = folder / "rank_00000.safetensors"
    with safe_open(str(shard), "pt") as handle:
        tensors, metadata = {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()
    save_file(change(tensors), str(shard), metadata=metadata)
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"]["rank_00000.safetensors"].update(bytes=os.path.getsize(shard), crc32=file_crc32(str(shard)))
    (folder / "meta.json").write_text(json.dumps(meta))


def test_a_piece_stored_in_another_shape_is_refused_naming_the_parameter(four_layers, tmp_path):
    """A matrix stored transposed (as many elements, another shape) is refused by its header before any work, and
    by the reader; a ZeRO piece stored flat still loads (tests/test_zero.py resumes them)."""
    folder = tmp_path / "ckpt"
    shutil.copytree(four_layers, folder)
    name = "model.layers.0.mlp.gate_proj.weight"   # (intermediate 128, hidden 64)
    rewrite_shard(folder, lambda tensors: {**tensors, name: tensors[name].t().contiguous()})
    said = f"mismatched shard {folder}/rank_00000.safetensors: the param of parameter {name} has shape [64, 128], " \
           "meta.json records [128, 64]"
    with pytest.raises(ConfigError) as error:
        train(tmp_path / "run", RUN + ["tokens.train_steps=3", f"checkpoint.resume_checkpoint_path={folder}"])
    assert said in str(error.value) and not (tmp_path / "run" / "metrics.jsonl").exists()
    with pytest.raises(CheckpointError, match=said.replace("[", r"\[").replace("]", r"\]")):
        CheckpointReader(str(folder)).full_tensor(name)


def test_a_slice_of_another_shape_than_the_models_parameter_is_refused(four_layers):
    """Loading into a model whose parameter has another shape names it (torch's copy_ would broadcast some shapes
    without a word); start-up refuses such a checkpoint earlier (check_compatible)."""
    from nanoexp.checkpoint.load import load_model
    cfg = compose_config(RUN + ["model.model_config.intermediate_size=64"])
    ctx = ParallelContext(Layout.from_config(cfg), setup_device(0, 1))
    with pytest.raises(CheckpointError, match=r"param of parameter model\.layers\.0\.mlp\.gate_proj\.weight gives "
                                              r"this rank shape \(128, 64\), the model holds \(64, 64\)"):
        load_model(CheckpointReader(str(four_layers)), build_model(cfg, ctx), ctx)


def test_latest_txt_holds_a_step_number(tmp_path):
    """`04` in latest.txt is step 4 (its folder is `4`); a folder named `04` is not a checkpoint."""
    from nanoexp.checkpoint.manager import latest_checkpoint
    for folder in ("4", "04"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "meta.json").write_text("{}")
    (tmp_path / "latest.txt").write_text("04\n")
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "4")
    (tmp_path / "latest.txt").write_text("4\n")
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "4")
    shutil.rmtree(tmp_path / "4")
    (tmp_path / "latest.txt").write_text("04\n")
    with pytest.raises(CheckpointError, match=r"names '04', which is not a complete checkpoint .*\(complete steps: "
                                              r"none\)"):
        latest_checkpoint(str(tmp_path))
