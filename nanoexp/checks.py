"""The start-up checks: the config normalised and validated, and what it names there to be read (the tokenizer,
each stage's data, the eval tasks, a writable checkpoints folder), before any process group or training work.
What train.py, the converters and offline evaluation run first (run.py, interop/hf_checkpoint.py,
evaluation/offline.py)."""
from __future__ import annotations

import re

import torch

from nanoexp.checkpoint.manager import check_checkpoint_folder
from nanoexp.config import ConfigError, normalize
from nanoexp.data.sources import check_data
from nanoexp.data.stages import training_stages
from nanoexp.data.tokenizer import build_tokenizer
from nanoexp.evaluation.downstream import INSTALL_HINT, fewshot_problems, harness_installed, unknown_tasks
from nanoexp.runtime.recompute import offload_problem
from nanoexp.validation import validate


def check_config(cfg, world_size: int | None, run_dir: str | None = None) -> None:
    """Every config check, before any process group or training work: normalise `cfg` in place (nanotron's
    spellings), validate it, what the device must offer (a GPU to offload activations to), then check what it points to (tokenizer, data files, eval tasks, and with `run_dir`
    the checkpoints folder: a writable folder with room for a checkpoint)."""
    normalize(cfg)
    vocab = None
    try:
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
        check_checkpoint_folder(cfg, run_dir)


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
