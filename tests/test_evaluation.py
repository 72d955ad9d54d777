"""Downstream evaluation (nanoexp/evaluation/): the scorer against the model's own log-softmax, the same scores on
every layout, in the training loop, offline, from the Hugging Face export through the harness's `hf` model, the
start-up checks, and the sweep report ranking by a task's score.

Tolerances: log-likelihoods are sums of float32 log-probabilities, in float64; another layout reduces in another
order (measured on the default run's checkpoint at most 4.5e-7 relative, cp2), as does transformers' Llama
(2.5e-7): 1e-5 relative. Accuracies, greedy flags and generations are compared for equality.
"""
import contextlib
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nanoexp.runtime.build import load_single_process
from nanoexp.data.tokenizer import build_tokenizer
from nanoexp.evaluation.downstream import flatten
from nanoexp.evaluate import evaluate_checkpoint
from nanoexp.evaluation.scorer import ShardedScorer
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.pipeline import PipelineEngine
from nanoexp.runtime.step import StepRunner
from tests.helpers import FAST, compose_config, read_metrics, require, start_error, train

require("lm_eval")
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402
from nanoexp.evaluation.harness import NanoexpLM  # noqa: E402 - needs the harness

TASKS = ["shakespeare_choice", "shakespeare_complete"]
LOGPROB_RTOL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small model trained 20 steps on one process, with the shipped tasks in the loop every 10 steps."""
    run = tmp_path_factory.mktemp("evaluation")
    train(run, FAST + ["tokens.train_steps=20", "tokens.val_check_interval=0", "eval=shakespeare", "eval.interval=10",
                       "eval.limit=8"])
    return run


def harness_model(folder: str, batch_size: int = 3) -> tuple[NanoexpLM, object]:
    model, cfg = load_single_process(folder)
    tokenizer = build_tokenizer(cfg.tokenizer.tokenizer_name_or_path)
    ctx = ParallelContext()
    runner = StepRunner(model, ctx, PipelineEngine(ctx, "1f1b", 1), contextlib.nullcontext(),
                        cfg.tokens.micro_batch_size, cfg.tokens.sequence_length)
    scorer = ShardedScorer(runner, tokenizer.eod_id)
    return NanoexpLM(scorer, tokenizer, batch_size=batch_size), model


@torch.no_grad()
def direct_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, from one forward of the whole model."""
    logits = model(input_ids=torch.tensor([ids[:-1]]))[0].float()
    return F.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].double()


@pytest.mark.slow
def test_loglikelihoods_are_the_models_own(checkpoint):
    """Each (context, continuation): the sum of the continuation's log-probabilities and whether greedy decoding
    gives it, as the model's log-softmax says; an empty context starts from the end-of-document token; a long
    one keeps its last sequence_length tokens; a rolling log-likelihood scores every token, the first given the
    end-of-document token."""
    lm, model = harness_model(str(checkpoint / "checkpoints" / "20"))
    requests = [("To be, or not to be,", " that is the question"), ("", "Hello"), ("ROMEO:\n", "But soft!"),
                ("x" * 300, "abc"), ("KING ", "KING ")]
    ours = lm.loglikelihood([SimpleNamespace(args=r) for r in requests])
    for (context, continuation), (logprob, greedy) in zip(requests, ours):
        head, tail = lm.encode_pair(context, continuation)
        ids = (head + tail)[-(lm.max_length + 1):]
        expected = direct_logprobs(model, ids)[-len(tail):]
        assert logprob == pytest.approx(expected.sum().item(), rel=LOGPROB_RTOL)
        with torch.no_grad():
            argmax = model(input_ids=torch.tensor([ids[:-1]]))[0].argmax(-1)[-len(tail):]
        assert greedy == bool((argmax == torch.tensor(ids[-len(tail):])).all())
    short, long = "Now is the winter", "Now is the winter of our discontent made glorious summer"
    rolling = lm.loglikelihood_rolling([SimpleNamespace(args=(short,)), SimpleNamespace(args=(long,))])
    ids = [lm.tokenizer.eod_id] + lm.tokenizer.encode(short)   # one window
    assert rolling[0] == pytest.approx(direct_logprobs(model, ids).sum().item(), rel=LOGPROB_RTOL)
    windows = get_rolling_token_windows(token_list=lm.tokenizer.encode(long), prefix_token=lm.tokenizer.eod_id,
                                        max_seq_len=lm.max_length, context_len=1)   # several: the harness's rule
    expected = sum(direct_logprobs(model, context + tokens)[-len(tokens):].sum().item()
                   for context, tokens in map(make_disjoint_window, windows))
    assert rolling[1] == pytest.approx(expected, rel=LOGPROB_RTOL)


