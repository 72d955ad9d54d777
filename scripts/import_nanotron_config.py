"""Write a nanoexp experiment from a nanotron YAML config, listing what cannot be carried over.

    python scripts/import_nanotron_config.py nanotron_config.yaml --name my_run    # -> conf/experiment/my_run.yaml
    python train.py +experiment=my_run [overrides]

Promises (the mapping and the writing are nanoexp/interop/nanotron.py):
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
import sys

from nanoexp.config import CONF_DIR
from nanoexp.interop.nanotron import NotANanotronConfig, write_experiment


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a nanotron YAML config")
    parser.add_argument("--name", required=True, help="the experiment's name: conf/experiment/<name>.yaml")
    parser.add_argument("--out", help="write the experiment here instead of conf/experiment/")
    parser.add_argument("--force", action="store_true", help="replace an existing experiment file")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(CONF_DIR, "experiment", f"{args.name}.yaml")
    try:
        imp, problems = write_experiment(args.config, args.name, out, args.force)
    except NotANanotronConfig as error:
        print(f"import_nanotron_config: {error}", file=sys.stderr)
        return 2
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
