"""Every command in README.md and docs/*.md runs as written: each fenced command line is checked.

- `python train.py ...` and `torchrun ... train.py ...`: its overrides compose (nanoexp.config.compose, with
  Hydra's own config for hydra/launcher and hydra.* keys) and validate for the world it runs in; a multirun is
  expanded as Hydra expands it (comma lists, and the sweeper params an experiment sets), every job checked, and a
  SLURM sweep also by the launcher's task-count rule (nanoexp/launch/sweep.py).
- `python scripts/X.py ...`, `python benchmarks/X.py ...`, `python -m benchmarks.X ...`: the script's own
  argparse parses the arguments (its main runs until it parses, then stops: nothing else is done).
- `bash X.sh`: the script exists and `bash -n` reads it; `pytest`: its test files, markers and options exist;
  `pip install`: the extras exist in pyproject.toml, a torch pin is within its range.
Lines that are not commands (program output, file trees) and shell lines (for, export, echo, ip) are left out.
The slow test runs the README's one-process training commands with debug=fast, each as written otherwise.
"""
from __future__ import annotations

import argparse
import copy
import functools
import glob
import importlib.util
import itertools
import os
import re
import shlex
import subprocess
import sys
from unittest import mock

import pytest

from tests.helpers import SLOW, train_py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
PROGRAMS = ("python", "torchrun", "pytest", "bash", "pip")


def fenced_commands(page: str) -> list[tuple[str, list[str]]]:
    """(`page:line`, words) of each command in the page's fenced blocks (not ```python```): continuation lines
    joined, comments dropped, `a; b` and `a && b` split, leading VAR=value assignments dropped."""
    found, lines, fence, start, joined = [], open(os.path.join(ROOT, page)).read().splitlines(), None, 0, ""
    for number, line in enumerate(lines, start=1):
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
            continue
        if fence is None or fence == "python":
            continue
        start, joined = (start if joined else number), joined + line.rstrip().removesuffix("\\") + " "
        if line.rstrip().endswith("\\"):
            continue
        try:
            words = shlex.split(joined, comments=True)
        except ValueError:   # a line of program output with an odd quote
            words = []
        joined = ""
        for _, part in itertools.groupby(words, key=lambda w: w in (";", "&&", "||")):
            part = [w.removesuffix(";") for w in part]
            while part and re.fullmatch(r"[A-Z_]+=\S*", part[0]):
                part = part[1:]
            if part and part[0] in PROGRAMS:
                found.append((f"{page}:{start}", [os.path.expandvars(w) for w in part]))   # as the shell expands $HOME
    return found


COMMANDS = [command for page in PAGES for command in fenced_commands(page)]
# Experiments that a documented command writes (import_nanotron_config.py --name, make_config.py --experiment):
# a later line's +experiment=<name> is checked without it.
WRITTEN_EXPERIMENTS = {words[i + 1] for _, words in COMMANDS for i, w in enumerate(words[:-1])
                       if w in ("--name", "--experiment")}


@functools.lru_cache(maxsize=None)
def composed_groups(groups: tuple[str, ...]):
    from nanoexp.config import compose
    return compose(list(groups))


def compose_fast(overrides: list[str]):
    """What nanoexp.config.compose(overrides) gives, at a third of its time: the config groups chosen (model=,
    +experiment=, hydra/launcher=) composed once per choice, the other overrides applied as Hydra applies them
    after composing (its own function). The quick tier composes about a hundred documented commands."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from nanoexp.config import CONF_DIR
    groups = {d for d in os.listdir(CONF_DIR) if os.path.isdir(os.path.join(CONF_DIR, d))}
    chosen = tuple(o for o in overrides if o.lstrip("+~").partition("=")[0].split("/")[0] in groups)
    cfg = copy.deepcopy(composed_groups(chosen))
    rest = OverridesParser.create().parse_overrides([o for o in overrides if o not in chosen])
    ConfigLoaderImpl._apply_overrides_to_config(rest, cfg)
    return cfg


def compose_hydra(overrides: list[str]):
    """The config with Hydra's own node (hydra.launcher, hydra.sweeper), as a multirun composes it."""
    from hydra import compose, initialize_config_dir
    from nanoexp.config import CONF_DIR, register_configs
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


