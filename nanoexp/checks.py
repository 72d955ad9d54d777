"""The start-up checks: the config normalised and validated, and what it names there to be read (the tokenizer,
each stage's data, the eval tasks), and for a training run the memory it needs and a writable checkpoints folder,
before any process group or training work. What train.py, the converters and offline evaluation run first (run.py,
interop/hf_checkpoint.py, nanoexp/evaluate.py)."""
from __future__ import annotations

import os
import re

import psutil
import torch
from omegaconf import OmegaConf

from nanoexp.checkpoint.manager import check_checkpoint_folder
from nanoexp.config import ConfigError, normalize
from nanoexp.data.sources import check_data
from nanoexp.data.stages import training_stages
from nanoexp.data.tokenizer import build_tokenizer
from nanoexp.evaluation.downstream import INSTALL_HINT, fewshot_problems, harness_installed, unknown_tasks
from nanoexp.launch.workers import start_method
from nanoexp.parallel.context import launcher_env
from nanoexp.model.shape import model_shape
from nanoexp.observe.memory_estimate import device_estimate, estimate, total
from nanoexp.parallel.layout import Layout
from nanoexp.runtime.recompute import offload_problem
from nanoexp.validation import validate

GIB = 2**30


def check_config(cfg, world_size: int | None, run_dir: str | None = None) -> None:
    """Every config check, before any process group or training work: normalise `cfg` in place (nanotron's
    spellings), validate it, what the device must offer (a GPU to offload activations to), then check what it
    points to (tokenizer, data files, eval tasks, and with `run_dir`, a training run's: the memory it needs, and the
    checkpoints folder: writable, with room for a checkpoint)."""
    normalize(cfg)
    vocab = None
    try:
        if not OmegaConf.is_missing(cfg.tokenizer, "tokenizer_name_or_path"):   # ??? (make_config.py): validate says
            vocab = build_tokenizer(cfg.tokenizer.tokenizer_name_or_path).vocab_size
    except (FileNotFoundError, OSError, ValueError) as error:
        raise ConfigError(f"tokenizer.tokenizer_name_or_path={cfg.tokenizer.tokenizer_name_or_path}: {error}")
    validate(cfg, world_size=world_size, tokenizer_vocab_size=vocab)
    offload = offload_problem(cfg, "cuda" if torch.cuda.is_available() else "cpu")   # the device workers will take
    if offload:
        raise ConfigError(offload)
    tokenizer = build_tokenizer(cfg.tokenizer.tokenizer_name_or_path)
    for stage in training_stages(cfg):   # each stage's data files: a missing folder, a bad Nanoset, a wrong column, ...
        try:
            check_data(stage.cfg, tokenizer)
        except (FileNotFoundError, KeyError, ValueError) as error:
            raise ConfigError(stage_error(stage, str(error))) from None
    check_eval_tasks(cfg)
    if run_dir is not None:
        check_memory(cfg)
        check_checkpoint_folder(cfg, run_dir)


def check_memory(cfg) -> None:
    """Refuse a run whose memory estimate (nanoexp/observe/memory_estimate.py) exceeds what it has, before anything
    is allocated: on GPUs the busiest rank's (with autocast's weight copies and the CUDA context, as the layout
    planner counts it) against the smallest GPU's memory; on CPU, where a machine's ranks share it, those of this
    machine's ranks against the host memory available now. The estimate counts tensors, not the runtime or the
    allocator's slack (it lies below the measured peak: docs/memory.md), so a run it refuses cannot fit. Not checked:
    general.check_memory=false, and GPUs of forked local workers (which cannot use CUDA once their parent has)."""
    layout, env = Layout.from_config(cfg), launcher_env()
    if not cfg.general.check_memory:
        return
    if torch.cuda.is_available():
        if env is None and start_method(cfg.parallelism.start_method) == "fork":
            return
        gpu = min((torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())),
                  key=lambda device: device.total_memory)
        need, have = sum(device_estimate(cfg).values()), gpu.total_memory
        where = f"per GPU, above the {have / GIB:.1f} GiB of {gpu.name}"
    else:
        shape = model_shape(cfg)
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", env["world_size"])) if env else layout.world_size
        stages = [total(estimate(cfg, shape, stage, "cpu")) for stage in range(layout.pp)]
        need, have = ranks * sum(stages) / layout.pp, psutil.virtual_memory().available
        where = f"for its {ranks} rank(s) on this machine, above the {have / GIB:.1f} GiB of host memory available now"
    if need > have:
        raise ConfigError(f"general.check_memory: the memory estimate of this run is {need / GIB:.1f} GiB {where} "
                          "(scripts/estimate_memory.py itemises it): use a smaller model or micro-batch, shard it "
                          "(optimizer.zero_stage, parallelism.*), or set general.check_memory=false to start anyway")


def check_eval_tasks(cfg) -> None:
    """eval.tasks needs the harness installed, and names it knows (its own, the shipped ones, eval.include_path)."""
    tasks = list(cfg.eval.tasks)
    if not tasks:
        return
    if not harness_installed():
        raise ConfigError(f"eval.tasks={tasks} needs lm-evaluation-harness, which is not installed: {INSTALL_HINT}")
    unknown = unknown_tasks(tasks, cfg.eval.include_path)
    if unknown:
        where = f" or in eval.include_path={cfg.eval.include_path}" if cfg.eval.include_path else ""
        raise ConfigError(f"eval.tasks: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a task of "
                          f"lm-eval, of the shipped ones (shakespeare_choice, shakespeare_complete){where}: check "
                          "the name, or set eval.include_path to the folder of its YAML")
    too_few = fewshot_problems(tasks, cfg.eval.include_path, cfg.eval.num_fewshot)
    if too_few:
        raise ConfigError(f"eval.num_fewshot={cfg.eval.num_fewshot}: {'; '.join(too_few)}: lower eval.num_fewshot")


def stage_error(stage, message: str) -> str:
    """A data error as the config names it: "data: ..." or, for a stage, "data_stages[1].data.dataset_folder: ..."."""
    if stage.name is None:
        return f"data: {message}"
    renamed = re.sub(r"(^|[\s,(])data\.(?=[a-z_])", lambda m: f"{m.group(1)}{stage.key}.", message)
    return renamed if renamed != message else f"{stage.key} (stage {stage.name!r}): {message}"