def test_generation_is_greedy_and_stops_at_until(checkpoint):
    lm, model = harness_model(str(checkpoint / "checkpoints" / "20"))
    context = "ROMEO:\nBut soft! what light"
    text, = lm.generate_until([SimpleNamespace(args=(context, {"until": [], "max_gen_toks": 6}))])
    ids = lm.tokenizer.encode(context)
    for _ in range(6):   # the same six tokens, one greedy step at a time
        with torch.no_grad():
            ids.append(int(model(input_ids=torch.tensor([ids]))[0, -1].argmax()))
    assert text == lm.tokenizer.decode(ids[-6:])
    stop = text[2] if len(set(text)) > 1 else text[0]
    cut, = lm.generate_until([SimpleNamespace(args=(context, {"until": [stop], "max_gen_toks": 6}))])
    assert cut == text.split(stop)[0]


def task_documents(task: str, limit: int) -> list[dict]:
    """The first `limit` documents of a shipped task (those lm-eval's limit scores)."""
    from nanoexp.evaluation.downstream import SHIPPED_TASKS
    with open(SHIPPED_TASKS / f"{task}.jsonl") as f:
        return [json.loads(line) for line in f][:limit]


def test_in_the_loop_scores_reach_metrics_and_summary(checkpoint, one_process_scores):
    """The scores of every evaluation reach metrics.jsonl, and those of step 20 are its checkpoint's, computed
    another way: the choice task's accuracies from the model's own log-softmax, the exact matches from the
    offline scoring's generations (which the test of the Hugging Face export holds to the harness's `hf`)."""
    records = [r for r in read_metrics(checkpoint) if "eval/seconds" in r]
    assert [r["step"] for r in records] == [10, 20]   # every eval.interval steps and at the end
    limit = 8   # eval.limit of the run
    for record in records:   # lm-eval's standard error of a mean of `limit` 0/1 scores p: sqrt(p (1 - p) / (n - 1))
        for key in ("shakespeare_choice/acc", "shakespeare_choice/acc_norm", "shakespeare_complete/exact_match"):
            p = record[f"eval/{key}"]
            assert record[f"eval/{key}_stderr"] == pytest.approx(math.sqrt(p * (1 - p) / (limit - 1)), rel=1e-9), key
    lm, model = harness_model(str(checkpoint / "checkpoints" / "20"))
    correct, correct_norm = [], []
    for doc in task_documents("shakespeare_choice", limit):
        logprobs = []
        for choice in doc["choices"]:   # zero-shot: the context, then the choice (it starts with its space)
            head, tail = lm.encode_pair(doc["context"], choice)
            logprobs.append(direct_logprobs(model, (head + tail)[-(lm.max_length + 1):])[-len(tail):].sum().item())
        correct.append(int(np.argmax(logprobs)) == doc["label"])   # acc_norm: per character of the choice
        correct_norm.append(int(np.argmax([lp / len(c) for lp, c in zip(logprobs, doc["choices"])])) == doc["label"])
    generations = dict(one_process_scores["samples"]["shakespeare_complete"])   # eval.limit=12: the first 8 too
    matches = [generations[i][0] == doc["target"] for i, doc in enumerate(task_documents("shakespeare_complete",
                                                                                          limit))]
    assert records[-1]["eval/shakespeare_choice/acc"] == pytest.approx(np.mean(correct), abs=1e-12)
    assert records[-1]["eval/shakespeare_choice/acc_norm"] == pytest.approx(np.mean(correct_norm), abs=1e-12)
    assert records[-1]["eval/shakespeare_complete/exact_match"] == pytest.approx(np.mean(matches), abs=1e-12)
    summary = json.loads((checkpoint / "summary.json").read_text())
    assert summary["eval/shakespeare_choice/acc"] == records[-1]["eval/shakespeare_choice/acc"]
    log = (checkpoint / "logs" / "rank_0.log").read_text()
    assert "step 20/20 | shakespeare_choice: acc" in log and "step 20/20 | shakespeare_complete: exact_match" in log


