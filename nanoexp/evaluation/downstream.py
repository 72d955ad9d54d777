"""Downstream evaluation: lm-evaluation-harness tasks on the model as it is sharded (the `eval` config group).

    eval.tasks          task names: the shipped ones (tasks/: shakespeare_choice, shakespeare_complete), any task
                        of the harness, or of the folder eval.include_path (the harness's --include_path)
    eval.interval       every this many steps, and at the end of training (0: only at the end)
    eval.limit          examples per task (null: all); eval.num_fewshot; eval.batch_size (rows per forward call)

`DownstreamEval.run()` runs `lm_eval.simple_evaluate`, a task at a time, on every rank with the `nanoexp` model (harness.py): each
rank asks for the same forwards, the scorer shares them out, and every rank gets the same scores; the trainer
records rank 0's. The harness does not reseed Python's, NumPy's or torch's global generators here (training's
own state stays as it was); its few-shot sampler has its own seed. Scores become flat metrics:
`eval/<task>/<metric>` and `eval/<task>/<metric>_stderr` (a metric under a filter other than the harness's
"none" is named `<metric>_<filter>`).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import logging
import os
import random
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("nanoexp")

SHIPPED_TASKS = Path(__file__).resolve().parent / "tasks"
INSTALL_HINT = "pip install -e '.[eval]' (EleutherAI's lm-eval)"


def harness_installed() -> bool:
    return importlib.util.find_spec("lm_eval") is not None


def include_paths(user_path: str | None) -> list[str]:
    """The task folders the harness indexes besides its own: the shipped tasks, then eval.include_path."""
    return [str(SHIPPED_TASKS)] + ([os.path.abspath(os.path.expanduser(user_path))] if user_path else [])


@functools.lru_cache(maxsize=4)
def task_manager(user_path: str | None, names: tuple[str, ...] = ()):
    """The harness's task index with the shipped tasks and eval.include_path; its thousands of own tasks only
    when `names` needs one of them (indexing them takes seconds, so the start-up check's index is kept for the
    training run in the same process)."""
    from lm_eval.tasks import TaskManager
    logging.getLogger("lm_eval").setLevel(logging.ERROR)   # the harness logs every task it loads, and warns of
    # custom datasets' keyword arguments, each time
    ours = TaskManager(include_path=include_paths(user_path), include_defaults=False)
    if names and set(names) <= set(ours.all_tasks):
        return ours
    return TaskManager(include_path=include_paths(user_path))


def unknown_tasks(names: list[str], user_path: str | None) -> list[str]:
    """The names the harness does not know, with the shipped tasks and eval.include_path indexed."""
    known = set(task_manager(user_path, tuple(names)).all_tasks)
    return [name for name in names if name not in known]


def harness_tasks(names: list[str], user_path: str | None) -> dict:
    """{name: the harness's task object} for `names`, groups opened into their tasks (loads their documents); a
    task that cannot be built is a ConfigError naming it."""
    from nanoexp.config import ConfigError
    manager, tasks = task_manager(user_path, tuple(names)), {}
    for name in names:
        try:
            tasks.update(manager.load([name])["tasks"])
        except Exception as error:   # noqa: BLE001 - a task's own code: whatever it raises, name the task
            raise ConfigError(f"eval.tasks: {name} cannot be built: {type(error).__name__}: {error}") from None
    return tasks


def fewshot_problems(names: list[str], user_path: str | None, num_fewshot: int | None) -> list[str]:
    """Tasks that cannot draw their few-shot examples: more shots than documents to draw them from (one more
    when they come from the evaluated split, which leaves the current document out)."""
    problems = []
    for name, task in harness_tasks(names, user_path).items():
        config = getattr(task, "config", None)
        shots = num_fewshot if num_fewshot is not None else (getattr(config, "num_fewshot", 0) or 0)
        if shots == 0:
            continue
        pool = len(task.fewshot_docs() or [])
        split = getattr(getattr(task, "fewshot_cfg", None), "split", None)
        needed = shots + (split is not None and split == getattr(config, "test_split", None))
        if needed > pool:
            problems.append(f"{name} has {pool} documents to draw {shots} few-shot examples from")
    return problems


def flatten(results: dict) -> dict[str, float]:
    """The harness's results[task] ({"acc,none": 0.3, "acc_stderr,none": 0.02, "alias": ...}) as flat metrics."""
    flat = {}
    for task, values in results.items():
        for key, value in values.items():
            if "," not in key or not isinstance(value, (int, float)):
                continue
            metric, filter_name = key.split(",", 1)
            stderr = metric.endswith("_stderr")
            metric = metric.removesuffix("_stderr") + ("" if filter_name == "none" else f"_{filter_name}")
            flat[f"eval/{task}/{metric}{'_stderr' if stderr else ''}"] = float(value)
    return flat


def sharded_downstream(cfg, runner) -> DownstreamEval:
    """The eval group's harness tasks scored on `runner`'s model as it is sharded (a ShardedScorer): what training
    runs when due and nanoexp/evaluate.py runs on a checkpoint."""
    from nanoexp.data.tokenizer import build_tokenizer
    from nanoexp.evaluation.scorer import ShardedScorer
    tokenizer = build_tokenizer(cfg.tokenizer.tokenizer_name_or_path)
    return DownstreamEval(cfg.eval, ShardedScorer(runner, tokenizer.eod_id), tokenizer)


class DownstreamEval:
    """The `eval` group's tasks on a ShardedScorer's model, with a nanoexp tokenizer."""

    def __init__(self, eval_cfg, scorer, tokenizer):
        from nanoexp.evaluation.harness import NanoexpLM
        self.cfg = eval_cfg
        self.lm = NanoexpLM(scorer, tokenizer, batch_size=int(eval_cfg.batch_size))
        self.manager = task_manager(eval_cfg.include_path, tuple(eval_cfg.tasks))

    def due(self, step: int, last_step: int) -> bool:
        interval = int(self.cfg.interval)
        return step == last_step or (interval > 0 and step % interval == 0)

    def failure(self, step: int, errors: dict[str, str]) -> Exception | None:
        """What training does about the tasks that failed at `step` ({task: error}): under eval.on_error=stop the
        error every rank raises (the step's checkpoint is written), otherwise None, each failure logged."""
        from nanoexp.failures import KnownFailure
        for task, error in errors.items():
            message = f"step {step}: downstream task {task} failed: {error}"
            if self.cfg.on_error == "stop":   # the same on every rank
                return KnownFailure(f"{message} (eval.on_error=stop; the step's checkpoint is written)")
            log.error("%s; training goes on (eval.on_error=stop ends the run instead)", message)
        return None

    def run(self, log_samples: bool = False) -> tuple[dict[str, float], dict[str, list], dict[str, str]]:
        """Every task once, each on its own, the same on every rank: its scores {"eval/<task>/<metric>": value},
        with `log_samples` each document's responses after the task's filters (for a multiple-choice document
        the (log-likelihood, greedy) of each choice, for generation the text), and {task: error} for the tasks
        that raised. The global random generators are left as they were."""
        scores, samples, errors = {}, {}, {}
        with generators_kept():
            for task in self.cfg.tasks:
                try:
                    results = self.evaluate(log_samples, [task])
                except Exception as error:   # noqa: BLE001 - one task's failure must not lose the others
                    errors[task] = f"{type(error).__name__}: {error}"
                    continue
                scores.update(flatten(results["results"]))
                for name, docs in results.get("samples", {}).items():
                    samples[name] = [[sample["doc_id"], sample["filtered_resps"]] for sample in docs]
        return scores, samples, errors

    def evaluate(self, log_samples: bool, tasks: list[str]) -> dict:
        from lm_eval.evaluator import simple_evaluate
        # LOCAL_RANK=0: the harness returns results only where it is 0 (it takes any other for a tp rank of its
        # own); here every rank computes them. Its progress bars (one per task and request type, on stderr) are
        # dropped; its log, at ERROR here, and nanoexp's have handlers of their own.
        with environment(LOCAL_RANK="0"), contextlib.redirect_stderr(io.StringIO()):
            return simple_evaluate(model=self.lm, tasks=tasks, num_fewshot=self.cfg.num_fewshot, limit=self.cfg.limit,
                                   task_manager=self.manager, log_samples=log_samples,
                                   bootstrap_iters=int(self.cfg.bootstrap_iters), random_seed=None,
                                   numpy_random_seed=None, torch_random_seed=None, verbosity="ERROR")


@contextlib.contextmanager
def generators_kept():
    """Python's, NumPy's and torch's global generators restored after the block: evaluating between two
    checkpoints must not change what training draws next (a resumed run skips that evaluation)."""
    python, numpy_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def environment(**values: str):
    """Environment variables set to `values` inside the block, restored after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def task_lines(scores: dict[str, float]) -> list[str]:
    """One console line per task: its metrics with their stderr."""
    tasks = {}
    for key, value in scores.items():
        _, task, metric = key.split("/", 2)
        if not metric.endswith("_stderr"):
            stderr = scores.get(f"{key}_stderr")
            tasks.setdefault(task, []).append(f"{metric} {value:.4f}" + (f" ± {stderr:.4f}" if stderr else ""))
    return [f"{task}: {', '.join(parts)}" for task, parts in tasks.items()]
