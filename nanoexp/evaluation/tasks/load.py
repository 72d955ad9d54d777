"""Dataset loaders of the held-out Shakespeare tasks: the ``custom_dataset`` hooks of their YAMLs.

lm-eval calls a task's hook with the task's metadata (and any ``dataset_kwargs``) as keyword
arguments; they are not needed here. Each hook reads the .jsonl file next to this one, so loading
needs no network and works from any working directory. The .jsonl files are written by
``scripts/build_eval_tasks.py``.
"""

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def load_jsonl(name: str) -> datasets.DatasetDict:
    """``<name>.jsonl`` of this folder as the single ``test`` split."""
    with open(HERE / f"{name}.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def shakespeare_choice(**_metadata) -> datasets.DatasetDict:
    return load_jsonl("shakespeare_choice")


def shakespeare_complete(**_metadata) -> datasets.DatasetDict:
    return load_jsonl("shakespeare_complete")
