"""Writing a sharded checkpoint, atomically.

Layout of `<checkpoints_path>/<step>/`:
  rank_<r>.safetensors   what global rank r owns: its parameter slices and optimizer state, keyed by HF parameter
                         name, plus its RNG states. Every value is stored once: model weights and plain AdamW state
                         by dp (and cp) rank 0 (a routed expert under expert parallelism by the first rank holding
                         it), tp-replicated ones by tp rank 0, a pipeline's tied LM-head copy not at all (it equals
                         the embedding); ZeRO state (and ZeRO-3's weights) by the dp x cp (edp) rank that owns it, as
                         flat ranges of each parameter (under hybrid sharding, the owner in replica 0).
  meta.json              step, data position, layout, the composed config, format version, and an index: which
                         file holds which piece of which tensor (enough to re-slice).
The folder is written as `.tmp-<step>/` and renamed into place by rank 0 only after every rank reported success;
`latest.txt` moves last. A crash or a failed write leaves earlier checkpoints as they were. A save is four steps (prepare_folder, take_shard, write_shard, publish): save_checkpoint runs them
one after the other; checkpoint.async_save writes the shard in the background (async_save.py).
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save as serialize

from nanoexp.failures import KnownFailure
from nanoexp.model.placement import counted_here, expert_values, placement
from nanoexp.parallel.zero.sharded_optimizer import ShardedOptimizer

log = logging.getLogger("nanoexp")

FORMAT_VERSION = 1


class CheckpointError(KnownFailure):
    """A checkpoint that cannot be written or read; the message names the folder or file."""


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def shard_contents(model, optimizer, ctx, to_host=None) -> tuple[dict, dict]:
    """This rank's tensors to store and their index entries (name, kind, slice metadata); a stacked routed-expert
    parameter's as one stored tensor per expert (`stored_parts`), and a MoE layer's routing bias (a buffer) as a
    replicated parameter's value. `to_host(key, tensor)` gives the host tensor written for each (default: the
    tensor on the host, no copy where it is there already)."""
    tensors, index = {}, {}
    to_host = to_host or (lambda key, tensor: tensor.detach().to("cpu").contiguous())

    def add(key, tensor, name, kind, param, shape, flat_range):
        tensors[key] = to_host(key, tensor)
        index[key] = {"name": name, "kind": kind, "tp_rank": ctx.tp_rank, "tp": ctx.tp,
                      "split_dim": placement(param).split_dim, "local_shape": list(shape), "flat_range": flat_range}

    zero = isinstance(optimizer, ShardedOptimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    held_as_shards = optimizer.grad_sync.held_as_shards() if zero else set()
    for name, p in [*model.named_parameters(), *persistent_buffers(model)]:   # of the replicas, the first writes
        if ctx.replica_rank(p) != 0 or not counted_here(p, ctx.tp_rank) or id(p) in held_as_shards:
            continue
        state = {} if zero or id(p) not in names else element_state(optimizer.state.get(p, {}), p)
        for kind, value in {"param": p, **state}.items():
            for stored, shape, part, flat_range in stored_parts(name, p, value):
                add(stored if kind == "param" else f"{stored}:{kind}", part, stored, kind, p, shape, flat_range)
    if zero:
        # ZeRO's pieces: this rank's part [start, end) of each parameter's flattened elements; under ZeRO-3 their
        # values too. Under hybrid sharding the replicas hold the same pieces: the first copy's rank writes them.
        for piece in optimizer.grad_sync.first_copy_pieces():
            if not counted_here(piece.param, ctx.tp_rank):
                continue
            name = names[id(piece.param)]
            values = {"param": piece.value} if id(piece.param) in held_as_shards else {}
            values.update(element_state(optimizer.state.get(piece.value, {}), piece.value))
            for kind, value in values.items():
                for stored, shape, part, (a, b) in stored_parts(name, piece.param, value.reshape(-1), piece.start):
                    add(f"{stored}:{kind}@{a}", part, stored, kind, piece.param, shape, [a, b])
    return tensors, index


def persistent_buffers(model) -> list[tuple[str, torch.Tensor]]:
    """The buffers a checkpoint keeps (those of the module's state_dict: a MoE layer's routing bias)."""
    return [(name, buffer) for name, buffer in model.named_buffers()
            if name.rpartition(".")[2] not in model.get_submodule(name.rpartition(".")[0])._non_persistent_buffers_set]


def stored_parts(name: str, param, tensor: torch.Tensor, start: int = 0):
    """The stored tensors that `tensor` holds parts of: `tensor` is `param`'s values or state, whole (`start` 0,
    the parameter's shape) or elements [start, start + numel) of it flattened (a ZeRO piece). Yields (stored name,
    its local shape, the part, its element range there): one for a parameter, one per expert touched for a stacked
    routed-expert tensor (whose storage ZeRO-3 may have freed: only its shape is read)."""
    experts = expert_values(name, param)
    if experts is None:
        yield name, param.shape, tensor, [start, start + tensor.numel()]
        return
    shape = param.shape[1:]
    size, flat, whole = shape.numel(), tensor.reshape(-1), tensor.shape == param.shape
    for j, expert in enumerate(experts):
        a, b = max(start, j * size), min(start + flat.numel(), (j + 1) * size)
        if a < b:
            yield expert, shape, tensor[j] if whole else flat[a - start:b - start], [a - j * size, b - j * size]


def element_state(state: dict, param) -> dict:
    """The optimizer state of `param` held per element (AdamW's exp_avg and exp_avg_sq, a momentum buffer, ...),
    by key; scalars such as "step" are the meta's optimizer_steps."""
    return {key: value for key, value in state.items()
            if torch.is_tensor(value) and value.numel() == param.numel() and value.dim() > 0}


def rng_states(ctx) -> tuple[dict, str]:
    """Every generator's state: tensors for torch and NumPy's key, JSON for the rest."""
    tensors = {"rng:torch_cpu": torch.get_rng_state()}
    if ctx.device.type == "cuda":
        tensors["rng:torch_cuda"] = torch.cuda.get_rng_state(ctx.device)
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["rng:numpy_keys"] = torch.from_numpy(keys.astype(np.int64))
    version, py_state, gauss = random.getstate()
    info = {"python": [version, list(py_state), gauss], "numpy": [kind, int(pos), int(has_gauss), float(cached)]}
    return tensors, json.dumps(info)


def write_file(path: str, tensors: dict, metadata: dict) -> dict:
    """Serialize, write and fsync one shard; return its size and CRC-32 for meta.json."""
    data = serialize(tensors, metadata=metadata)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), "crc32": zlib.crc32(data)}


