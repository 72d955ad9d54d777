"""The contract: every dp x cp x tp x pp layout trains the same model as one process.

Runs are float32 on CPU/gloo with the same seed and global batch; only the order of
reductions differs between layouts, so first-step losses and gradients agree to float32
rounding, and later losses drift only as far as AdamW amplifies that rounding.
"""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch

from nanoexp.model.placement import placement
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.checks import check_config
from nanoexp.runtime.trainer import Trainer
from tests.distributed import run_distributed
from tests.helpers import FAST, compose_config, compute_gradients, tiered, train, train_losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ["tokens.train_steps=10", "tokens.val_check_interval=0", "optimizer.learning_rate_scheduler.learning_rate=1e-3",
         "optimizer.learning_rate_scheduler.lr_warmup_steps=2"]
TIED = ["model.model_config.tie_word_embeddings=true"]
# Two chunks per pp rank: with FAST's 4 layers and pp=2, each chunk holds one layer.
INTERLEAVED = ["parallelism.pp_engine=interleaved_1f1b", "parallelism.pp_virtual_stages=2"]

# First step: identical weights and samples, only reduction order differs -> float32 rounding.
FIRST_STEP_ATOL = 1e-5
# Later steps: AdamW amplifies the rounding differences step by step; measured drift after 10
# steps at lr 1e-3 is ~1e-6 in loss, so 1e-4 leaves room while catching any real bug.
LATER_STEP_ATOL = 1e-4
# The gradient norm (before clipping) is where a wrong gradient shows: AdamW and clipping at 1.0 hide a wrongly
# scaled one from the loss (a dp sum instead of a mean moves it by 1.1e-4, tests/test_bf16_parity.py), not from
# the norm (2x). First step: reduction order only, measured at most 1.3e-7 relative (2 float32 ulps of a norm near
# 4); the steps after it compound that through AdamW: at most 2.4e-7 over 71 curves (every layout, ZeRO stage and
# resume across layouts compared here and in tests/test_zero.py, test_checkpoint.py, test_moe.py, test_sweep.py,
# test_torchrun.py). Both tolerances are 4x the measured figure.
FIRST_STEP_GRAD_NORM_RTOL = 5e-7
GRAD_NORM_RTOL = 1e-6

# The parity matrix: all eight layouts with dp, tp, pp in {1, 2}, plus pp4 and dp4, each
# engine where pp > 1, each tp mode where tp > 1, ZeRO-1 and tied embeddings across stages.
CASES = {
    "dp2tp1pp1": ["parallelism=dp2tp1pp1"],
    "dp1tp2pp1-all_reduce": ["parallelism=dp1tp2pp1"],
    "dp1tp2pp1-reduce_scatter": ["parallelism=dp1tp2pp1", "parallelism.tp_mode=reduce_scatter"],
    "dp1tp1pp2-1f1b": ["parallelism=dp1tp1pp2"],
    "dp1tp1pp2-afab": ["parallelism=dp1tp1pp2", "parallelism.pp_engine=afab"],
    "dp2tp2pp1-reduce_scatter": ["parallelism=dp2tp2pp1", "parallelism.tp_mode=reduce_scatter"],
    "dp2tp1pp2-afab-zero1": ["parallelism=dp2tp1pp2", "parallelism.pp_engine=afab", "optimizer.zero_stage=1"],
    "dp1tp2pp2-1f1b": ["parallelism=dp1tp2pp2"],
    "dp2tp2pp2-1f1b-reduce_scatter": ["parallelism=dp2tp2pp2", "parallelism.tp_mode=reduce_scatter"],
    "dp1tp1pp4-1f1b": ["parallelism=dp1tp1pp4"],
    "dp4tp1pp1-zero1": ["parallelism=dp4tp1pp1", "optimizer.zero_stage=1"],
    "dp1tp1pp2-interleaved": ["parallelism=dp1tp1pp2"] + INTERLEAVED,
    "dp2tp1pp2-interleaved": ["parallelism=dp2tp1pp2"] + INTERLEAVED,
}
# Context parallelism (FAST: 32 tokens, 4 heads / 2 KV heads): each cp rank holds two of 2·cp chunks of every
# sample, ring attention merges the blocks by log-sum-exp (SDPA sums in another order) and losses and gradients
# are summed over dp x cp: rounding only, so the tolerances above apply unchanged. Measured over the 10 steps:
# at most 9.5e-7 from the one-process losses (2 float32 ulps of a loss near 5), the first step included.
CP_CASES = {
    "dp1cp2tp1pp1": ["parallelism=dp1cp2tp1pp1"],
    "dp1cp4tp1pp1": ["parallelism=dp1cp4tp1pp1"],
    "dp2cp2tp1pp1-zero1": ["parallelism=dp2cp2tp1pp1", "optimizer.zero_stage=1"],
    "dp1cp2tp2pp1-reduce_scatter": ["parallelism=dp1cp2tp2pp1", "parallelism.tp_mode=reduce_scatter"],
    "dp1cp2tp1pp2-1f1b": ["parallelism=dp1cp2tp1pp2"],
    "dp1cp2tp1pp2-interleaved": ["parallelism=dp1cp2tp1pp2"] + INTERLEAVED,
    "dp2cp2tp2pp1-recompute": ["parallelism=dp2cp2tp2pp1", "parallelism.recompute_layer=true"],
    "dp1cp2tp2pp2-reduce_scatter": ["parallelism=dp1cp2tp2pp2", "parallelism.tp_mode=reduce_scatter"],
    # cp_mode=all_gather: the same blocks after one all-gather of K/V, merged in another order than the ring's;
    # measured at most 9.5e-7 from the one-process losses too (both cases, all 10 steps)
    "dp1cp2tp1pp1-all_gather": ["parallelism=dp1cp2tp1pp1", "parallelism.cp_mode=all_gather"],
    "dp1cp2tp2pp2-reduce_scatter-all_gather": ["parallelism=dp1cp2tp2pp2", "parallelism.tp_mode=reduce_scatter",
                                               "parallelism.cp_mode=all_gather"],
}
TIED_CASES = {
    "tied-dp1tp2pp2-afab": ["parallelism=dp1tp2pp2", "parallelism.pp_engine=afab"],
    "tied-dp2tp1pp2-1f1b": ["parallelism=dp2tp1pp2"],
    "tied-dp1tp2pp2-interleaved": ["parallelism=dp1tp2pp2"] + INTERLEAVED,
    "tied-dp1cp2tp1pp2-1f1b": ["parallelism=dp1cp2tp1pp2"],
}