@pytest.mark.slow
def test_in_the_loop_on_a_pipeline_scores_as_one_process(checkpoint, tmp_path):
    """The same run on pp2 (2 processes, each calling the harness): the same scores in its metrics at every
    evaluation (the run trains the same model, its log-likelihoods within 1e-5 of one process's)."""
    records = train(tmp_path, FAST + ["tokens.train_steps=20", "tokens.val_check_interval=0", "eval=shakespeare",
                                      "eval.interval=10", "eval.limit=8", "parallelism=dp1tp1pp2"])
    ours = [{k: v for k, v in r.items() if k.count("/") == 2} for r in records if "eval/seconds" in r]
    expected = [{k: v for k, v in r.items() if k.count("/") == 2} for r in read_metrics(checkpoint)
                if "eval/seconds" in r]
    assert len(ours) == 2 and ours == expected


def compare_samples(ours: dict, reference: dict) -> None:
    """Per document: each choice's log-likelihood within LOGPROB_RTOL and the same greedy flag; generations equal."""
    for task, docs in reference.items():
        mine = dict((doc, responses) for doc, responses in ours[task])
        for doc, responses in docs:
            if task == "shakespeare_choice":
                for (a, greedy_a), (b, greedy_b) in zip(mine[doc], responses):
                    assert a == pytest.approx(b, rel=LOGPROB_RTOL) and greedy_a == greedy_b, (task, doc)
            else:
                assert mine[doc] == responses, (task, doc)


@pytest.fixture(scope="module")
def one_process_scores(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("scores") / "one.json"
    return evaluate_checkpoint(str(checkpoint / "checkpoints" / "20"), ["eval.tasks=[shakespeare_choice,"
                               "shakespeare_complete]", "eval.limit=12"], str(out), samples=True)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallelism.dp=2"], ["parallelism.tp=2"], ["parallelism.pp=2"],
                                    ["parallelism.cp=2"]], ids=["dp2", "tp2", "pp2", "cp2"])
def test_every_layout_scores_the_checkpoint_alike(layout, checkpoint, one_process_scores, tmp_path):
    # eval.batch_size=5: calls of 5 rows, which dp2 splits 3 + 2 and pads to micro-batches of 2 (a first version
    # gathered the padding in place of rows)
    ours = evaluate_checkpoint(str(checkpoint / "checkpoints" / "20"), [
        "eval.tasks=[shakespeare_choice,shakespeare_complete]", "eval.limit=12", "eval.batch_size=5", *layout],
        str(tmp_path / "s.json"), samples=True)
    assert ours["layout"] != one_process_scores["layout"]
    compare_samples(ours["samples"], one_process_scores["samples"])
    for key, value in one_process_scores["scores"].items():
        assert ours["scores"][key] == pytest.approx(value, rel=1e-9), key


def test_the_hugging_face_export_scores_alike_through_the_harness(checkpoint, tmp_path):
    """lm-eval's own `hf` model on the exported folder: the same accuracies, log-likelihoods within 1e-5, the same
    generations. Both read 128 tokens (the harness's model refuses a continuation longer than its max_length, and
    some choices are longer than the 32 tokens this model trained on; its positions reach 1024)."""
    from lm_eval.evaluator import simple_evaluate

    from nanoexp.evaluation.downstream import environment, task_manager
    from nanoexp.interop.hf_checkpoint import convert_to_hf
    ours = evaluate_checkpoint(str(checkpoint / "checkpoints" / "20"), [
        "eval.tasks=[shakespeare_choice,shakespeare_complete]", "eval.limit=12", "tokens.sequence_length=128"],
        str(tmp_path / "ours.json"), samples=True)
    convert_to_hf(str(checkpoint / "checkpoints" / "20"), str(tmp_path / "hf"))
    with environment(TQDM_DISABLE="1"):
        results = simple_evaluate(model="hf", model_args=f"pretrained={tmp_path / 'hf'},max_length=128,dtype=float32",
                                  tasks=TASKS, limit=12, task_manager=task_manager(None, tuple(TASKS)),
                                  log_samples=True, bootstrap_iters=1000, device="cpu", batch_size=4,
                                  verbosity="ERROR")
    hf = {task: [[s["doc_id"], s["filtered_resps"]] for s in docs] for task, docs in results["samples"].items()}
    compare_samples(ours["samples"], hf)
    for key, value in flatten(results["results"]).items():
        assert ours["scores"][key] == pytest.approx(value, rel=1e-9), key


