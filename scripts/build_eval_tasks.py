"""Build the two held-out Shakespeare tasks for lm-evaluation-harness (the .jsonl files next to their YAMLs).

    python scripts/build_eval_tasks.py            # writes nanoexp/evaluation/tasks/*.jsonl

The recipe (which lines, how the choices and targets are drawn, why the files are byte-identical on every run)
is nanoexp/evaluation/task_recipe.py's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nanoexp.evaluation.task_recipe import TASKS_DIR, build_tasks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=TASKS_DIR)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--count", type=int, default=500, help="docs per task")
    args = parser.parse_args(argv)
    for path, docs in build_tasks(args.out_dir, args.seed, args.count):
        print(f"{path}: {docs} docs")


if __name__ == "__main__":
    main()