# µP with m = 64 / 16 = 4: its init, per-group learning rates (torch AdamW and ZeRO-1) and
# multipliers come from global shapes, so every layout still trains the one-process model.
MUP = ["model.parametrization=mup", "model.mup.base_width=16"]
MUP_CASES = {
    "mup-dp2tp2pp2-reduce_scatter-zero1": ["parallelism=dp2tp2pp2", "parallelism.tp_mode=reduce_scatter",
                                           "optimizer.zero_stage=1"],
    "mup-tied-dp1tp2pp2-afab": TIED + ["parallelism=dp1tp2pp2", "parallelism.pp_engine=afab"],
    # µP's attention scale reaches ring attention; ZeRO-1 shards over the cp ranks alone.
    "mup-dp1cp2tp2pp1-reduce_scatter-zero1": ["parallelism=dp1cp2tp2pp1", "parallelism.tp_mode=reduce_scatter",
                                              "optimizer.zero_stage=1"],
}


# model.attention_mask=document on data with many document boundaries (short documents in a Nanoset).
DOCUMENT_CASES = {
    "document-dp1tp2pp2-reduce_scatter-recompute": ["parallelism=dp1tp2pp2", "parallelism.tp_mode=reduce_scatter",
                                                    "parallelism.recompute_layer=true"],
    "document-dp2tp1pp2-interleaved": ["parallelism=dp2tp1pp2"] + INTERLEAVED,
    # under cp documents cross the chunks and ranks; recomputation re-runs ring attention with them
    "document-dp1cp4tp1pp1": ["parallelism=dp1cp4tp1pp1"],
    "document-dp1cp2tp2pp1-reduce_scatter-recompute": ["parallelism=dp1cp2tp2pp1", "parallelism.tp_mode=reduce_scatter",
                                                       "parallelism.recompute_layer=true"],
    "document-dp1cp4tp1pp1-all_gather": ["parallelism=dp1cp4tp1pp1", "parallelism.cp_mode=all_gather"],
}


@pytest.fixture
def reference(train_once):
    """The one-process run of FAST + STEPS, untied or tied: trained once per test session (tests/conftest.py)."""
    return lambda kind: train_once(FAST + STEPS + (TIED if kind == "tied" else []))[1]


def eval_losses(records) -> list[float]:
    return [r["eval_loss"] for r in records if "eval_loss" in r]


def by_step(records, key: str) -> dict[int, float]:
    """{step: value} of the training records; a resumed run repeats steps, its later lines win."""
    return {r["step"]: r[key] for r in records if "loss" in r}


