"""Shared test helpers: compose the real config from conf/ and run training in-process."""
from __future__ import annotations

import importlib
import os

import pytest

from nanoexp.config import CONF_DIR, ConfigError, compose, register_configs  # noqa: F401 - CONF_DIR for the tests
from nanoexp.observe.metrics import read_metrics  # noqa: F401 - the tests read metrics.jsonl as the package does

register_configs()   # also for tests that compose from their own copy of conf/ with Hydra directly

# A model and run small enough for many runs per test session on 2 cores.
FAST = ["model.model_config.hidden_size=64", "model.model_config.intermediate_size=128",
        "model.model_config.num_hidden_layers=4", "model.model_config.num_attention_heads=4",
        "model.model_config.num_key_value_heads=2", "tokens.sequence_length=32",
        "tokens.global_batch_size=8", "tokens.micro_batch_size=2", "tokens.limit_val_batches=2",
        "logging.tensorboard=false", "logging.iteration_step_info_interval=1", "data.prefetch=false",
        "optimizer.learning_rate_scheduler.lr_warmup_steps=2"]


compose_config = compose   # the config `python train.py <overrides>` runs with (nanoexp.config.compose)


def train(run_dir: str, overrides: list[str]) -> list[dict]:
    """Compose, validate and train (spawning local workers when dp*cp*tp*pp > 1); return metrics.jsonl."""
    from nanoexp.run import run
    run(compose_config(overrides), str(run_dir))
    return read_metrics(run_dir)


def train_losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records if "loss" in r]


def compute_gradients(trainer, micro_batches: list[dict]) -> float:
    """The first phases of the trainer's step (nanoexp/runtime/trainer.py): forward and backward of one global
    batch and the gradient sync, leaving the final gradients in .grad (unclipped); returns the step loss."""
    losses = trainer.forward_backward([trainer.runner.prepare(mb) for mb in micro_batches])
    trainer.sync_gradients()
    return trainer.step_loss(losses).item()


def start_error(cfg) -> str:
    """The message of the ConfigError that the start-up checks raise for `cfg` (fails if none)."""
    from nanoexp.checks import check_config   # imports data, checkpoints and lm-eval: only when asked
    with pytest.raises(ConfigError) as info:
        check_config(cfg, None)
    return str(info.value)


def train_py(overrides: list[str], run_dir) -> int:
    """Run train.py's entry point in this process (Hydra parses the command line as in a shell, the run goes
    through nanoexp.run.main); return its exit code (pytest's capsys holds what it printed)."""
    import sys
    from unittest import mock

    import train as entry_point
    with mock.patch.object(sys, "argv", ["train.py", *overrides, f"hydra.run.dir={run_dir}"]):
        try:
            entry_point.main()
        except SystemExit as exit_info:
            return exit_info.code if isinstance(exit_info.code, int) else 1
    return 0


def require(module: str):
    """`module`, imported; a skip with the reason when it is missing, except under CI=true, where `.[dev]` installs
    every package the tests import, so a missing one fails instead of skipping silently."""
    if os.environ.get("CI") == "true":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is not installed (pip install -e '.[dev]')")


SLOW = pytest.mark.slow   # left out of the quick tier (`pytest -m quick`); the whole suite runs it


def tiered(cases, quick) -> list:
    """The names of `cases` for parametrize, each but those in `quick` marked slow: the quick tier runs one or two
    cases of a family (enough to reach every module), the whole suite every case."""
    assert set(quick) <= set(cases), set(quick) - set(cases)
    return [name if name in quick else pytest.param(name, marks=SLOW) for name in cases]
