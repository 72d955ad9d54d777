"""Whole training states to and from torch.distributed.checkpoint (DCP) folders (scripts/convert_to_dcp.py,
scripts/convert_from_dcp.py).

`convert_to_dcp` writes a nanoexp checkpoint of any layout as a DCP folder of one process's full tensors, under
Hugging Face parameter names (nanoexp.interop.hf.hf_name: a Llama's are nanoexp's own, a mixture's Mixtral's):
  model.<name>                               the weights as trained (a µP model's multipliers are not baked in)
  optimizer.state.<name>.<kind>              the optimizer's state per element (AdamW: exp_avg, exp_avg_sq)
  optimizer.state.<name>.step                its update count (a float32 scalar, as torch's AdamW keeps it)
  train_state.step, .consumed_samples, .consumed_tokens, .skipped_steps       int64 scalars
  train_state.stage_consumed_samples.<stage>                                  with data_stages
and `nanoexp.json` beside them: the composed config, the run and the layout the checkpoint was saved on.
The "model" and "optimizer" entries are the form torch.distributed.checkpoint.state_dict gives (parameter groups
aside: they hold no tensors, and DCP would pickle them). Only tensors go in, so torch's `dcp_to_torch_save` and
`torch.load(..., weights_only=True)` read the whole state. The per-rank RNG states stay behind: nanoexp's training
draws from no global generator (data order and initialisation have seeded generators of their own).

`convert_from_dcp` reads such a folder back into a nanoexp checkpoint at its step: one process's, which resumes on
any layout (every rank re-slices it). Reading a DCP folder unpickles its `.metadata` file (torch's
FileSystemReader stores DCP's index with pickle): convert only folders you trust. nanoexp reads a DCP folder only
when `convert_from_dcp` is given one by hand; nothing reads one from a run folder.
"""
from __future__ import annotations

import json
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from nanoexp.checkpoint import CheckpointManager, CheckpointReader, Progress
from nanoexp.checkpoint.load import check_compatible, load_model, load_optimizer, single_process_config, state_kinds
from nanoexp.interop.hf import hf_name
from nanoexp.model.llama import parameter_shapes
from nanoexp.parallel.context import ParallelContext
from nanoexp.runtime.build import build_model
from nanoexp.model.shape import model_shape
from nanoexp.runtime.optim import build_optimizer

META_FILE = "nanoexp.json"
ONE_PROCESS = "torch.distributed is disabled"   # DCP's warning that it runs in one process: the intent here
TRAIN_STATE = ("step", "consumed_samples", "consumed_tokens", "skipped_steps")   # meta.json's keys


def convert_to_dcp(checkpoint: str, out: str) -> None:
    """Write the nanoexp checkpoint folder `checkpoint` (<checkpoints_path>/<step>) as the DCP folder `out`."""
    reader = CheckpointReader(checkpoint)
    meta = reader.meta
    shape = model_shape(single_process_config(meta["config"]))
    check_compatible(reader, shape)
    if os.path.isdir(out) and os.listdir(out):
        raise ValueError(f"{out} is not empty: give a new folder for the DCP checkpoint")
    names, kinds = list(parameter_shapes(shape)), state_kinds(reader)
    steps = torch.tensor(float(meta.get("optimizer_steps", 0)))
    optimizer = {hf_name(name): {**{kind: reader.full_tensor(name, kind) for kind in kinds if reader.has(name, kind)},
                                 "step": steps.clone()}
                 for name in names if any(reader.has(name, kind) for kind in kinds)}
    train_state = {key: torch.tensor(int(meta.get(key, 0))) for key in TRAIN_STATE}
    if meta.get("stage_consumed_samples"):
        train_state["stage_consumed_samples"] = {stage: torch.tensor(int(samples))
                                                 for stage, samples in meta["stage_consumed_samples"].items()}
    state = {"model": {hf_name(name): reader.full_tensor(name) for name in names},
             "optimizer": {"state": optimizer}, "train_state": train_state}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=ONE_PROCESS)
        dcp.save(state, storage_writer=FileSystemWriter(out), no_dist=True)
    with open(os.path.join(out, META_FILE), "w") as f:
        json.dump({"config": meta["config"], "global_batch_size": meta["global_batch_size"], "run": meta.get("run"),
                   "saved_from": {"checkpoint": os.path.abspath(checkpoint), "layout": meta["layout"]}}, f, indent=1)


