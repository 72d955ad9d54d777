"""`python train.py -m +plan=topK ...`: the planner's K fastest layouts as sweep jobs, each crossed with the other axes.

    python train.py -m +plan=top4 optimizer.learning_rate_scheduler.learning_rate=1e-3,3e-4   # 4 x 2 jobs

The sweeper (hydra_plugins/nanoexp_sweeper.py) hands this module the jobs the other axes make; for each, the job's
own config (model, tokens, the rest) is composed, search.rank ranks every layout of this machine, and the job is
repeated once per layout of the top K, with the layout's overrides (cost.Prediction.overrides) appended.
The machine: hydra.sweeper.gpus (null: torch.cuda.device_count(), or without CUDA one gloo process per core, at
most CPU_PROCESSES), hydra.sweeper.gpu (null: this GPU's entry in hardware.GPUS, or "cpu" calibrated now),
hydra.sweeper.gpus_per_node (null: all of them, one node). Each job's prediction goes to `<sweep dir>/plan.json` (PLAN_FILE), which
sweep_report reads to put predicted beside measured step time.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence

from nanoexp.config import ConfigError, normalize
from nanoexp.observe.summary import PLAN_FILE
from nanoexp.plan.hardware import GPUS, Hardware, hardware
from nanoexp.plan.search import rank

# Without CUDA: one gloo process per core, at most 4 (the tiny model's 4 heads and 4 layers let tp and pp each
# reach 4). More processes than cores share them, which the cost model (a whole device per process) ignores.
CPU_PROCESSES = 4
# Keys a plan sets on every job: the command line may not set (or sweep) them as well.
PLANNED = ("parallelism", "parallelism.dp", "parallelism.cp", "parallelism.ep", "parallelism.tp", "parallelism.pp",
           "parallelism.pp_engine", "parallelism.pp_virtual_stages", "parallelism.recompute", "parallelism.recompute_layer",
           "optimizer.zero_stage", "tokens.micro_batch_size", "tokens.batch_accumulation_per_replica")


def top_of(value) -> int:
    """K of `+plan=topK`; ConfigError naming the key otherwise."""
    match = re.fullmatch(r"top(\d+)", str(value).strip())
    if not match or int(match.group(1)) < 1:
        raise ConfigError(f"plan={value}: must be topK with K a positive integer, e.g. +plan=top4 "
                          "(the planner's K fastest layouts, docs/planning.md)")
    return int(match.group(1))


def check_axes(keys: Sequence[str]) -> None:
    """Refuse command-line keys the plan sets itself (the user's value would silently lose)."""
    clash = [key for key in keys if key.lstrip("+~") in PLANNED]
    if clash:
        raise ConfigError(f"plan: +plan=topK chooses the layout, ZeRO stage and micro-batch itself: remove "
                          f"{', '.join(clash)} from the command line (or drop +plan)")


def gpu_of(device_name: str) -> str:
    """hardware.GPUS' key for a CUDA device name ("NVIDIA H100 80GB HBM3" -> "h100")."""
    for key in GPUS:
        if key in device_name.lower():
            return key
    raise ConfigError(f"hydra.sweeper.gpu: this GPU ({device_name}) has no entry in nanoexp/plan/hardware.py: "
                      f"set hydra.sweeper.gpu to one of {', '.join(GPUS)}")


def machine(gpus: int | None, gpu: str | None, gpus_per_node: int | None) -> tuple[int, int, Hardware]:
    """(gpus, gpus per node, Hardware) of the run's machine, the sweeper's settings filling in the defaults."""
    import torch

    cuda = torch.cuda.is_available()
    if gpus is None:
        gpus = torch.cuda.device_count() if cuda else min(CPU_PROCESSES, os.cpu_count() or 1)
    if not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"hydra.sweeper.gpus={gpus}: must be a positive integer (processes to plan for)")
    per_node = gpus if gpus_per_node is None else gpus_per_node
    if not isinstance(per_node, int) or per_node < 1 or (gpus > per_node and gpus % per_node):
        raise ConfigError(f"hydra.sweeper.gpus_per_node={gpus_per_node}: must be a positive integer whose "
                          f"multiples make hydra.sweeper.gpus={gpus}")
    name = gpu or (gpu_of(torch.cuda.get_device_name(0)) if cuda else "cpu")
    if name.lower() not in (*GPUS, "cpu"):
        raise ConfigError(f"hydra.sweeper.gpu={name}: one of {', '.join([*GPUS, 'cpu'])}")
    return gpus, min(per_node, gpus), hardware(name)


def prediction_record(prediction, gpus: int, cfg) -> dict:
    """What plan.json keeps of a job's prediction: the step and the tokens/s of all its processes."""
    return {"layout": prediction.name, "step_time_s": prediction.step_time_s,
            "tokens_per_s": prediction.tokens_per_s_per_gpu * gpus, "mfu": prediction.mfu,
            "memory_gib": prediction.memory_gib, "zero_stage": prediction.zero_stage,
            "micro_batch": prediction.micro_batch, "recompute": prediction.recompute,
            "tokens_per_step": cfg.tokens.global_batch_size * cfg.tokens.sequence_length}


def expand(jobs: list[list[str]], top: int, compose: Callable[[list[str]], object], gpus: int, gpus_per_node: int,
           hw: Hardware) -> tuple[list[list[str]], list[dict]]:
    """Each of `jobs` (override lists) once per layout of its top `top`: rank 1 of every job first, then rank 2, ...
    Returns the new jobs' overrides and, in the same order, their predictions (plan.json's records).
    `compose(overrides)` is the job's config, as train.py would run it."""
    check_axes([override.partition("=")[0] for override in (jobs[0] if jobs else [])])
    ranked = []
    for overrides in jobs:
        cfg = compose(overrides)
        normalize(cfg)
        ranking = rank(cfg, gpus, gpus_per_node, hw, top)
        predictions = ranking.predictions
        if len(predictions) < top:
            why = max(ranking.reasons.items(), key=lambda item: item[1], default=("", 0))[0]
            raise ConfigError(f"plan=top{top}: only {len(predictions)} layouts of {gpus} processes fit this model "
                              f"on {hw.name} ({' '.join(overrides) or 'no overrides'}): ask for fewer"
                              + (f"; the most common reason the others are out: {why}" if why else ""))
        ranked.append((cfg, predictions))
    out_jobs, records = [], []
    for place in range(top):
        for overrides, (cfg, predictions) in zip(jobs, ranked):
            prediction = predictions[place]
            out_jobs.append([*overrides, *prediction.overrides(), "tokens.batch_accumulation_per_replica=null"])
            records.append(prediction_record(prediction, gpus, cfg) | {"rank": place + 1})
    return out_jobs, records


def write_plan(sweep_dir: str, records: list[dict], gpus: int, gpus_per_node: int, hw: Hardware,
               first_job: int = 0) -> None:
    """`<sweep_dir>/plan.json`: the machine and, by sweep job number, each job's prediction."""
    os.makedirs(sweep_dir, exist_ok=True)
    plan = {"gpus": gpus, "gpus_per_node": gpus_per_node, "gpu": hw.name,
            "jobs": {str(first_job + n): record for n, record in enumerate(records)}}
    with open(os.path.join(sweep_dir, PLAN_FILE), "w") as f:
        json.dump(plan, f, indent=1)

