"""Write a nanoexp experiment from a nanotron YAML config, listing what cannot be carried over.

    python scripts/import_nanotron_config.py nanotron_config.yaml --name my_run    # -> conf/experiment/my_run.yaml
    python train.py +experiment=my_run [overrides]

Promises (the mapping itself is nanoexp/interop/nanotron.py):
- The experiment holds every nanotron key that has a nanoexp counterpart; every other key is printed and written
  in a comment block at the top of the file with a one-line reason, so nothing is dropped silently.
- A file that is not a nanotron config (not YAML, no `parallelism` or `model` section, a value of the wrong type)
  is refused with one message (exit code 2) and nothing is written; so is an existing experiment without --force.
- The experiment is composed over nanoexp's defaults and checked with `validate` before it is written; what
  `validate` reports (a layout the model does not divide into, ...) is printed as a warning to fix by override.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap

import yaml
from omegaconf import OmegaConf

from nanoexp.config import CONF_DIR, ConfigError, compose
from nanoexp.interop.nanotron import Import, NotANanotronConfig, import_nanotron, read_nanotron_yaml
from nanoexp.validation import validate


def render(imp: Import, source: str, name: str) -> str:
    """The experiment file: how it was made, the comment block of what was not carried over, the overrides."""
    lines = ["# @package _global_",
             f"# Imported from the nanotron config {source} by scripts/import_nanotron_config.py:",
             f"#   python train.py +experiment={name}"]
    for title, items in (("Not carried over (nanotron key = value: why)", imp.dropped),
                         ("Nothing to set: nanoexp already behaves so (nanotron key = value: why)", imp.neutral),
                         ("Notes", imp.notes)):
        if items:
            lines += ["#", f"# {title}:"] + [line for item in items for line in textwrap.wrap(
                item, 116, initial_indent="#   ", subsequent_indent="#       ", break_on_hyphens=False)]
    return "\n".join(lines) + "\n" + yaml.safe_dump(imp.out, sort_keys=False)


def check_experiment(overrides: dict) -> list[str]:
    """What nanoexp's schema and `validate` say about the experiment on top of the defaults (empty: fine)."""
    try:
        cfg = OmegaConf.merge(compose([]), overrides)
        validate(cfg)
    except ConfigError as error:
        return str(error).splitlines()[1:]
    except Exception as error:   # the schema refused a value the mapping produced
        return [f"{type(error).__name__}: {error}".splitlines()[0]]
    return []


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a nanotron YAML config")
    parser.add_argument("--name", required=True, help="the experiment's name: conf/experiment/<name>.yaml")
    parser.add_argument("--out", help="write the experiment here instead of conf/experiment/")
    parser.add_argument("--force", action="store_true", help="replace an existing experiment file")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(CONF_DIR, "experiment", f"{args.name}.yaml")
    try:
        if not re.fullmatch(r"[\w.-]+", args.name):
            raise NotANanotronConfig(f"--name {args.name!r}: use letters, digits, '_', '-' or '.'")
        imp = import_nanotron(read_nanotron_yaml(args.config))
        if os.path.exists(out) and not args.force:
            raise NotANanotronConfig(f"{out} exists: pass --force to replace it")
    except NotANanotronConfig as error:
        print(f"import_nanotron_config: {error}", file=sys.stderr)
        return 2
    problems = check_experiment(imp.out)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(render(imp, args.config, args.name))
    print(f"wrote {out}: python train.py +experiment={args.name}" + ("" if args.out is None else
          f" (once it is in {os.path.join(CONF_DIR, 'experiment')})"))
    for title, items in (("not carried over", imp.dropped), ("notes", imp.notes)):
        print(f"{title}: {'none' if not items else ''}" + "".join(f"\n  {item}" for item in items))
    print(f"nothing to set (nanoexp already behaves so): {', '.join(i.split(' = ')[0] for i in imp.neutral)}")
    for problem in problems:
        print(f"warning: nanoexp's checks say {problem.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
