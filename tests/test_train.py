"""End-to-end single-process training: loss falls, runs are deterministic, files and fields."""
import json
import os

import pytest
import torch

from nanoexp.parallel.context import ParallelContext
from nanoexp.checks import check_config
from nanoexp.runtime.trainer import Trainer
from tests.helpers import FAST, compose_config, compute_gradients, train, train_losses

STEP_FIELDS = {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "consumed_tokens", "peak_memory_mb",
               "model_tflops_per_sec", "mfu", "data_wait_sec"}
SUMMARY_FIELDS = {"status", "final_loss", "eval_loss", "train_steps", "tokens_per_sec", "mfu", "peak_memory_mb",
                  "wall_seconds", "world_size", "layout", "global_batch_size", "num_parameters", "machine_load"}
RUN = FAST + ["tokens.train_steps=30", "tokens.val_check_interval=15",
              "optimizer.learning_rate_scheduler.learning_rate=3e-3",
              "optimizer.learning_rate_scheduler.lr_warmup_steps=5"]


def test_loss_falls_and_files_are_complete(tmp_path):
    records = train(tmp_path, RUN + ["logging.tensorboard=true"])
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert all(STEP_FIELDS <= set(r) for r in steps)
    assert steps[0]["loss"] > 5.0              # ln(320) = 5.77 at initialisation
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.5
    assert [r["step"] for r in evals] == [15, 30] and evals[-1]["eval_loss"] < evals[0]["eval_loss"] + 0.1
    assert steps[-1]["consumed_tokens"] == 30 * 8 * 32
    assert 0 < steps[0]["lr"] < steps[4]["lr"]  # warm-up
    summary = json.load(open(tmp_path / "summary.json"))
    assert SUMMARY_FIELDS <= set(summary)
    assert summary["status"] == "completed" and summary["layout"] == "dp1tp1pp1" and summary["world_size"] == 1
    assert summary["final_loss"] == steps[-1]["loss"] and summary["eval_loss"] == evals[-1]["eval_loss"]
    assert summary["train_steps"] == 30 and summary["global_batch_size"] == 8
    load = summary["machine_load"]   # before and after: whether the run had the machine to itself
    assert load["cpus"] == os.cpu_count() and load["processes"] == 1 and load["start"] >= 0 and load["end"] >= 0
    # Memory: a true peak per rank above a baseline measured before the model, and what it held.
    assert summary["peak_memory_mb_per_rank"] == [summary["peak_memory_mb"]]
    # Linux keeps each thread's RSS count in a cache it folds in every 64 page faults (up to 256 KB a thread): in a
    # process whose heap already holds room for this run (a long pytest), the peak can read a fraction of a MB
    # below the baseline taken at the reset.
    assert 0 < summary["baseline_memory_mb"] < summary["peak_memory_mb"] + 1
    memory = summary["memory"][0]
    assert memory["parameters_mb"] == memory["gradients_mb"] > 0 and memory["optimizer_mb"] == 2 * memory["parameters_mb"]
    assert memory["micro_batches_in_flight"] == 1 and memory["activations_mb"] == memory["activations_per_micro_batch_mb"] > 0
    assert os.listdir(tmp_path / "tensorboard")
    assert os.path.exists(tmp_path / "logs" / "rank_0.log")


def test_two_runs_are_bitwise_identical(tmp_path):
    a = train_losses(train(tmp_path / "a", RUN[:] + ["tokens.train_steps=8"]))
    b = train_losses(train(tmp_path / "b", RUN[:] + ["tokens.train_steps=8"]))
    assert a == b   # exact float equality: deterministic on CPU for a fixed seed


def first_step_gradients(overrides):
    cfg = compose_config(FAST + overrides)
    check_config(cfg, world_size=1)
    trainer = Trainer(cfg, ParallelContext(), run_dir=os.devnull)
    loss = compute_gradients(trainer, trainer.batches.next_step())
    trainer.batches.close()
    return loss, {name: p.grad.clone() for name, p in trainer.model.named_parameters()}


