"""Downstream tasks on a checkpoint, in any layout (what scripts/evaluate.py --tasks runs).

The config is the checkpoint's own (its model, tokenizer and sequence length), with the layout and the `eval`
keys overridden as on the command line; each rank builds its shard of the model, loads the checkpoint's weights
re-sliced for the layout (checkpoint/load.py), and runs the same DownstreamEval as training does. Rank 0 writes
the scores, and with `samples` every request's responses (the harness's per-document log-likelihoods and
generations), to a JSON file.
"""
from __future__ import annotations

import json
import os

from omegaconf import OmegaConf

from nanoexp.checkpoint.load import CheckpointReader, check_compatible, load_model
from nanoexp.config import ConfigError
from nanoexp.launch.workers import setup_device, spawn_local
from nanoexp.parallel.layout import Layout
from nanoexp.validation import validate


def checkpoint_config(folder: str, overrides: list[str]):
    """The checkpoint's config with `overrides` (dotted key=value) applied and checked."""
    from nanoexp.checks import check_eval_tasks
    cfg = OmegaConf.create(CheckpointReader(folder).meta["config"])
    cfg.model.init_method.path = None   # the weights come from the checkpoint
    cfg.merge_with(OmegaConf.from_dotlist(overrides))
    if "parallelism.pp_engine" not in " ".join(overrides) and int(cfg.parallelism.pp) == 1:
        cfg.parallelism.pp_engine = "1f1b"   # a checkpoint of an interleaved run, read on one stage
    validate(cfg, world_size=Layout.from_config(cfg).world_size)
    if not cfg.eval.tasks:
        raise ConfigError("eval.tasks is empty: name the tasks to run (--tasks shakespeare_choice,...)")
    check_eval_tasks(cfg)
    return cfg


def evaluate_checkpoint(folder: str, overrides: list[str], out_path: str, samples: bool = False) -> dict:
    """Run the config's eval.tasks on checkpoint `folder` in the layout the overrides give; returns the scores."""
    cfg = checkpoint_config(folder, overrides)
    world = Layout.from_config(cfg).world_size
    args = (OmegaConf.to_container(cfg, resolve=True), folder, out_path, samples)
    if world == 1:
        evaluation_worker(0, 1, setup_device(0, 1), *args)
    else:
        spawn_local(world, evaluation_worker, args, timeout_s=cfg.parallelism.collective_timeout_s,
                    method=cfg.parallelism.start_method)
    with open(out_path) as f:
        return json.load(f)


def evaluation_worker(rank: int, world_size: int, device, cfg_dict: dict, folder: str, out_path: str,
                      samples: bool) -> None:
    from nanoexp.evaluation.downstream import sharded_downstream
    from nanoexp.parallel.context import ParallelContext
    from nanoexp.runtime.build import build_runtime

    cfg = OmegaConf.create(cfg_dict)
    ctx = ParallelContext(Layout.from_config(cfg), device, cfg.parallelism.collective_timeout_s)
    runtime = build_runtime(cfg, ctx, training=False)
    reader = CheckpointReader(folder)
    check_compatible(reader, runtime.model.shape)
    load_model(reader, runtime.model, ctx)
    scores, responses, errors = sharded_downstream(cfg, runtime.runner).run(log_samples=samples)
    if errors:
        raise RuntimeError("; ".join(f"task {task} failed: {error}" for task, error in errors.items()))
    if rank == 0:
        result = {"checkpoint": os.path.abspath(folder), "layout": ctx.layout.name, "scores": scores}
        if samples:
            result["samples"] = responses
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