def test_a_folder_of_ones_own_tasks(checkpoint, tmp_path):
    """eval.include_path: a task YAML of one's own (here the shipped choice task under another name)."""
    from nanoexp.evaluation.downstream import SHIPPED_TASKS
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "load.py").write_text((SHIPPED_TASKS / "load.py").read_text().replace(
        "Path(__file__).resolve().parent", f"Path({str(SHIPPED_TASKS)!r})"))
    (folder / "mine.yaml").write_text((SHIPPED_TASKS / "shakespeare_choice.yaml").read_text().replace(
        "task: shakespeare_choice", "task: my_choice"))
    scores = evaluate_checkpoint(str(checkpoint / "checkpoints" / "20"), [
        "eval.tasks=[my_choice,shakespeare_choice]", f"eval.include_path={folder}", "eval.limit=4"],
        str(tmp_path / "s.json"), samples=True)
    # the same task under another name: the same log-likelihoods, document by document, and the same scores
    assert scores["samples"]["my_choice"] == scores["samples"]["shakespeare_choice"]
    mine = {key.replace("my_choice", "shakespeare_choice"): value for key, value in scores["scores"].items()
            if key.startswith("eval/my_choice/")}
    assert mine == {key: value for key, value in scores["scores"].items() if key.startswith("eval/shakespeare_choice/")}
    assert len(mine) == 4   # acc, acc_norm and their standard errors


@pytest.mark.slow
@pytest.mark.parametrize("overrides, message", [
    (["eval.tasks=[no_such_task]"], "eval.tasks: no_such_task is not a task of lm-eval"),
    (["eval.tasks=[shakespeare_choice]", "eval.include_path=/no/such/folder"],
     "eval.include_path=/no/such/folder: no such folder"),
    (["eval.interval=-1"], "eval.interval=-1: must be >= 0"),
])
def test_a_bad_eval_config_is_named_before_any_work(overrides, message):
    assert message in start_error(compose_config(overrides))


def test_more_shots_than_documents_is_named_before_any_work():
    """The shipped tasks draw few-shot examples from their 500 test documents, leaving the current one out."""
    assert "eval.num_fewshot=500: shakespeare_choice has 500 documents to draw 500 few-shot examples from" in \
        start_error(compose_config(["eval.tasks=[shakespeare_choice]", "eval.num_fewshot=500"]))
    assert "eval.num_fewshot" not in start_error(compose_config(["eval.tasks=[shakespeare_choice]",
                                                                 "eval.num_fewshot=499", "tokens.train_steps=0"]))


def failing_task_folder(tmp_path):
    """A task of one's own whose scoring raises (after its forwards: the start-up checks cannot see it)."""
    from nanoexp.evaluation.downstream import SHIPPED_TASKS
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "load.py").write_text((SHIPPED_TASKS / "load.py").read_text().replace(
        "Path(__file__).resolve().parent", f"Path({str(SHIPPED_TASKS)!r})")
        + "\n\ndef boom(doc, results):\n    raise RuntimeError('this scoring is broken')\n")
    (folder / "broken.yaml").write_text((SHIPPED_TASKS / "shakespeare_choice.yaml").read_text().replace(
        "task: shakespeare_choice", "task: broken_choice") + "process_results: !function load.boom\n")
    return folder


