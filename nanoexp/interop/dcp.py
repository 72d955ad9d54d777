"""Whole training states to and from torch.distributed.checkpoint (DCP) folders (scripts/convert_to_dcp.py,
scripts/convert_from_dcp.py).

`convert_to_dcp` writes a nanoexp checkpoint of any layout as a DCP folder of one process's full tensors, under
Hugging Face parameter names (a Llama's are nanoexp's own, a mixture's Mixtral's), in the form
torch.distributed.checkpoint.state_dict gives ("model", "optimizer"; parameter groups aside: they hold no tensors,
and DCP would pickle them). Only tensors go in, so torch's `dcp_to_torch_save` and `torch.load(...,
weights_only=True)` read the whole state. The per-rank RNG states stay behind: nanoexp's training draws from no
global generator. `convert_from_dcp` reads such a folder back into a nanoexp checkpoint at its step (one
process's, which resumes on any layout). DCP stores its index, `.metadata`, as a pickle (torch's FileSystemReader
unpickles it whole; torch 2.13 offers no safe reader): nanoexp reads it with `MetadataUnpickler`, which admits only
the classes DCP's index is made of, before anything of it runs; the tensors come through torch's weights-only
loads, and values that are not tensors (pickled by DCP) are refused.
"""
from __future__ import annotations

import json
import os
import pickle
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from nanoexp.checkpoint import CheckpointManager, Progress
from nanoexp.checkpoint.load import (check_compatible, checked_input, load_model, load_optimizer, single_process_config,
                                     state_kinds)
from nanoexp.config import ConfigError
from nanoexp.interop import check_output_folder
from nanoexp.interop.hf import hf_name
from nanoexp.model.llama import parameter_shapes
from nanoexp.parallel.context import ParallelContext
from nanoexp.runtime.build import build_model
from nanoexp.model.shape import model_shape
from nanoexp.runtime.optim import build_optimizer

