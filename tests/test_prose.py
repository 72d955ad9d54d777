"""The prose agrees with the code: the names of each registry (schedules, kernels, number formats, optimizers,
recompute modes, selective op groups) where the README, docs/*.md or nanoexp's docstrings and comments list them;
the README's feature table; the parallel dimensions in pyproject's description and the README's first lines; the
modules named by path; and the test times, quoted only in docs/testing.md's table that scripts/test_times.py writes.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import glob
import io
import os
import re
import subprocess
import sys
import tokenize
import tomllib

import pytest

from nanoexp.config import RECOMPUTE_MODES, OptimizerFactory
from nanoexp.model.saved_ops import SAVABLE_OPS
from nanoexp.numerics import fp8  # noqa: F401 - registers its converter
from nanoexp.numerics.converters import CONVERTERS
from nanoexp.optim.registry import OPTIMIZERS
from nanoexp.parallel.context_parallel import CP_KERNELS
from nanoexp.parallel.layout import Layout
from nanoexp.parallel.pipeline.schedules import SCHEDULES
from nanoexp.validation import REGISTRIES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Each key's registered names (validation.REGISTRIES: schedules, kernels, fp8 recipes, ...), and the number formats.
NAMES = {**REGISTRIES, "optimizer.optimizer_factory.name": OPTIMIZERS, "parallelism.recompute": RECOMPUTE_MODES,
         "parallelism.selective_ops": SAVABLE_OPS, "number format": CONVERTERS}
# A list: two or more names (a word with a letter, maybe in backticks) joined by |, commas, "and" or "or".
NAME = r"`?\w*[A-Za-z]\w*`?"
# "a | b", "a \| b" (in a table), "a, b", "a, and b", "a or b"
SEPARATOR = r"(?: *(?:\\?\||,) *(?:(?:and|or) )?| (?:and|or) )"
LIST = re.compile(rf"{NAME}(?:{SEPARATOR}{NAME})+")


def read(path: str) -> str:
    with open(os.path.join(REPO, path)) as f:
        return f.read()


@functools.cache
def texts() -> dict[str, str]:
    """{path: prose} of the README and the docs, of every module of nanoexp its docstrings and comments, and of
    every config file its comments."""
    pages = ["README.md"] + sorted(glob.glob("docs/*.md", root_dir=REPO))
    modules = sorted(glob.glob("nanoexp/**/*.py", root_dir=REPO, recursive=True))
    configs = sorted(glob.glob("conf/**/*.yaml", root_dir=REPO, recursive=True))
    return {**{path: read(path) for path in pages}, **{path: prose_of(read(path)) for path in modules},
            **{path: re.sub(r"(?m)^[^#\n]*", "", read(path)) for path in configs}}   # from each line its #


def prose_of(source: str) -> str:
    """A module's docstrings and comments, each on its own line numbers (the code's lines blank)."""
    lines = [""] * (source.count("\n") + 2)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node):
            first = node.body[0].lineno
            for offset, line in enumerate(node.body[0].value.value.splitlines()):
                lines[first + offset] = line
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            lines[token.start[0]] += " " + token.string
    return "\n".join(lines[1:])


def lists(text: str):
    """(line number, its names in lower case, whether | separated) of each list in `text`; in a Markdown table
    each cell apart (a | that is not escaped ends a cell)."""
    for number, line in enumerate(text.splitlines(), 1):
        cells = re.split(r"(?<!\\)\|", line) if line.lstrip().startswith("|") else [line]
        for match in (match for cell in cells for match in LIST.finditer(cell)):
            names = [name.strip("`").lower() for name in re.split(SEPARATOR, match.group(0))]
            yield number, names, "|" in match.group(0)


def lists_in(sources: dict[str, str]) -> list[tuple[str, list[str], bool]]:
    """("path:line", names, whether | separated) of every list in `sources` ({path: text})."""
    return [(f"{path}:{number}", names, piped) for path, text in sources.items()
            for number, names, piped in lists(text)]


@functools.cache
def prose_lists() -> list[tuple[str, list[str], bool]]:
    return lists_in(texts())


def wrong_lists(kind: str, registered, found: list[tuple[str, list[str], bool]]) -> list[str]:
    """Where a list of `kind`'s names names a stranger or leaves a registered name out. Which lists are checked:
    one separated by | is a key's allowed values: every registered name, no other. One of commas, "and", "or" is
    a list of `kind` names when it names three, so it names no other; when it names four it is the registry, so
    it leaves none out. Fewer is a mention in passing (e.g. "learning rate, AdamW and Muon")."""
    known, wrong = {name.lower() for name in registered}, []
    for where, names, piped in found:
        named = set(names) & known
        if len(named) < 2:
            continue
        strangers = [name for name in names if name not in known] if piped or len(named) >= 3 else []
        missing = sorted(known - named) if piped or len(named) >= 4 else []
        if strangers or missing:
            wrong.append(f"{where}: {', '.join(names)}: "
                         + "; ".join(filter(None, [strangers and f"not {kind}'s: {', '.join(strangers)}",
                                                   missing and f"leaves out {', '.join(missing)}"])))
    return wrong


@pytest.mark.parametrize("kind", NAMES)
def test_every_list_of_a_registrys_names_is_the_registrys(kind):
    assert wrong_lists(kind, NAMES[kind], prose_lists()) == []


def test_the_list_finder_finds_stale_and_stray_names():
    """The check itself: a schedule list without dualpipev, and one with a name never registered, are found."""
    stale = "`parallelism.pp_engine` (afab | 1f1b | interleaved_1f1b | zb_h1 | zbv)"
    stray = "every engine (afab, 1f1b, interleaved_1f1b, zb_h1, zbv, dualpipev, gpipe)"
    sources = {"a.md": stale, "b.py": stray, "c.md": "zbv and dualpipev, or 1f1b"}   # c: a mention
    schedules = ["afab", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev"]   # fixed: this tests the check
    found = wrong_lists("schedule", schedules, lists_in(sources))
    assert found == ["a.md:1: afab, 1f1b, interleaved_1f1b, zb_h1, zbv: leaves out dualpipev",
                     "b.py:1: afab, 1f1b, interleaved_1f1b, zb_h1, zbv, dualpipev, gpipe: not schedule's: gpipe"]


def plain_words(text: str) -> str:
    """Lower case, letters and digits only: "ZB-H1" and "zb_h1" alike."""
    return re.sub(r"[^a-z0-9]", "", text.lower())


def test_the_readme_feature_table_names_every_registered_feature():
    """Every schedule, cp kernel, number format, optimizer (but the default) and recompute mode (but none)."""
    table = read("README.md").split("## Features", 1)[1].split("\n## ", 1)[0]
    default_optimizer = OptimizerFactory.name.lower()
    wanted = [*SCHEDULES, *CP_KERNELS, *CONVERTERS, *(name for name in OPTIMIZERS if name != default_optimizer),
              *(mode for mode in RECOMPUTE_MODES if mode != "none")]
    assert [name for name in wanted if plain_words(name) not in plain_words(table)] == []


DIMENSIONS = {"dp": "data", "cp": "context", "ep": "expert", "tp": "tensor", "pp": "pipeline"}


def test_the_description_names_the_layouts_dimensions():
    """pyproject's description and the README's first paragraph: "<N>D parallelism (data, context, ...)"."""
    degrees = {field.name for field in dataclasses.fields(Layout) if re.fullmatch(r"[a-z]p", field.name)}
    assert degrees == set(DIMENSIONS)
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        description = tomllib.load(f)["project"]["description"]
    for where, text in [("pyproject.toml", description), ("README.md", read("README.md").split("\n\n", 2)[1])]:
        match = re.search(r"(\d)D parallelism\s*\(([^)]*)\)", text)
        assert match, where
        words = re.findall(r"[a-z]+", match.group(2).split(";")[0])
        assert int(match.group(1)) == len(DIMENSIONS) and set(words) == set(DIMENSIONS.values()), (where, words)


def test_the_modules_named_in_the_prose_exist():
    """A module named by path (nanoexp/....py) in the README, the docs or the package's prose is a file: one that
    became a package is named as its folder."""
    missing = [f"{path}: {named}" for path, text in texts().items()
               for named in re.findall(r"nanoexp/[\w/]+\.py", text) if not os.path.isfile(os.path.join(REPO, named))]
    assert missing == []


# A test time or count typed beside a pytest command ("pytest -m quick  # 4-5 min"), or a count of tests.
TYPED = re.compile(r"pytest\b.*\d+(?:[.,]\d+)?\s*(?:min\b|minutes|s\b|h\b)|\b\d+ tests\b")


def test_test_times_and_counts_are_the_generated_ones():
    """The README and docs/testing.md quote test times and counts only in docs/testing.md's table, which has the
    form scripts/test_times.py writes when it times the tiers (its --check)."""
    check = subprocess.run([sys.executable, "scripts/test_times.py", "--check"], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    table = re.compile(r"<!-- test-times.*?<!-- /test-times -->", re.S)
    for page in ("README.md", "docs/testing.md"):
        typed = [line for line in table.sub("", read(page)).splitlines() if TYPED.search(line)]
        assert typed == [], page
