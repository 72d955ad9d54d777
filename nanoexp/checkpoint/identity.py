"""Which run a checkpoint belongs to: its run id and the training keys of the config that wrote it.

A run is what it trains: the model, the optimizer and its schedule, the data and its order, the tokens and the
seed. Everything else changes how or where the same training runs, or how it is watched, and may differ between
a checkpoint and the run that continues it: the layout and ZeRO stage (a resume on another layout), tokens.train_steps
(more steps continue a run), the global batch (a resume continues from the consumed-sample position), logging,
evaluation, checkpointing, debugging and fault injection. meta.json keeps the composed config, so the training
keys are read from it (also in checkpoints written before run ids); meta.json's `run` names the run id, which a
fresh start or a warm start mints and an automatic resume carries on, and the run folder that saved it.
"""
from __future__ import annotations

import fnmatch
import uuid

from omegaconf import OmegaConf

from nanoexp.config import optimizer_name

TRAINING_GROUPS = ("general.seed", "tokenizer", "tokens", "model", "optimizer", "data", "data_stages")

# Keys inside those groups that do not change what is trained (fnmatch patterns of flat keys).
NOT_TRAINING = (
    "tokens.train_steps", "tokens.val_check_interval", "tokens.limit_val_batches",
    "tokens.micro_batch_size", "tokens.batch_accumulation_per_replica", "tokens.global_batch_size",
    "model.compile", "model.attention_kernel", "model.ddp_bucket_cap_mb", "model.allow_tf32",
    "model.fp8.gather_in_fp8",
    "optimizer.zero_stage", "optimizer.zero3_*", "optimizer.zero_overlap_reduce_scatter",
    "optimizer.optimizer_factory.torch_adam_is_fused", "optimizer.skip_nonfinite_steps",
    "data.prefetch", "data_stages.*.data.prefetch",
)


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def flatten(tree, prefix: str = "") -> dict:
    """{"a.b.c": value} of a nested config; a list of sections (data_stages) by index, other lists as values."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list) and tree and all(isinstance(x, dict) for x in tree):
        items = ((str(i), x) for i, x in enumerate(tree))
    else:
        return {prefix[:-1]: tree}
    flat = {}
    for key, value in items:
        flat.update(flatten(value, f"{prefix}{key}."))
    return flat


def training_keys(config: dict) -> dict:
    """The training keys of a composed config (a plain dict, as meta.json holds it), flat."""
    flat = {**flatten(config), "optimizer.optimizer_factory.name": optimizer_name(config)}   # adamW = adamw
    return {key: value for key, value in flat.items()
            if any(key == group or key.startswith(group + ".") for group in TRAINING_GROUPS)
            and not any(fnmatch.fnmatchcase(key, pattern) for pattern in NOT_TRAINING)}


def training_differences(saved_config: dict, cfg) -> list[str]:
    """"key is A in the checkpoint, B here" for each training key whose value differs. A key only one of the two
    configs has (added or removed since the checkpoint was written) is not compared; a data stage only one has is."""
    theirs, ours = training_keys(saved_config), training_keys(OmegaConf.to_container(cfg, resolve=True))
    stages = stage_numbers(theirs) ^ stage_numbers(ours)
    differ = [f"{key} is {short(theirs[key])} in the checkpoint, {short(value)} here"
              for key, value in ours.items() if key in theirs and theirs[key] != value]
    for i in sorted(stages):   # a stage only one of them has
        here = i in stage_numbers(ours)
        differ.append(f"data_stages.{i} is {'absent' if here else 'present'} in the checkpoint, "
                      f"{'present' if here else 'absent'} here")
    return differ


def stage_numbers(flat: dict) -> set[str]:
    return {key.split(".")[1] for key in flat if key.startswith("data_stages.")}


def short(value, limit: int = 60) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def run_record(meta: dict) -> dict:
    """meta.json's `run` ({"id", "folder"}); {} in a checkpoint written before run ids."""
    run = meta.get("run")
    return run if isinstance(run, dict) else {}