def test_gradient_accumulation_equivalence():
    """mbs=4 x acc=1 and mbs=1 x acc=4 see the same 4 samples: same loss and gradients."""
    loss_a, grads_a = first_step_gradients(["tokens.global_batch_size=4", "tokens.micro_batch_size=4"])
    loss_b, grads_b = first_step_gradients(["tokens.global_batch_size=4", "tokens.micro_batch_size=1"])
    # float32; only the order of summation over samples differs: ~1e-6 relative.
    assert abs(loss_a - loss_b) < 1e-5
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6)



TINY_HELD_OUT = ["data.validation_fraction=0.00003"]   # ~6 held-out samples of 33 tokens: < one global batch


def test_held_out_set_smaller_than_a_global_batch_is_evaluated_whole(tmp_path):
    """Evaluation reads every held-out sample (the global batch padded with ignored rows) and
    averages over real target tokens only; it equals a plain forward over the same samples."""
    cfg = compose_config(FAST + TINY_HELD_OUT)
    check_config(cfg, world_size=1)
    trainer = Trainer(cfg, ParallelContext(), run_dir=os.devnull)
    trainer.batches.close()
    n = len(trainer.batches.val_set)
    assert 0 < n < trainer.global_batch
    samples = torch.stack([trainer.batches.val_set[i] for i in range(n)])
    with torch.no_grad():
        expected = trainer.model(input_ids=samples[:, :-1], labels=samples[:, 1:]).mean().item()
    # float32; only the order of summation differs (per micro-batch sums, then a float64 total).
    assert trainer.evaluate() == pytest.approx(expected, rel=1e-5)
    # The same on two data-parallel ranks (each holds half of the padded global batch).
    run = FAST + TINY_HELD_OUT + ["tokens.train_steps=2", "tokens.val_check_interval=0"]
    single = [r["eval_loss"] for r in train(tmp_path / "one", run) if "eval_loss" in r]
    dp2 = [r["eval_loss"] for r in train(tmp_path / "dp2", run + ["parallelism=dp2tp1pp1"]) if "eval_loss" in r]
    assert single[0] > 0 and dp2 == pytest.approx(single, rel=1e-5, abs=0)   # as above: summation order only


def test_consumed_tokens_are_counted_across_a_resume_with_another_global_batch(tmp_path):
    run = FAST + ["tokens.val_check_interval=0", "checkpoint.checkpoint_interval=2"]
    train(tmp_path, run + ["tokens.train_steps=2"])   # 2 steps of 8 x 32 tokens
    records = train(tmp_path, run + ["tokens.train_steps=3", "tokens.global_batch_size=16"])   # resumes at step 3
    assert [r["consumed_tokens"] for r in records if "loss" in r] == [256, 512, 512 + 512]
    assert json.load(open(tmp_path / "summary.json"))["consumed_tokens"] == 1024


def test_training_loss_averages_over_real_target_tokens_only():
    """Targets marked IGNORE_INDEX (padding, masked tokens) count nowhere: the step loss and its
    gradients are those of the mean over the real targets of the global batch, however they are
    spread over micro-batches (a per-micro-batch mean would weight them differently)."""
    from nanoexp.data.loader import IGNORE_INDEX
    cfg = compose_config(FAST + ["tokens.global_batch_size=4", "tokens.micro_batch_size=2"])
    check_config(cfg, world_size=1)
    trainer = Trainer(cfg, ParallelContext(), run_dir=os.devnull)
    micro_batches = trainer.batches.next_step()
    trainer.batches.close()
    micro_batches[0]["labels"][:, 5:] = IGNORE_INDEX        # micro-batch 0 keeps 2 x 5 targets,
    micro_batches[1]["labels"][0, :] = IGNORE_INDEX         # micro-batch 1 keeps 32 of its 64
    loss = compute_gradients(trainer, micro_batches)
    got = {name: p.grad.clone() for name, p in trainer.model.named_parameters()}
    trainer.optimizer.zero_grad(set_to_none=True)
    ids = torch.cat([mb["input_ids"] for mb in micro_batches])
    labels = torch.cat([mb["labels"] for mb in micro_batches])
    expected = torch.nn.functional.cross_entropy(trainer.model(input_ids=ids).reshape(-1, 320), labels.reshape(-1),
                                                 ignore_index=IGNORE_INDEX)
    expected.backward()
    # float32, same tokens; only the summation order differs (two micro-batches vs one batch).
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-6)