def multirun_jobs(overrides: list[str], every: bool):
    """Hydra's launcher config and the jobs of `python train.py -m <overrides>`: every combination of the comma lists given on the command
    line and of the sweeper params the composed config sets (hydra.sweeper.params; the command line wins); with
    every=False only as many as it takes for each value of each axis to appear in one job (the quick tier's)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    parser = OverridesParser.create()

    def values(override: str) -> list[str]:
        parsed = parser.parse_override(override)
        if not parsed.is_sweep_override():
            return [override]
        return [f"{parsed.get_key_element()}={value}" for value in parsed.sweep_string_iterator()]
    given = [values(o) for o in overrides]
    hydra = compose_hydra([choices[0] for choices in given]).hydra
    params = hydra.sweeper.get("params") or {}
    keys = {parser.parse_override(o).get_key_element() for o in overrides}
    given += [values(f"{key}={value}") for key, value in params.items() if key not in keys]
    if every:
        return hydra.launcher, [list(job) for job in itertools.product(*given)]
    return hydra.launcher, [[axis[i % len(axis)] for axis in given] for i in range(max(map(len, given), default=1))]


def reader_files(overrides: list[str]) -> list[str]:
    """The overrides naming a file or folder the reader brings or an earlier command writes (a checkpoint of
    `outputs/.../checkpoints/100`, `hf_out/`, `$HOME/my_tasks`): not here, so validation's "no such ..." about
    them is expected; any other problem is not."""
    return [o for o in overrides if "=" in o and re.search(r"[/.]", o.partition("=")[2])
            and not re.fullmatch(r"[\d.e+-]+", o.partition("=")[2]) and not os.path.exists(o.partition("=")[2])]


def check_train(words: list[str], world: int | None, every: bool = False) -> None:
    """Compose and validate the jobs of a train.py command (a multirun: `every` job, or enough for each value);
    a SLURM sweep's task count too."""
    from nanoexp.config import ConfigError, normalize
    from nanoexp.launch.sweep import slurm_tasks_per_node
    from nanoexp.parallel.layout import Layout
    from nanoexp.validation import validate
    multirun = "-m" in words or "--multirun" in words
    # +plan=topK is the sweeper's (hydra_plugins/nanoexp_sweeper.py): it picks the layouts, the config never sees it
    overrides = [w for w in words if w not in ("-m", "--multirun") and not w.lstrip("+~").startswith("plan=")]
    overrides = [o for o in overrides if o.partition("=")[2] not in WRITTEN_EXPERIMENTS or not o.startswith("+experiment")]
    launcher, jobs = multirun_jobs(overrides, every) if multirun else (None, [overrides])
    sizes = []
    for job in jobs:
        cfg = compose_fast([o for o in job if not o.lstrip("+~").startswith("hydra")])
        normalize(cfg)
        try:
            validate(cfg, world_size=world)
        except ConfigError as error:
            if not all(any(f"{o}:" in line for o in reader_files(job)) for line in str(error).splitlines()):
                raise
        sizes.append(Layout.from_config(cfg).world_size)
    if multirun and launcher._target_.endswith("NanoexpSlurmLauncher"):
        slurm_tasks_per_node(sizes, nodes=launcher.nodes, tasks_per_node=launcher.tasks_per_node)


class Parsed(Exception):
    """Raised in place of running a script once its arguments are parsed."""


def check_script(path: str, args: list[str]) -> None:
    """Run the script's main until its argparse has parsed `args` (an error exits 2 with argparse's message)."""
    spec = importlib.util.spec_from_file_location("documented_script", os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parse_args, parse_known_args, depth = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args, []

    def parse_only(self, *a, **k):
        depth.append(1)
        try:
            namespace = parse_args(self, *a, **k)
        finally:
            depth.pop()
        raise Parsed(namespace)

    def parse_known_only(self, *a, **k):   # a subparser, or parse_args inside: go on; a script's own call: stop
        result = parse_known_args(self, *a, **k)
        if not depth:
            raise Parsed(result)
        return result
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_only), \
            mock.patch.object(argparse.ArgumentParser, "parse_known_args", parse_known_only), \
            mock.patch.object(sys, "argv", [path, *args]):
        try:
            module.main()
        except Parsed:
            pass


def check_pytest(args: list[str]) -> None:
    text = open(os.path.join(ROOT, "pyproject.toml")).read() + open(os.path.join(ROOT, "tests", "conftest.py")).read()
    for i, arg in enumerate(args):
        if arg.startswith("tests/"):
            assert os.path.exists(os.path.join(ROOT, arg.split("::")[0])), arg
        elif args[i - 1:i] == ["-m"]:
            assert all(f'"{marker}:' in text for marker in re.findall(r"\w+", arg) if marker not in ("not", "and", "or"))
        elif arg.startswith("--") and not arg.startswith(("--junitxml", "--durations")):
            assert f'"{arg.split("=")[0]}"' in text, f"{arg}: no such option"


def check_pip(args: list[str]) -> None:
    import tomllib
    project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    for arg in args:
        extras = re.fullmatch(r"\.\[([\w,]+)\]", arg)
        if extras:
            assert set(extras.group(1).split(",")) <= set(project["optional-dependencies"]), arg
        if arg.startswith("torch=="):
            low, high = re.search(r"torch>=([\d.]+),<=([\d.]+)", " ".join(project["dependencies"])).groups()
            version = tuple(map(int, arg[7:].split(".")))
            assert tuple(map(int, low.split("."))) <= version <= tuple(map(int, high.split("."))), arg