def _gather(obj, ctx) -> list:
    if ctx.world_size == 1:
        return [obj]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj, ctx):
    if ctx.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class Shard:
    """What one rank writes into a checkpoint: its tensors on the host, their index entries, its RNG states (JSON
    metadata), and `copied`, which returns once the host copies are filled (they may still be arriving from a GPU)."""
    tensors: dict
    index: dict
    metadata: dict
    copied: Callable[[], None] = lambda: None


def take_shard(model, optimizer, ctx, to_host=None) -> Shard:
    """This rank's part of the checkpoint as it is now, after the step's optimizer update (see shard_contents)."""
    tensors, index = shard_contents(model, optimizer, ctx, to_host)
    rng_tensors, rng_json = rng_states(ctx)
    return Shard({**tensors, **rng_tensors}, index, {"rng": rng_json})


def prepare_folder(root: str, step: int, ctx) -> Exception | None:
    """A collective: rank 0 makes an empty `<root>/.tmp-<step>/` (removing one a killed save left), and every rank
    waits for it. Returns rank 0's error, if it could not (every rank's write then fails, and all raise together)."""
    tmp, error = os.path.join(root, f".tmp-{step}"), None
    if ctx.rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)   # left by a save that was killed
            os.makedirs(tmp)
        except OSError as failure:
            error = failure
    if ctx.world_size > 1:
        dist.barrier()
    return error


def write_shard(root: str, step: int, shard: Shard, rank: int, before_write=None,
                prepared: Exception | None = None) -> dict:
    """Write this rank's shard into `<root>/.tmp-<step>/` and report it for meta.json; a failure (`prepared`: the
    folder's) is reported with its cause, never raised (every rank learns of it when the reports are gathered).
    Safe in a background thread."""
    start = time.perf_counter()
    try:
        if prepared is not None:
            raise prepared
        if before_write is not None:
            before_write()
        shard.copied()
        info = write_file(os.path.join(root, f".tmp-{step}", rank_file(rank)), shard.tensors, shard.metadata)
        return {"ok": True, "file": {**info, "rank": rank}, "index": shard.index,
                "seconds": time.perf_counter() - start}
    except Exception as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}


