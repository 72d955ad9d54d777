"""The prose agrees with the code. Where the README, docs/*.md or nanoexp's sources (config.py's comments, the
docstrings) list a registry's names, separated by | or commas (schedules, attention and cp kernels, number formats,
optimizers, recompute modes, expert kernels, selective op groups), a list of allowed values (| separated) holds
every registered name and no other, and so does any list of four or more (of three: no other); the README's feature table names
every schedule, cp kernel, number format, optimizer and recompute mode; pyproject's description and the README's
first line name the parallel dimensions Layout has; and the test times quoted are scripts/test_times.py's."""
from __future__ import annotations

import ast
import dataclasses
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
from nanoexp.model.attention import ATTENTION_KERNELS
from nanoexp.model.experts import EXPERT_KERNELS
from nanoexp.model.saved_ops import SAVABLE_OPS
from nanoexp.numerics import fp8  # noqa: F401 - registers its converter
from nanoexp.numerics.converters import CONVERTERS
from nanoexp.optim.registry import OPTIMIZERS
from nanoexp.parallel.context_parallel import CP_KERNELS
from nanoexp.parallel.layout import Layout
from nanoexp.parallel.pipeline.schedules import SCHEDULES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = {"schedule": SCHEDULES, "attention kernel": ATTENTION_KERNELS, "cp kernel": CP_KERNELS,
         "number format": CONVERTERS, "optimizer": OPTIMIZERS, "recompute mode": RECOMPUTE_MODES,
         "expert kernel": EXPERT_KERNELS, "selective op group": SAVABLE_OPS}
# A run of two or more names (each with a letter, maybe in backticks) joined by | (in a Markdown table \|), commas,
# "and" or "or".
NAME, SEPARATOR = r"`?[A-Za-z0-9_]*[A-Za-z][A-Za-z0-9_]*`?", r"(?:[ \t]*(?:\\?\||,)[ \t]*(?:(?:and|or) )?| (?:and|or) )"
LIST = re.compile(rf"{NAME}(?:{SEPARATOR}{NAME})+")
LONG = 4   # a list of this many names of a registry reads as the whole registry (of 3: as a list of its names)


def read(path: str) -> str:
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def texts() -> dict[str, str]:
    """{path: prose} of the README and the docs, and of every module of nanoexp its docstrings and comments."""
    paths = ["README.md"] + sorted(glob.glob("docs/*.md", root_dir=REPO))
    modules = sorted(glob.glob("nanoexp/**/*.py", root_dir=REPO, recursive=True))
    return {**{path: read(path) for path in paths}, **{path: prose_of(read(path)) for path in modules}}


def prose_of(source: str) -> str:
    """A module's docstrings and comments, each on its own lines where it stands (the code's lines blank)."""
    lines = [""] * (source.count("\n") + 2)
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            for offset, line in enumerate(body[0].value.value.splitlines()):
                lines[body[0].lineno + offset] = line
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            lines[token.start[0]] += " " + token.string
    return "\n".join(lines[1:])


def lists(text: str):
    """(line number, the names, whether | separated) of each run of names in `text`; a Markdown table's cells
    apart."""
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("|"):
            line = re.sub(r"(?<!\\)\|", "\t\t", line)
        for match in LIST.finditer(line):
            names = [name.strip("`").lower() for name in re.split(SEPARATOR, match.group(0))]
            yield number, names, "|" in match.group(0)


def wrong_lists(kind: str, registered, sources: dict[str, str]) -> list[str]:
    """Where a list of `kind` names a name that is not registered, or leaves one out."""
    known, wrong = {name.lower() for name in registered}, []
    for path, text in sources.items():
        for number, names, piped in lists(text):
            named = set(names) & known
            if len(named) < 2:   # one name among others is not a list of this kind
                continue
            strangers = [name for name in names if name not in known] if piped or len(named) >= 3 else []
            missing = sorted(known - named) if piped or len(named) >= LONG else []
            if strangers or missing:
                wrong.append(f"{path}:{number}: {', '.join(names)}: "
                             + "; ".join(filter(None, [strangers and f"not a {kind}: {', '.join(strangers)}",
                                                       missing and f"leaves out {', '.join(missing)}"])))
    return wrong


@pytest.mark.parametrize("kind", NAMES)
def test_every_list_of_a_registrys_names_is_the_registrys(kind):
    assert wrong_lists(kind, NAMES[kind], texts()) == []


def test_the_list_finder_finds_stale_and_stray_names():
    """The check itself: a schedule list without dualpipev, and one with a name never registered, are found."""
    stale = "`parallelism.pp_engine` (afab | 1f1b | interleaved_1f1b | zb_h1 | zbv)"
    stray = "every engine (afab, 1f1b, interleaved_1f1b, zb_h1, zbv, dualpipev, gpipe)"
    found = wrong_lists("schedule", SCHEDULES, {"a.md": stale, "b.py": stray, "c.md": "zbv and dualpipev, or 1f1b"})
    assert found == ["a.md:1: afab, 1f1b, interleaved_1f1b, zb_h1, zbv: leaves out dualpipev",
                     "b.py:1: afab, 1f1b, interleaved_1f1b, zb_h1, zbv, dualpipev, gpipe: not a schedule: gpipe"]


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
    """The README and docs/testing.md quote test times and counts only in docs/testing.md's table, which is
    scripts/test_times.py's rendering (it writes the table when it times the tiers)."""
    check = subprocess.run([sys.executable, "scripts/test_times.py", "--check"], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    table = re.compile(r"<!-- test-times.*?<!-- /test-times -->", re.S)
    for page in ("README.md", "docs/testing.md"):
        typed = [line for line in table.sub("", read(page)).splitlines() if TYPED.search(line)]
        assert typed == [], page
