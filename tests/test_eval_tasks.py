"""The held-out Shakespeare lm-eval tasks (nanoexp/evaluation/tasks): the recipe, the data, and lm-eval itself.

lm-eval runs on fake models (no download): one that scores by length and always writes the same word,
and an oracle that reads the answer from the doc; the oracle must score 1.0, which checks the prompt,
the choices and the target delimiter end to end.
"""

import json
from pathlib import Path

import pytest

from nanoexp.data.corpus import load_builtin_documents, split_train_val
from nanoexp.evaluation.task_recipe import build_tasks
from tests.helpers import require

lm_eval = require("lm_eval")
import lm_eval.evaluator  # noqa: E402
import lm_eval.tasks  # noqa: E402
from lm_eval.api.model import LM  # noqa: E402

TASKS_DIR = Path(__file__).resolve().parent.parent / "nanoexp" / "evaluation" / "tasks"
TASKS = ["shakespeare_choice", "shakespeare_complete"]
UNTIL = [" ", "\n", ",", ".", ";", ":", "!", "?"]


def read_docs(name: str) -> list[dict]:
    with open(TASKS_DIR / f"{name}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def answer(doc: dict) -> str:
    """What the doc asks for: the true choice, or the rest of the last word."""
    return doc["choices"][doc["label"]] if "choices" in doc else doc["target"]


def asked_line(doc: dict) -> str:
    """The held-out line the doc asks about, up to the end of the answer."""
    return doc["context"].split("\n")[-1] + answer(doc)


def test_recipe_reproduces_the_shipped_files(tmp_path):
    build_tasks(tmp_path)   # scripts/build_eval_tasks.py --out-dir tmp_path
    for name in TASKS:
        assert (tmp_path / f"{name}.jsonl").read_bytes() == (TASKS_DIR / f"{name}.jsonl").read_bytes(), name


def test_tasks_folder_is_data_not_a_package():
    assert not (TASKS_DIR / "__init__.py").exists()


def test_docs_come_from_held_out_text_only():
    train, held_out = split_train_val(load_builtin_documents(), 0.05)
    train_text = "\n".join(train)
    held_out_text = "\n".join(line.rstrip() for part in held_out for line in part.split("\n"))
    for name in TASKS:
        docs = read_docs(name)
        assert len(docs) == 500 and len({d["id"] for d in docs}) == 500
        for doc in docs:
            assert doc["context"] + answer(doc) in held_out_text, doc
            assert len(asked_line(doc)) >= 9 and asked_line(doc) not in train_text, doc  # 9: "Go, away."
    for doc in read_docs("shakespeare_choice"):
        choices = doc["choices"]
        assert doc["context"].count("\n") == 1 and not doc["context"].endswith(" ")
        assert len(choices) == len(set(choices)) == 4
        for choice in choices:   # the true second half's words in four orders, each a continuation
            assert choice.startswith(" ") and sorted(choice.split(" ")) == sorted(answer(doc).split(" "))
    for doc in read_docs("shakespeare_complete"):
        line = doc["context"].split("\n")[-1]
        assert doc["context"].count("\n") == 1 and line[-1].isalpha()   # cut inside the last word
        head = line.rsplit(" ", 1)[-1]
        assert doc["target"].isalpha() and len(head) == (len(head) + len(doc["target"])) // 2 >= 2


class LengthModel(LM):
    """Prefers the shortest continuation; always writes the same word."""

    def loglikelihood(self, requests):
        return [(-float(len(r.args[1])), False) for r in requests]

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError

    def generate_until(self, requests):
        return ["thee" for _ in requests]


class OracleModel(LM):
    """Knows the answer of every doc; records the prompts it is given."""

    def __init__(self):
        super().__init__()
        self.prompts = []

    def loglikelihood(self, requests):
        out = []
        for r in requests:
            context, continuation = r.args
            self.prompts.append((context, r.doc))
            right = context.endswith(r.doc["context"]) and continuation == answer(r.doc)
            out.append((0.0 if right else -10.0, right))
        return out

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError

    def generate_until(self, requests):
        out = []
        for r in requests:
            context, kwargs = r.args
            self.prompts.append((context, r.doc))
            assert kwargs["until"] == UNTIL and kwargs["max_gen_toks"] == 16 and kwargs["do_sample"] is False
            out.append(r.doc["target"] if context.endswith(r.doc["context"]) else "")
        return out


@pytest.fixture(scope="module")
def task_manager():
    # include_defaults=False: indexing lm-eval's ~200 built-in task folders takes seconds.
    return lm_eval.tasks.TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def evaluate(model, task_manager, num_fewshot):
    return lm_eval.evaluator.simple_evaluate(
        model=model, tasks=TASKS, task_manager=task_manager, limit=20,
        num_fewshot=num_fewshot, log_samples=False, bootstrap_iters=1,
    )["results"]


def test_lm_eval_runs_from_any_directory(task_manager, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = evaluate(LengthModel(), task_manager, num_fewshot=0)
    choice, complete = results["shakespeare_choice"], results["shakespeare_complete"]
    docs = read_docs("shakespeare_choice")[:20]
    shortest = [min(range(4), key=lambda k: len(d["choices"][k])) for d in docs]
    assert choice["acc,none"] == pytest.approx(sum(s == d["label"] for s, d in zip(shortest, docs)) / 20)
    # Per character every choice scores -1: acc_norm's argmax takes the first choice.
    assert choice["acc_norm,none"] == pytest.approx(sum(d["label"] == 0 for d in docs) / 20)
    docs = read_docs("shakespeare_complete")[:20]
    assert complete["exact_match,none"] == pytest.approx(sum(d["target"] == "thee" for d in docs) / 20)
    for key in ("acc_stderr,none", "acc_norm_stderr,none"):  # mean_stderr: needs bootstrap_iters > 0
        assert 0.0 < choice[key] < 1.0
    assert 0.0 <= complete["exact_match_stderr,none"] < 1.0


def test_oracle_scores_one_zero_shot(task_manager):
    oracle = OracleModel()
    results = evaluate(oracle, task_manager, num_fewshot=0)
    assert results["shakespeare_choice"]["acc,none"] == 1.0
    assert results["shakespeare_choice"]["acc_norm,none"] == 1.0
    assert results["shakespeare_complete"]["exact_match,none"] == 1.0
    assert all(context == doc["context"] for context, doc in oracle.prompts)


def test_oracle_scores_one_with_one_shot_from_other_docs(task_manager):
    oracle = OracleModel()
    results = evaluate(oracle, task_manager, num_fewshot=1)
    assert results["shakespeare_choice"]["acc,none"] == 1.0
    assert results["shakespeare_complete"]["exact_match,none"] == 1.0
    solved = {name: {d["id"]: d["context"] + answer(d) + "\n\n" for d in read_docs(name)} for name in TASKS}
    for context, doc in oracle.prompts:
        examples = solved["shakespeare_choice" if "choices" in doc else "shakespeare_complete"]
        example = context[: -len(doc["context"])]
        # One solved example from another doc, then the doc (fewshot_split: test leaves the doc out).
        assert example in examples.values() and example != examples[doc["id"]], context