def check(words: list[str]) -> None:
    program, args = words[0], words[1:]
    if program == "torchrun":
        script = next(i for i, w in enumerate(args) if w.endswith(".py"))
        options = dict(re.fullmatch(r"--([\w-]+)=(\S+)", w).groups() for w in args[:script] if "=" in w)
        nodes, per_node = (int(options.get(k.replace("_", "-"), options.get(k, 1))) for k in ("nnodes", "nproc_per_node"))
        return check_train(args[script + 1:], nodes * per_node)
    if program == "python" and args[:2] == ["-m", "pytest"]:
        return check_pytest(args[2:])
    if program == "python" and args[0] == "-m":
        return check_script(args[1].replace(".", "/") + ".py", args[2:])
    if program == "python" and args[0] == "train.py":
        return check_train(args[1:], None)
    if program == "python" and args[0] != "-c":
        return check_script(args[0], args[1:])
    if program == "pytest":
        return check_pytest(args)
    if program == "bash":
        subprocess.run(["bash", "-n", os.path.join(ROOT, args[0])], check=True, capture_output=True)
    if program == "pip":
        return check_pip(args)


def test_the_pages_have_commands_of_every_kind():
    """The extraction finds the commands (a change to the fences must not silently check nothing)."""
    kinds = {words[0] if words[0] != "python" else " ".join(words[:2]) for _, words in COMMANDS}
    assert {"python train.py", "torchrun", "pytest", "bash", "pip", "python scripts/make_config.py"} <= kinds
    readme = [words for where, words in COMMANDS if where.startswith("README.md")]
    assert ["python", "train.py"] in readme and len(readme) >= 25


def test_the_fast_composition_is_hydras():
    from nanoexp.config import compose
    from omegaconf import OmegaConf
    overrides = ["model=moe_tiny", "parallelism=dp2tp1pp1", "parallelism.ep=2", "+experiment=e2e_small",
                 "optimizer.learning_rate_scheduler.learning_rate=3e-4", "eval.tasks=[a,b]", "debug=fast"]
    assert OmegaConf.to_container(compose_fast(overrides)) == OmegaConf.to_container(compose(overrides))


@pytest.mark.parametrize("where, words", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_documented_command_parses(where, words, capsys):
    try:
        check(words)
    except SystemExit as exit_info:   # argparse: exit 2 with its message
        pytest.fail(f"{where}: {shlex.join(words)}: exits {exit_info.code}: {capsys.readouterr().err.strip()}")
    except Exception as error:
        pytest.fail(f"{where}: {shlex.join(words)}: {type(error).__name__}: {error}")


def test_the_readme_shows_the_sweep_its_picture_was_drawn_from():
    from benchmarks.readme_figures import SWEEP
    assert any(words[:3] == ["python", "train.py", "-m"] and words[3:] == SWEEP
               for where, words in COMMANDS if where.startswith("README.md"))


MULTIRUNS = [(where, words) for where, words in COMMANDS if words[:2] == ["python", "train.py"] and "-m" in words]


@SLOW
@pytest.mark.parametrize("where, words", MULTIRUNS, ids=[where for where, _ in MULTIRUNS])
def test_every_job_of_a_documented_sweep_is_valid(where, words):
    """The quick test checks each value of a sweep's axes once; here every combination (48 jobs for µTransfer)."""
    check_train(words[2:], None, every=True)


def runs_here(words: list[str]) -> bool:
    """A README training command of one process that needs no GPU, cluster or network (no Hub dataset, no W&B
    online): told from its words, so that collecting the tests composes nothing."""
    if words[:2] != ["python", "train.py"] or "-m" in words:
        return False
    return not any(w.startswith(("parallelism", "hydra", "logging.wandb.mode=online")) or
                   (w.startswith("data.hf_dataset_or_datasets=") and w != "data.hf_dataset_or_datasets=mytext.txt") or
                   (w.startswith("+experiment=") and w.partition("=")[2] in WRITTEN_EXPERIMENTS) for w in words[2:])


# Each once with debug=fast; the bare `python train.py debug=fast` is tests/test_console.py's first test.
README_RUNS = [run for run in dict.fromkeys(tuple(w for w in words if w != "debug=fast") for where, words in COMMANDS
                                            if where.startswith("README.md") and runs_here(words))
               if run != ("python", "train.py")]


def test_the_readme_has_one_process_commands_to_run():
    assert len(README_RUNS) >= 3 and ("python", "train.py", "data=hf", "data.hf_dataset_or_datasets=mytext.txt") in README_RUNS


@SLOW
@pytest.mark.parametrize("words", README_RUNS, ids=[" ".join(w[2:]) or "default" for w in README_RUNS])
def test_readme_training_command_runs_with_debug_fast(words, tmp_path, monkeypatch):
    """A one-process `python train.py` line of the README, as written plus debug=fast (mytext.txt: a 3,000-line
    text written here), finishes with exit 0 and a completed summary.json."""
    import json
    from nanoexp.config import compose
    from nanoexp.parallel.layout import Layout
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mytext.txt").write_text("\n".join(f"Line {i} of a text file, with a few words on it." for i in
                                                   range(3000)) + "\n")
    overrides = [*words[2:], "debug=fast"]
    assert Layout.from_config(compose(overrides)).world_size == 1
    assert train_py(overrides, tmp_path / "run") == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "completed"