def publish(root: str, step: int, report: dict, ctx, meta: dict, keep_last_n: int | None,
            abandon_after: int | None = None) -> float:
    """A collective, once every rank's write of checkpoint `step` has ended: gather the reports; rank 0 puts the
    folder in place (commit) when all succeeded. Raises CheckpointError on every rank if any rank failed; earlier
    checkpoints are untouched. Returns the longest rank's write, in seconds."""
    final, tmp = os.path.join(root, str(step)), os.path.join(root, f".tmp-{step}")
    reports = _gather(report, ctx)
    error = None
    if ctx.rank == 0:
        failed = [f"rank {r}: {rep['error']}" for r, rep in enumerate(reports) if not rep["ok"]]
        try:
            if failed:
                shutil.rmtree(tmp, ignore_errors=True)
                error = "; ".join(failed)
            else:
                commit(root, tmp, final, step, meta, reports, keep_last_n, abandon_after)
        except Exception as commit_error:
            error = f"{type(commit_error).__name__}: {commit_error}"
    error = _broadcast(error, ctx)
    if error:
        raise CheckpointError(f"could not save checkpoint {final} ({error}); earlier checkpoints are intact")
    return max(rep["seconds"] for rep in reports)


def save_checkpoint(root: str, step: int, model, optimizer, ctx, meta: dict, keep_last_n: int | None,
                    abandon_after: int | None = None, before_write=None) -> str:
    """Write checkpoint `<root>/<step>` from every rank (a collective) and return its path.
    Raises CheckpointError on every rank if any rank failed; earlier checkpoints are untouched.
    `abandon_after`: the step this run started from, on its first save: later checkpoints in `root`
    belong to an abandoned timeline and are moved to `<root>/abandoned/` (never deleted)."""
    prepared = prepare_folder(root, step, ctx)
    report = write_shard(root, step, take_shard(model, optimizer, ctx), ctx.rank, before_write, prepared)
    publish(root, step, report, ctx, meta, keep_last_n, abandon_after)
    return os.path.join(root, str(step))


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def commit(root: str, tmp: str, final: str, step: int, meta: dict, reports: list, keep_last_n: int | None,
           abandon_after: int | None) -> None:
    """Rank 0, once every shard is on disk: meta.json, abandoned checkpoints aside, rename into
    place, latest.txt, pruning (only ever of this timeline's older checkpoints)."""
    meta = {**meta, "format_version": FORMAT_VERSION, "step": step,
            "files": {rank_file(rep["file"]["rank"]): rep["file"] for rep in reports},
            "index": {rank_file(r): rep["index"] for r, rep in enumerate(reports) if rep["index"]}}
    _write_json(os.path.join(tmp, "meta.json"), meta)
    if abandon_after is not None:
        for later in (s for s in complete_steps(root) if s > abandon_after):
            move_to_abandoned(root, later)
    if os.path.exists(final):   # cannot happen after the above; never overwrite a checkpoint
        move_to_abandoned(root, step)
    os.rename(tmp, final)
    latest_tmp = os.path.join(root, ".latest.txt.tmp")
    with open(latest_tmp, "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, os.path.join(root, "latest.txt"))
    if keep_last_n:
        for old_step in complete_steps(root)[:-keep_last_n]:
            shutil.rmtree(os.path.join(root, str(old_step)))


def move_to_abandoned(root: str, step: int) -> None:
    """Keep a checkpoint of an abandoned timeline out of the way: <root>/abandoned/<step>[.<n>]."""
    target = os.path.join(root, "abandoned", str(step))
    n = 1
    while os.path.exists(target):
        target, n = os.path.join(root, "abandoned", f"{step}.{n}"), n + 1
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.rename(os.path.join(root, str(step)), target)
    log.warning("checkpoint %s is after the step this run resumed from (an abandoned timeline): moved to %s",
                os.path.join(root, str(step)), target)


def complete_steps(root: str) -> list[int]:
    """Steps of the complete checkpoints under root (renamed into place, with meta.json), ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(int(d) for d in os.listdir(root)   # a step's folder is its number as saved: "4", never "04"
                  if d.isdigit() and d == str(int(d)) and os.path.isfile(os.path.join(root, d, "meta.json")))
