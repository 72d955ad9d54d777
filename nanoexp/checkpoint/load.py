"""Reading a checkpoint on any layout: stitch full tensors from the saved pieces, slice for this rank.

Loading never runs pickled code: tensors come from safetensors, everything else from JSON.
Every shard is checked against meta.json (present, size, CRC-32) before it is read, so a missing,
truncated or corrupt file is an error naming it.
"""
from __future__ import annotations

import json
import logging
import os
import random
import zlib
from collections import defaultdict

import numpy as np
import torch
from omegaconf import OmegaConf
from safetensors import safe_open

from nanoexp.checkpoint.save import FORMAT_VERSION, CheckpointError, rank_file
from nanoexp.config import ConfigError
from nanoexp.model.llama import buffer_shapes, parameter_shapes
from nanoexp.checkpoint.save import persistent_buffers
from nanoexp.model.placement import expert_values, local_slice, stored_names
from nanoexp.parallel.zero.sharded_optimizer import ShardedOptimizer

log = logging.getLogger("nanoexp")


META_KEYS = ("step", "files", "index", "config", "layout", "consumed_samples", "global_batch_size")


def file_crc32(path: str, chunk: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


class CheckpointReader:
    """One checkpoint folder: its metadata, and full (unsharded) tensors by (parameter name, kind)."""

    def __init__(self, folder: str):
        self.folder = folder
        meta_path = os.path.join(folder, "meta.json")
        if not os.path.isfile(meta_path):
            raise CheckpointError(f"{folder} is not a complete nanoexp checkpoint: {meta_path} is missing")
        try:
            with open(meta_path) as f:
                self.meta = json.load(f)
        except (ValueError, UnicodeDecodeError) as error:
            raise CheckpointError(f"damaged {meta_path}: not valid JSON ({error}); resume from another checkpoint "
                                  "(write its step into latest.txt)") from None
        if not isinstance(self.meta, dict) or self.meta.get("format_version") != FORMAT_VERSION:
            version = self.meta.get("format_version") if isinstance(self.meta, dict) else None
            raise CheckpointError(f"{meta_path}: format version {version}, this nanoexp reads version "
                                  f"{FORMAT_VERSION}")
        missing = [key for key in META_KEYS if key not in self.meta]
        if missing:
            raise CheckpointError(f"damaged {meta_path}: it lacks {', '.join(missing)}")
        self.pieces = defaultdict(list)   # (name, kind) -> [(file, key, entry)]
        for file, entries in self.meta["index"].items():
            for key, entry in entries.items():
                self.pieces[entry["name"], entry["kind"]].append((file, key, entry))
        self._handles = {}

    def open(self, file: str):
        """A verified safetensors handle on one shard."""
        if file in self._handles:
            return self._handles[file]
        path, expected = os.path.join(self.folder, file), self.meta["files"].get(file)
        if expected is None:
            raise CheckpointError(f"{path} is not listed in {self.folder}/meta.json")
        if not os.path.isfile(path):
            raise CheckpointError(f"missing shard {path}: written by rank {expected['rank']}, "
                                  f"expected {expected['bytes']} bytes")
        size = os.path.getsize(path)
        if size != expected["bytes"]:
            raise CheckpointError(f"truncated or mismatched shard {path}: {size} bytes, expected {expected['bytes']}")
        if file_crc32(path) != expected["crc32"]:
            raise CheckpointError(f"corrupt shard {path}: its CRC-32 differs from the one in meta.json")
        try:
            handle = safe_open(path, "pt")
        except Exception as error:
            raise CheckpointError(f"unreadable shard {path}: {error}") from error
        self._handles[file] = handle
        return handle

    def check_files(self) -> None:
        """Every shard meta.json lists is there with its size, and holds each piece meta.json indexes in it with the
        shape it records (cheap: headers only; the CRC is checked when a shard is read)."""
        for file, expected in self.meta["files"].items():
            path = os.path.join(self.folder, file)
            if not os.path.isfile(path):
                raise CheckpointError(f"missing shard {path}: written by rank {expected['rank']}, "
                                      f"expected {expected['bytes']} bytes")
            if os.path.getsize(path) != expected["bytes"]:
                raise CheckpointError(f"truncated or mismatched shard {path}: {os.path.getsize(path)} bytes, "
                                      f"expected {expected['bytes']}")
            entries = self.meta["index"].get(file, {})
            try:
                with safe_open(path, "pt") as handle:
                    shapes = {key: handle.get_slice(key).get_shape() for key in handle.keys() if key in entries}
            except Exception as error:
                raise CheckpointError(f"unreadable shard {path}: {error}") from None
            for key, entry in entries.items():
                if key not in shapes:
                    raise CheckpointError(f"mismatched shard {path}: it lacks {key}, which meta.json indexes in it")
                self.check_piece_shape(file, key, entry, list(shapes[key]))

    def has(self, name: str, kind: str) -> bool:
        return (name, kind) in self.pieces

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full shape of every saved parameter, from the index alone."""
        shapes = {}
        for (name, kind), pieces in self.pieces.items():
            if kind == "param":
                entry = pieces[0][2]
                shape = list(entry["local_shape"])
                if entry["split_dim"] is not None:
                    shape[entry["split_dim"]] *= entry["tp"]
                shapes[name] = tuple(shape)
        return shapes

    def full_tensor(self, name: str, kind: str = "param") -> torch.Tensor:
        """The whole tensor: each tp slice assembled from its flat ranges, slices joined on the split dim. Every
        piece is checked against meta.json: its shape, its range and its slice's shape (CheckpointError)."""
        pieces = self.pieces.get((name, kind))
        if not pieces:
            raise CheckpointError(f"{self.folder} holds no {kind} for parameter {name}")
        entry = pieces[0][2]
        shape, numel = entry["local_shape"], int(np.prod(entry["local_shape"]))
        for _, _, e in pieces:
            if (e["local_shape"], e["split_dim"], e["tp"]) != (shape, entry["split_dim"], entry["tp"]):
                raise CheckpointError(f"damaged {self.folder}/meta.json: the {kind} of parameter {name} is recorded "
                                      f"with slices of shape {shape} and {e['local_shape']}")
        if len(pieces) == 1 and entry["flat_range"] == [0, numel]:
            file, key, _ = pieces[0]   # the whole tensor in one piece: no assembly copy
            return self.stored_piece(file, key, entry).view(shape)   # ZeRO pieces are stored flat
        by_tp = defaultdict(list)
        for piece in pieces:
            by_tp[piece[2]["tp_rank"]].append(piece)
        slices = []
        for t in range(entry["tp"] if entry["split_dim"] is not None else 1):
            flat, covered = torch.empty(numel), 0
            for file, key, e in by_tp.get(t, []):
                a, b = e["flat_range"]
                flat[a:b] = self.stored_piece(file, key, e).reshape(-1)
                covered += b - a
            if covered != flat.numel():
                raise CheckpointError(f"{self.folder}: the {kind} of {name} (tp slice {t}) is incomplete: "
                                      f"{covered} of {flat.numel()} elements present")
            slices.append(flat.view(shape))
        return torch.cat(slices, dim=entry["split_dim"]) if len(slices) > 1 else slices[0]

    def stored_piece(self, file: str, key: str, entry: dict) -> torch.Tensor:
        """One stored piece, refused naming the parameter when its shape is not the one meta.json records."""
        value = self.open(file).get_tensor(key)
        self.check_piece_shape(file, key, entry, list(value.shape))
        return value

    def check_piece_shape(self, file: str, key: str, entry: dict, stored: list[int]) -> None:
        """A piece is elements [a, b) of a slice of shape local_shape (meta.json), stored with that shape (a whole
        slice) or flat (a ZeRO piece). Another shape, even of as many elements (a transposed matrix), is a
        CheckpointError naming the parameter."""
        (a, b), shape = entry["flat_range"], entry["local_shape"]
        numel = int(np.prod(shape))
        what = f"the {entry['kind']} of parameter {entry['name']}" + ("" if key == entry["name"] else f" ({key})")
        if not 0 <= a <= b <= numel:
            raise CheckpointError(f"damaged {self.folder}/meta.json: {what} in {file} is recorded as elements "
                                  f"{a}:{b} of a slice of shape {shape}")
        if stored != [b - a] and not ([a, b] == [0, numel] and stored == list(shape)):
            recorded = f"{list(shape)}" if [a, b] == [0, numel] else f"[{b - a}] (elements {a}:{b} of {list(shape)})"
            raise CheckpointError(f"mismatched shard {os.path.join(self.folder, file)}: {what} has shape {stored}, "
                                  f"meta.json records {recorded}")


def checked_input(folder: str) -> CheckpointReader:
    """A checkpoint a tool was given (a converter's input), checked whole before any work: meta.json, and every
    shard there with its size and the pieces meta.json indexes; a ConfigError naming the file otherwise (the CRC
    is checked when a shard is read)."""
    try:
        reader = CheckpointReader(folder)
        reader.check_files()
    except CheckpointError as error:
        raise ConfigError(str(error)) from None
    return reader


def check_compatible(reader: CheckpointReader, shape, model_cfg=None, strict: bool = True) -> tuple[set, list]:
    """(the model's parameters the checkpoint cannot fill: missing or of another shape, the checkpoint's
    parameters the model lacks). Strict: raise naming the first of either, and the model keys whose values
    differ from the checkpoint's config."""
    saved, expected = reader.full_shapes(), {**parameter_shapes(shape), **buffer_shapes(shape)}
    tie = reader.meta["config"]["model"]["model_config"]["tie_word_embeddings"]
    if strict and tie != shape.tie_word_embeddings:
        raise CheckpointError(f"{reader.folder} was saved with tie_word_embeddings={tie}, this model has "
                              f"{shape.tie_word_embeddings}: set model.model_config.tie_word_embeddings={tie}")
    unfit = {name: "is missing" if name not in saved else f"has shape {saved[name]}, the model expects {want}"
             for name, want in expected.items() if saved.get(name) != want}
    extra = [name for name in saved if name not in expected]
    if strict and (unfit or extra):
        name, problem = next(iter(unfit.items())) if unfit else (extra[0], "is not in this model")
        raise CheckpointError(f"{reader.folder} does not fit this model: parameter {name} {problem}"
                              f"{differing_keys(reader, model_cfg)}; checkpoint.load_strict=false loads only "
                              "the parameters both have")
    return set(unfit), extra


def differing_keys(reader: CheckpointReader, model_cfg) -> str:
    """ " (model.x is A in the checkpoint, B here, ...)": the model keys that differ from the checkpoint's."""
    if model_cfg is None:
        return ""
    theirs = flat_keys(reader.meta["config"]["model"], "model.")
    ours = flat_keys(OmegaConf.to_container(model_cfg, resolve=True), "model.")
    differ = [f"{key} is {theirs.get(key)} in the checkpoint, {value} here" for key, value in ours.items()
              if key in theirs and theirs[key] != value and not key.startswith("model.init_method")]
    return f" ({'; '.join(differ)})" if differ else ""


def flat_keys(tree: dict, prefix: str) -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flat_keys(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def local_value(reader: CheckpointReader, name: str, param, kind: str = "param") -> torch.Tensor:
    """This rank's part of `param`'s saved tensor of `kind`: its slice of the full tensor; for a stacked
    routed-expert tensor, its experts' tensors stacked."""
    experts = expert_values(name, param)
    if experts is not None:
        return torch.stack([reader.full_tensor(expert, kind) for expert in experts])
    return local_slice(reader.full_tensor(stored_names(name, param)[0], kind), param)


def fitted(local: torch.Tensor, param, name: str, kind: str) -> torch.Tensor:
    """`local`, this rank's slice of a checkpoint's tensor, when it has the shape of the model's `param` (copy_
    would broadcast some other shapes without a word); a CheckpointError naming the parameter otherwise."""
    if local.shape != param.shape:
        raise CheckpointError(f"the checkpoint's {kind} of parameter {name} gives this rank shape "
                              f"{tuple(local.shape)}, the model holds {tuple(param.shape)} here")
    return local


@torch.no_grad()
def load_model(reader: CheckpointReader, model, ctx, optimizer=None, skip: set[str] = frozenset()) -> None:
    """This rank's slice of every parameter but those named in `skip`; under ZeRO-3 (`optimizer` holds shards)
    into its pieces."""
    zero = isinstance(optimizer, ShardedOptimizer)
    held_as_shards = optimizer.grad_sync.held_as_shards() if zero else set()
    pieces = defaultdict(list)
    for piece in optimizer.pieces if held_as_shards else []:
        pieces[id(piece.param)].append(piece)
    for name, param in [*model.named_parameters(), *persistent_buffers(model)]:
        if skip.intersection(stored_names(name, param)):
            continue
        local = fitted(local_value(reader, name, param), param, name, "param")
        if id(param) not in held_as_shards:
            param.copy_(local)
        for piece in pieces[id(param)] if id(param) in held_as_shards else []:
            piece.value.copy_(local.reshape(-1)[piece.start:piece.end])


@torch.no_grad()
def load_optimizer(reader: CheckpointReader, model, optimizer, ctx, skip: set[str] = frozenset(),
                   name: str | None = None) -> bool:
    """Re-slice the saved optimizer state into `optimizer` (a torch optimizer, or ZeRO's on any dp), every kind
    the checkpoint holds per element, with "step" at the checkpoint's optimizer_steps (for optimizers that count
    their steps in their state, as AdamW's bias correction does); the parameters in `skip`
    start fresh. False if the checkpoint holds no state: none saved, or another optimizer's than `name`
    (optimizer.optimizer_factory.name; None: the checkpoint's)."""
    steps, kinds = reader.meta.get("optimizer_steps", 0), state_kinds(reader)
    saved_by = reader.meta["config"]["optimizer"]["optimizer_factory"]["name"]
    if name is not None and name.lower() != saved_by.lower():
        log.warning("the checkpoint's optimizer state is %s's, this run's optimizer.optimizer_factory.name=%s: "
                    "that state is not loaded (another optimizer's keys), the run resumes with fresh optimizer state",
                    saved_by, name)
        return False
    if not kinds:
        return False
    names = {id(p): n for n, p in model.named_parameters()}

    def skipped(p) -> bool:
        return bool(skip.intersection(stored_names(names[id(p)], p)))

    def kinds_of(p) -> list[str]:   # a parameter's own kinds: Muon's matrices and AdamW's others differ
        return [kind for kind in kinds if (stored_names(names[id(p)], p)[0], kind) in reader.pieces]

    def local_state(p, kind):
        return fitted(local_value(reader, names[id(p)], p, kind), p, names[id(p)], kind).to(p.device)

    step_device = None if optimizer.defaults.get("fused") else torch.device("cpu")

    def with_step(state: dict, device) -> dict:
        if not steps:
            return state
        return {**state, "step": torch.tensor(float(steps), dtype=torch.float32, device=step_device or device)}

    if isinstance(optimizer, ShardedOptimizer):   # this rank's part of each parameter
        for piece in (piece for piece in optimizer.pieces if not skipped(piece.param)):
            state = {kind: local_state(piece.param, kind).reshape(-1)[piece.start:piece.end].clone()
                     for kind in kinds_of(piece.param)}
            optimizer.state[piece.value] = with_step(state, piece.value.device)
        return True
    for group in optimizer.param_groups:
        for p in (p for p in group["params"] if not skipped(p)):
            optimizer.state[p] = with_step({kind: local_state(p, kind).contiguous() for kind in kinds_of(p)},
                                           p.device)
    return True


def state_kinds(reader: CheckpointReader) -> list[str]:
    """The optimizer state a checkpoint holds per element, by key, over all parameters."""
    return sorted({kind for _, kind in reader.pieces if kind != "param"})


def load_rng(reader: CheckpointReader, ctx) -> None:
    """Restore this rank's generators (meaningful only on the layout that saved them)."""
    handle = reader.open(rank_file(ctx.rank))
    info = json.loads(handle.metadata()["rng"])
    torch.set_rng_state(handle.get_tensor("rng:torch_cpu"))
    if ctx.device.type == "cuda" and "rng:torch_cuda" in handle.keys():
        torch.cuda.set_rng_state(handle.get_tensor("rng:torch_cuda"), ctx.device)
    kind, pos, has_gauss, cached = info["numpy"]
    np.random.set_state((kind, handle.get_tensor("rng:numpy_keys").numpy().astype(np.uint32), pos, has_gauss, cached))
    version, state, gauss = info["python"]
    random.setstate((version, tuple(state), gauss))


def single_process_config(config: dict):
    """A checkpoint's composed config (meta.json's), for one process holding the whole model: no parallelism,
    no ZeRO, weights from the checkpoint."""
    cfg = OmegaConf.create(config)
    cfg.parallelism.merge_with(dict(dp=1, cp=1, ep=1, tp=1, pp=1, pp_virtual_stages=1, pp_engine="1f1b"))
    cfg.optimizer.zero_stage = 0
    cfg.model.init_method.path = None
    return cfg