META_FILE = "nanoexp.json"
ONE_PROCESS = "torch.distributed is disabled"   # DCP's warning that it runs in one process: the intent here
TRAIN_STATE = ("step", "consumed_samples", "consumed_tokens", "skipped_steps")   # meta.json's keys
INDEX_FILE = ".metadata"   # DCP's index of the folder (a pickle)
# What torch's FileSystemWriter pickles into .metadata (read from torch 2.13's own writes: one process, DTensor
# shards on 2 ranks, FSDP2 model and optimizer state, every dtype): DCP's index dataclasses, torch.Size, the dtypes
# (torch.<dtype>), the layout by name (torch.serialization._get_layout) and the checkpoint id as a path.
METADATA_CLASSES = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    *((module, name) for module in ("pathlib", "pathlib._local")   # pathlib._local: Python 3.13's home of the paths
      for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"))}


def convert_to_dcp(checkpoint: str, out: str) -> None:
    """Write the nanoexp checkpoint folder `checkpoint` (<checkpoints_path>/<step>) as the DCP folder `out`, one
    process's full tensors under Hugging Face parameter names (interop.hf.hf_name):
      model.<name>                               the weights as trained (a µP model's multipliers are not baked in)
      optimizer.state.<name>.<kind>              the optimizer's state per element (AdamW: exp_avg, exp_avg_sq)
      optimizer.state.<name>.step                its update count (a float32 scalar, as torch's AdamW keeps it)
      train_state.step, .consumed_samples, .consumed_tokens, .skipped_steps       int64 scalars
      train_state.stage_consumed_samples.<stage>                                  with data_stages
    and `nanoexp.json` beside them: the composed config, the run and the layout the checkpoint was saved on."""
    check_output_folder(out, "the DCP checkpoint")
    reader = checked_input(checkpoint)
    meta = reader.meta
    shape = model_shape(single_process_config(meta["config"]))
    check_compatible(reader, shape)
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


class ForeignClass(pickle.UnpicklingError):
    """A class or function that DCP's index never holds, named by the file being unpickled."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's index admitting only METADATA_CLASSES and torch's dtypes: any other class or function a
    file names (os.system, builtins.eval, ...) is refused before it is called."""

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in METADATA_CLASSES or dtype:
            return super().find_class(module, name)
        raise ForeignClass(f"it names {module}.{name}, which DCP's index never holds (a crafted or foreign file): "
                           "refused, nothing of it ran")


class MetadataReader(FileSystemReader):
    """torch's FileSystemReader of a DCP folder, its index read by MetadataUnpickler instead of pickle.load."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = os.path.join(self.path, INDEX_FILE)
        if not os.path.isfile(path):
            raise ConfigError(f"{path} is missing: {self.path} is not a torch.distributed.checkpoint folder")
        try:
            with open(path, "rb") as f:
                metadata = MetadataUnpickler(f).load()
        except ForeignClass as error:
            raise ConfigError(f"{path}: {error}") from None
        except Exception as error:   # noqa: BLE001 - a truncated or foreign file: one line naming it
            raise ConfigError(f"{path}: unreadable as DCP's index ({type(error).__name__}: {error})") from None
        if not isinstance(metadata, Metadata):
            raise ConfigError(f"{path}: holds a {type(metadata).__name__}, not DCP's index")
        check_data_files(str(self.path), metadata)
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_data_files(folder: str, metadata: Metadata) -> None:
    """Every data file DCP's index lists is a file of `folder` (no other path is read) and holds the bytes the
    index gives it: a ConfigError naming the file otherwise."""
    needed = {}
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise ConfigError(f"{folder}/{INDEX_FILE}: names a data file outside its folder ({name!r}): not read")
        needed[name] = max(needed.get(name, 0), info.offset + info.length)
    for name, size in needed.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise ConfigError(f"missing {path}: {folder}/{INDEX_FILE} lists it")
        if os.path.getsize(path) < size:
            raise ConfigError(f"truncated {path}: {os.path.getsize(path)} bytes, {folder}/{INDEX_FILE} reads "
                              f"{size} of it")


def read_dcp(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of the DCP folder `folder`, by its flat key ("model.model.norm.weight"): its index through
    MetadataReader, its tensors through torch's weights-only loads. A ConfigError naming the file for a folder that
    is not DCP's, an index that names other classes, values other than tensors or data that cannot be read."""
    reader = MetadataReader(folder)
    entries = reader.read_metadata().state_dict_metadata
    others = [key for key, entry in entries.items() if not isinstance(entry, TensorStorageMetadata)]
    if others:
        raise ConfigError(f"{folder} holds values that are not tensors ({', '.join(others[:3])}), which DCP stores "
                          "pickled: nanoexp reads tensors only")
    state = {key: torch.empty(entry.size, dtype=entry.properties.dtype) for key, entry in entries.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=ONE_PROCESS)
        try:
            dcp.load(state, storage_reader=reader, no_dist=True)
        except (CheckpointException, OSError, RuntimeError) as error:   # torch's carries each rank's traceback
            raise ConfigError(f"{folder}: torch.distributed.checkpoint could not read its tensors "
                              f"({short_cause(error)})") from None
    return state


def short_cause(error: BaseException) -> str:
    """The innermost error of torch's CheckpointException (or `error` itself), as `Type: message` on one line."""
    failures = getattr(error, "failures", None)   # rank -> (its exception, its traceback)
    inner = next(iter(failures.values())) if failures else error
    inner = inner[0] if isinstance(inner, tuple) else inner
    return f"{type(inner).__name__}: {str(inner).splitlines()[0] if str(inner) else ''}".rstrip(": ")


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
        raise ConfigError(f"{folder} has no {META_FILE}: give a DCP folder written by scripts/convert_to_dcp.py "
                          "(it holds the config of the model)")
    try:
        with open(info_path) as f:
            info = json.load(f)
    except (ValueError, UnicodeDecodeError) as error:
        raise ConfigError(f"{info_path}: not valid JSON ({error})") from None
    missing = [key for key in ("config", "global_batch_size") if key not in (info if isinstance(info, dict) else {})]
    if missing:
        raise ConfigError(f"{info_path}: it lacks {', '.join(missing)}; give a folder written by "
                          "scripts/convert_to_dcp.py")
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
    check_output_folder(out, "the nanoexp checkpoint")
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