def assert_same_steps(records, expected_records, steps=None):
    """Step by step (every step of `records`, or `steps`), the training loss and the gradient norm of the
    expected run's same step; step 1 (identical weights and samples) to rounding."""
    losses, norms = by_step(records, "loss"), by_step(records, "grad_norm")
    expected_losses, expected_norms = by_step(expected_records, "loss"), by_step(expected_records, "grad_norm")
    steps = sorted(losses) if steps is None else list(steps)
    assert steps and set(steps) <= set(losses) and set(steps) <= set(expected_losses), (steps, sorted(losses))
    if 1 in steps:
        assert abs(losses[1] - expected_losses[1]) < FIRST_STEP_ATOL, (losses[1], expected_losses[1])
        np.testing.assert_allclose(norms[1], expected_norms[1], rtol=FIRST_STEP_GRAD_NORM_RTOL, atol=0,
                                   err_msg="grad_norm of step 1")
    np.testing.assert_allclose([losses[s] for s in steps], [expected_losses[s] for s in steps],
                               atol=LATER_STEP_ATOL, rtol=0, err_msg=f"loss at steps {steps}")
    np.testing.assert_allclose([norms[s] for s in steps], [expected_norms[s] for s in steps],
                               rtol=GRAD_NORM_RTOL, atol=0, err_msg=f"grad_norm at steps {steps}")