def read_dcp(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of the DCP folder `folder`, by its flat key ("model.model.norm.weight"). torch's
    FileSystemReader unpickles the folder's `.metadata` (DCP's format): call this only on a folder a person named."""
    reader = FileSystemReader(folder)
    entries = reader.read_metadata().state_dict_metadata
    others = [key for key, entry in entries.items() if not isinstance(entry, TensorStorageMetadata)]
    if others:
        raise ValueError(f"{folder} holds values that are not tensors ({', '.join(others[:3])}), which DCP stores "
                         "pickled: nanoexp reads tensors only")
    state = {key: torch.empty(entry.size, dtype=entry.properties.dtype) for key, entry in entries.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=ONE_PROCESS)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


class FullState:
    """A DCP folder's training state, read as nanoexp's loaders read a checkpoint (CheckpointReader's `meta`,
    `pieces`, `full_shapes`, `full_tensor`): full tensors by (nanoexp parameter name, kind)."""

    def __init__(self, folder: str, tensors: dict[tuple[str, str], torch.Tensor], meta: dict):
        self.folder, self.tensors, self.meta = folder, tensors, meta
        self.pieces = dict.fromkeys(tensors)   # what the loaders ask: which (name, kind) there is

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for (name, kind), t in self.tensors.items() if kind == "param"}

    def full_tensor(self, name: str, kind: str = "param") -> torch.Tensor:
        return self.tensors[name, kind]


def full_state(folder: str) -> FullState:
    """The DCP folder `folder` (as convert_to_dcp writes it) as a FullState; meta.json's fields from its
    nanoexp.json and train_state."""
    info_path = os.path.join(folder, META_FILE)
    if not os.path.isfile(info_path):
        raise ValueError(f"{folder} has no {META_FILE}: give a DCP folder written by scripts/convert_to_dcp.py "
                         "(it holds the config of the model)")
    with open(info_path) as f:
        info = json.load(f)
    flat = read_dcp(folder)
    shape = model_shape(single_process_config(info["config"]))
    tensors, steps = {}, 0
    for name in parameter_shapes(shape):
        prefix = f"optimizer.state.{hf_name(name)}."
        if f"model.{hf_name(name)}" in flat:
            tensors[name, "param"] = flat[f"model.{hf_name(name)}"]
        for key in (key for key in flat if key.startswith(prefix)):
            kind = key[len(prefix):]
            if kind == "step":
                steps = int(flat[key].item())
            else:
                tensors[name, kind] = flat[key]
    stages = "train_state.stage_consumed_samples."
    meta = {key: int(flat[f"train_state.{key}"]) for key in TRAIN_STATE if f"train_state.{key}" in flat}
    meta.update(config=info["config"], run=info.get("run"), optimizer_steps=steps, global_batch_size=info["global_batch_size"],
                stage_consumed_samples={key[len(stages):]: int(v) for key, v in flat.items() if key.startswith(stages)})
    return FullState(folder, tensors, meta)


def convert_from_dcp(folder: str, out: str) -> str:
    """Write the DCP folder `folder` (convert_to_dcp's) as the nanoexp checkpoint `out`/<step>; return its path."""
    if os.path.isdir(out) and os.listdir(out):
        raise ValueError(f"{out} is not empty: give a new folder for the nanoexp checkpoint")
    state = full_state(folder)
    cfg = single_process_config(state.meta["config"])
    cfg.checkpoint.merge_with(dict(checkpoints_path=out, resume="never", resume_checkpoint_path=None))
    ctx = ParallelContext()
    model = build_model(cfg, ctx)
    optimizer = build_optimizer(cfg, model)
    check_compatible(state, model.shape)
    load_model(state, model, ctx)
    load_optimizer(state, model, optimizer, ctx)
    meta = state.meta
    step = meta.get("step", 0)
    progress = Progress(meta.get("consumed_samples", 0), meta.get("consumed_tokens", 0), meta.get("skipped_steps", 0),
                        meta["stage_consumed_samples"])
    manager = CheckpointManager(cfg, ctx, out)
    manager.run_id = (meta.get("run") or {}).get("id") or manager.run_id   # the same training goes on
    manager.save(step, model, optimizer, progress, wait=True)
    return os.path.join(out, str(step))