@pytest.mark.parametrize("on_error", ["continue", "stop", "stop-async"])
def test_a_failing_task_loses_no_checkpoint(tmp_path, on_error):
    """A task that raises in the loop: the step's checkpoint is already written; with eval.on_error=continue it is
    logged with its task and step, the other task scores and training goes on; with stop the run ends saying so,
    after publishing the checkpoint that checkpoint.async_save is writing in the background."""
    run = FAST + ["tokens.train_steps=4", "tokens.val_check_interval=0", "eval.tasks=[broken_choice,shakespeare_choice]",
                  "eval.interval=2", "eval.limit=4", "checkpoint.checkpoint_interval=2",
                  f"eval.include_path={failing_task_folder(tmp_path)}", f"eval.on_error={on_error.split('-')[0]}"]
    if on_error == "stop-async":
        run += ["checkpoint.async_save=true"]
    if on_error.startswith("stop"):
        with pytest.raises(RuntimeError, match="step 2: downstream task broken_choice failed: RuntimeError: this "
                                               "scoring is broken"):
            train(tmp_path / "run", run)
        assert (tmp_path / "run" / "checkpoints" / "latest.txt").read_text().strip() == "2"
        return
    records = train(tmp_path / "run", run)
    assert [r["step"] for r in records if "eval/shakespeare_choice/acc" in r] == [2, 4]
    assert not any("eval/broken_choice/acc" in r for r in records)
    assert "step 2: downstream task broken_choice failed: RuntimeError: this scoring is broken" in \
        (tmp_path / "run" / "logs" / "rank_0.log").read_text()
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["2", "4", "latest.txt"]


def test_without_the_harness_a_config_with_tasks_says_what_to_install(monkeypatch):
    import nanoexp.checks
    monkeypatch.setattr(nanoexp.checks, "harness_installed", lambda: False)
    assert "pip install -e '.[eval]'" in start_error(compose_config(["eval.tasks=[shakespeare_choice]"]))


def fake_job(folder, number: int, lr: float, eval_loss: float, acc: float) -> None:
    job = folder / str(number)
    (job / ".hydra").mkdir(parents=True)
    cfg = {"parallelism": {"dp": 1, "tp": 1, "pp": 1}, "optimizer": {"learning_rate_scheduler": {"learning_rate": lr}},
           "model": {"model_config": {"hidden_size": 64}}}
    (job / ".hydra" / "config.yaml").write_text(json.dumps(cfg))
    overrides = [f"optimizer.learning_rate_scheduler.learning_rate={lr}"]
    (job / ".hydra" / "overrides.yaml").write_text(json.dumps(overrides))
    (job / "summary.json").write_text(json.dumps({"status": "completed", "eval_loss": eval_loss,
                                                  "eval/shakespeare_choice/acc": acc,
                                                  "eval/shakespeare_choice/acc_stderr": 0.01}))


@pytest.mark.slow
def test_the_sweep_report_ranks_by_a_tasks_score(tmp_path):
    """Ranked by eval loss the lowest wins; by a task's accuracy the highest: another job here. Rows stay in job
    order; the rank column and the line under the table say who won by what."""
    def summarize_sweep(*args) -> str:
        script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "summarize_sweep.py")
        result = subprocess.run([sys.executable, script, str(tmp_path / "sweep"), *args], capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        return result.stdout

    for number, (lr, loss, acc) in enumerate([(1e-3, 2.0, 0.40), (3e-3, 1.9, 0.35), (1e-2, 2.2, 0.45)]):
        fake_job(tmp_path / "sweep", number, lr, loss, acc)
    by_loss = summarize_sweep("--no-plots")
    by_acc = summarize_sweep("--rank-by", "eval/shakespeare_choice/acc")
    assert [line.split()[:2] for line in by_loss.splitlines()[1:4]] == [["0", "2"], ["1", "1"], ["2", "3"]]
    assert [line.split()[:2] for line in by_acc.splitlines()[1:4]] == [["0", "2"], ["1", "3"], ["2", "1"]]
    assert "rank: by eval/shakespeare_choice/acc, highest first (rows in job order)" in by_acc
    assert "0.003 (2^-8.38)" in by_loss and "0.01 (2^-6.64)" in by_acc   # the best learning rate follows
    assert os.path.exists(tmp_path / "sweep" / "lr_transfer.png")
    import csv
    with open(tmp_path / "sweep" / "summary.csv") as f:   # every job's learning rate, score and rank by the score
        rows = [(row["job"], float(row["lr"]), float(row["eval/shakespeare_choice/acc"]), row["rank"])
                for row in csv.DictReader(f)]
    assert rows == [("0", 1e-3, 0.40, "2"), ("1", 3e-3, 0.35, "3"), ("2", 1e-2, 0.45, "1")]