def assert_same_curve(records, expected_records, steps: int = 10):
    """Every step's training loss and gradient norm, and the final eval loss (evaluated on the same samples)."""
    assert len(train_losses(records)) == len(train_losses(expected_records)) == steps
    assert_same_steps(records, expected_records)
    assert len(eval_losses(expected_records)) == 1
    np.testing.assert_allclose(eval_losses(records), eval_losses(expected_records), atol=LATER_STEP_ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", tiered(CASES, quick=["dp2tp2pp2-1f1b-reduce_scatter"]))
def test_layout_reproduces_single_process_losses(name, reference, tmp_path):
    assert_same_curve(train(tmp_path, FAST + STEPS + CASES[name]), reference("untied"))


@pytest.mark.parametrize("name", tiered(CP_CASES, quick=["dp1cp2tp1pp2-interleaved"]))
def test_context_parallel_layout_reproduces_single_process_losses(name, reference, tmp_path):
    assert_same_curve(train(tmp_path, FAST + STEPS + CP_CASES[name]), reference("untied"))


@pytest.mark.parametrize("name", tiered(TIED_CASES, quick=["tied-dp2tp1pp2-1f1b"]))
def test_tied_embeddings_across_stages(name, reference, tmp_path):
    assert_same_curve(train(tmp_path, FAST + STEPS + TIED + TIED_CASES[name]), reference("tied"))


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """The overrides of a document-masked run on short documents, and its single-process metrics."""
    from tests.data_files import random_documents
    from tests.test_nanoset import write_nanoset

    root = tmp_path_factory.mktemp("documents")
    folder = write_nanoset(root / "short", random_documents(300, seed=5))
    run = FAST + STEPS + ["model.attention_mask=document", "data=nanoset", f"data.dataset_folder=[{folder}]"]
    return run, train(root / "reference", run)


@pytest.mark.slow
@pytest.mark.parametrize("name", tiered(DOCUMENT_CASES, quick=["document-dp1cp4tp1pp1"]))
def test_document_masking_on_a_layout_reproduces_single_process_losses(name, documents, tmp_path):
    run, expected = documents
    assert_same_curve(train(tmp_path, run + DOCUMENT_CASES[name]), expected)


@pytest.mark.slow
@pytest.mark.parametrize("name", tiered(MUP_CASES, quick=["mup-dp1cp2tp2pp1-reduce_scatter-zero1"]))
def test_mup_layout_reproduces_single_process_losses(name, train_once, tmp_path):
    records = train(tmp_path, FAST + STEPS + MUP + MUP_CASES[name])
    assert_same_curve(records, train_once(FAST + STEPS + MUP + (TIED if TIED[0] in MUP_CASES[name] else []))[1])


def _first_step(rank, world_size, overrides):
    cfg = compose_config(FAST + overrides)
    check_config(cfg, world_size)
    ctx = ParallelContext(Layout.from_config(cfg))
    trainer = Trainer(cfg, ctx, run_dir=os.devnull)
    loss = compute_gradients(trainer, trainer.batches.next_step())
    trainer.batches.close()
    sync = trainer.grad_sync
    pieces: dict = {}   # ZeRO: this rank holds its shard of the averaged gradient, as (start, end) pieces
    for piece in sync.shard_pieces() if sync.shard else []:
        pieces.setdefault(id(piece.param), []).append(piece)
    grads = {}
    for name, param in trainer.model.named_parameters():
        grad = param.grad
        if sync.shard:   # NaN where another dp x cp rank holds the gradient
            grad = torch.full((param.numel(),), float("nan"))
            for piece in pieces.get(id(param), []):
                grad[piece.start:piece.end] = piece.grad
            grad = grad.view(param.shape)
        grads[name] = (grad, placement(param).split_dim)
    return {"loss": loss, "dp_rank": ctx.dp_rank, "cp_rank": ctx.cp_rank, "tp_rank": ctx.tp_rank, "grads": grads,
            "sharded": sync.shard}


def full_gradients(results) -> dict:
    """Stitch the gradients back into full ones, by parameter name: ZeRO's shards over the dp x cp ranks
    (each holds its pieces, NaN elsewhere), then the tp shards (of dp replica 0, cp rank 0 without ZeRO)."""
    shards: dict = {}
    for r in sorted(results, key=lambda r: r["tp_rank"]):
        if r["sharded"] or (r["dp_rank"] == 0 and r["cp_rank"] == 0):
            for name, (grad, dim) in r["grads"].items():
                tp_shards = shards.setdefault(name, (dim, {}))[1]
                held = tp_shards.get(r["tp_rank"])
                tp_shards[r["tp_rank"]] = grad if held is None else np.where(np.isnan(held), grad, held)
    full = {name: np.concatenate([parts[t] for t in sorted(parts)], axis=dim) if dim is not None else parts[0]
            for name, (dim, parts) in shards.items()}
    missing = [name for name, grad in full.items() if np.isnan(grad).any()]
    assert not missing, f"no rank holds part of the gradient of {missing}"
    return full


def assert_same_first_step(results, expected):
    """Every rank's loss and the stitched gradients against one process's first step."""
    grads, reference_grads = full_gradients(results), full_gradients([expected])
    assert all(abs(r["loss"] - expected["loss"]) < FIRST_STEP_ATOL for r in results)   # same on every rank
    shared = set(grads) & set(reference_grads)   # pp: the last stage's copy of a tied head has its own name
    assert shared == set(reference_grads)
    for name in shared:
        # float32, reduction order only: relative 1e-4 of the gradient's scale.
        scale = np.abs(reference_grads[name]).max()
        np.testing.assert_allclose(grads[name], reference_grads[name], atol=1e-4 * scale + 1e-8, rtol=0,
                                   err_msg=name)


FIRST_STEP_CASES = {
    "dp2tp2pp2-sp": ["parallelism=dp2tp2pp2", "parallelism.tp_mode=reduce_scatter"],
    "dp2tp2pp2-afab-tied": ["parallelism=dp2tp2pp2", "parallelism.pp_engine=afab"] + TIED,
    "dp1tp1pp4": ["parallelism=dp1tp1pp4"],
    "dp2tp1pp2-interleaved-tied": ["parallelism=dp2tp1pp2"] + INTERLEAVED + TIED,
    "dp1cp2tp2pp2-sp-tied": ["parallelism=dp1cp2tp2pp2", "parallelism.tp_mode=reduce_scatter"] + TIED,
    "dp2cp2-all_gather": ["parallelism=dp2cp2tp1pp1", "parallelism.cp_mode=all_gather"],
}


@pytest.mark.parametrize("name", tiered(FIRST_STEP_CASES, quick=["dp2tp2pp2-sp"]))
def test_first_step_gradients_match_single_process(name):
    overrides = FIRST_STEP_CASES[name]
    tied = TIED if TIED[0] in overrides else []
    (expected,) = run_distributed(_first_step, 1, ["parallelism=dp1tp1pp1"] + tied)
    results = run_distributed(_first_step, Layout.from_config(compose_config(FAST + overrides)).world_size, overrides)
    assert_same_first_step(results, expected)


@pytest.mark.slow
def test_killed_worker_stops_the_command(tmp_path):
    """SIGKILL one of 4 workers mid-run: the command exits non-zero, naming the rank, within 60 s."""
    cmd = [sys.executable, "train.py", "parallelism=dp2tp1pp2", "tokens.train_steps=100000",
           f"hydra.run.dir={tmp_path}"] + FAST
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not os.path.exists(tmp_path / "metrics.jsonl"):
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "the run never started"
            time.sleep(0.5)
        parent = psutil.Process(proc.pid)
        workers = sorted((c for c in parent.children() if c.cmdline() == parent.cmdline()),   # forked ranks,
                         key=lambda c: c.pid)                                                  # in rank order
        assert len(workers) >= 4
        os.kill(workers[2].pid, signal.SIGKILL)
        killed_at = time.time()
        _, stderr = proc.communicate(timeout=60)
        assert time.time() - killed_at < 60
        assert proc.returncode != 0
        assert "rank 2 failed: killed by signal 9" in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
