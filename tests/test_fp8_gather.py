"""ZeRO-3 gathers of FP8 weights in FP8 (model.fp8.gather_in_fp8, nanoexp/numerics/fp8_gather.py): the same
training as float32 gathers cast per matmul, one byte per element on the wire, and the scales agreed over the
groups that split a weight.

Tolerances: the gathered bytes and scales are those of the float32 path's casts, so the first step's matmuls are
the same and its loss is equal (atol 0). The gradient norm is summed in another order (the norms' gradients are
all-reduced whole beside the FP8 units, where the float32 path reduce-scatters them), measured 6.4e-8 relative: rtol
1e-6 at step 1. Later steps start from weights whose last bits may differ by CPU (moe-dp2ep2's step 4 differed by
8.6e-8 relative on one machine, 0 on another), and one such bit crossing an FP8 rounding boundary moved a loss by up
to 5.6e-4 relative (measured with clipping, which divides by that norm): rtol 1e-3 there: a gather that missed an update would
move the loss by a step's change (2-5 % here), and unagreed scales show at step 1 (the tp test below: > 1e-4).
"""
import os

import numpy as np
import pytest

from nanoexp.numerics.fp8_gather import Fp8Gather
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from tests.distributed import run_distributed
from tests.helpers import FAST, compose_config, compute_gradients, start_error, train

FP8_ZERO3 = ["model.fp8.enabled=true", "optimizer.zero_stage=3", "tokens.train_steps=4", "tokens.val_check_interval=0",
             "checkpoint.checkpoint_interval=0", "optimizer.learning_rate_scheduler.learning_rate=1e-3",
             "optimizer.learning_rate_scheduler.lr_warmup_steps=2", "optimizer.clip_grad=null"]
GATHER = ["model.fp8.gather_in_fp8=true"]
LAYOUTS = {"dp2": ["parallelism=dp2tp1pp1"], "dp2tp2": ["parallelism=dp2tp2pp1"],
           "moe-dp2ep2": ["parallelism=dp2tp1pp1", "parallelism.ep=2", "model=moe_tiny"]}


def curves(records) -> tuple[np.ndarray, np.ndarray]:
    steps = [r for r in records if "loss" in r]
    return np.array([r["loss"] for r in steps]), np.array([r["grad_norm"] for r in steps])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp8_gathers_train_as_float32_gathers(name, tmp_path):
    base = FAST + FP8_ZERO3 + LAYOUTS[name]
    loss, norm = curves(train(tmp_path / "float32", base))
    fp8_loss, fp8_norm = curves(train(tmp_path / "fp8", base + GATHER))
    assert len(loss) == 4
    assert fp8_loss[0] == loss[0]
    np.testing.assert_allclose(fp8_norm[0], norm[0], rtol=1e-6, atol=0)
    np.testing.assert_allclose(fp8_loss[1:], loss[1:], rtol=1e-3, atol=0)
    np.testing.assert_allclose(fp8_norm[1:], norm[1:], rtol=1e-3, atol=0)
    log = open(os.path.join(tmp_path / "fp8", "logs", "rank_0.log")).read()
    assert "ZeRO-3 gathers their weights in FP8" in log


@pytest.mark.slow
def test_without_the_tp_reduction_of_the_amax_the_gathered_weights_change(tmp_path, monkeypatch):
    """The parity above is the tp all-reduce's doing: without it each tp shard is cast with its own amax."""
    base = FAST + FP8_ZERO3 + LAYOUTS["dp2tp2"] + ["tokens.train_steps=1", "optimizer.learning_rate_scheduler."
                                                   "lr_warmup_steps=1"]
    loss, _ = curves(train(tmp_path / "float32", base))
    monkeypatch.setattr(Fp8Gather, "_by_split_groups", lambda self, unit: {})   # forked workers inherit it
    dropped, _ = curves(train(tmp_path / "fp8", base + GATHER))
    assert abs(dropped[0] - loss[0]) > 1e-4, (dropped, loss)


def _gathered(rank, world, overrides):
    """(bytes per element, payload bytes) of every all-gather over dp x cp in one step's forward and backward, and
    the shard sizes of the units the FP8 gather takes and of the others."""
    from nanoexp.checks import check_config
    from nanoexp.runtime.trainer import Trainer
    from nanoexp.verify.comm_counter import CommCounter
    cfg = compose_config(FAST + FP8_ZERO3 + LAYOUTS["dp2"] + overrides)
    check_config(cfg, world)
    ctx = ParallelContext(Layout.from_config(cfg))
    trainer = Trainer(cfg, ctx, run_dir=os.devnull)
    with CommCounter({"dp_cp": ctx.dp_cp_group}) as comm:
        compute_gradients(trainer, trainer.batches.next_step())
    trainer.batches.close()
    units = [u for engine in trainer.grad_sync.engines for u in engine.scattered.units]
    gathers = [payload for group, op, payload, _ in comm.records if group == "dp_cp" and "gather" in op]
    return (gathers, sorted({u.shard_size for u in units if u.wire}),
            sorted({4 * u.shard_size for u in units if not u.wire}))


def test_fp8_units_gather_one_byte_per_element():
    """Each layer's unit travels as uint8 (its shard_size bytes per gather), the embedding, final norm and head as
    float32 (4 x shard_size); the same gathers, in the same order, as without the FP8 gather, where a layer's unit
    also holds its two norms (2 x hidden 64 elements, half on each rank), which the FP8 gather keeps whole."""
    norms_per_rank = 2 * 64 // 2
    for (gathers, fp8_sizes, float32_sizes), (float32_gathers, _, _) in zip(
            run_distributed(_gathered, 2, GATHER), run_distributed(_gathered, 2, [])):
        assert fp8_sizes and float32_sizes and len(gathers) == len(float32_gathers)
        assert set(gathers) == set(fp8_sizes) | set(float32_sizes)
        for ours, theirs in zip(gathers, float32_gathers):
            assert ours == theirs or (ours in fp8_sizes and theirs == 4 * (ours + norms_per_rank)), (ours, theirs)


@pytest.mark.parametrize("overrides, message", [
    (["model.fp8.gather_in_fp8=true", "optimizer.zero_stage=3", "parallelism=dp2tp1pp1"],
     "model.fp8.gather_in_fp8=true needs model.fp8.enabled=true"),
    (["model.fp8.enabled=true", "model.fp8.recipe=rowwise", "model.fp8.gather_in_fp8=true", "optimizer.zero_stage=3",
      "parallelism=dp2tp1pp1"], "model.fp8.gather_in_fp8=true needs model.fp8.recipe=tensorwise, not rowwise"),
    (["model.fp8.enabled=true", "model.fp8.gather_in_fp8=true", "optimizer.zero_stage=1", "parallelism=dp2tp1pp1"],
     "it needs optimizer.zero_stage=3 and parallelism.dp*cp > 1"),
    (["model.fp8.enabled=true", "model.fp8.gather_in_fp8=true", "optimizer.zero_stage=3"],
     "it needs optimizer.zero_stage=3 and parallelism.dp*cp > 1"),
])
def test_a_gather_in_fp8_that_cannot_work_is_named(overrides, message):
    assert message in start_error(compose_config(FAST + overrides))


def test_the_memory_estimate_gathers_a_byte_per_fp8_weight():
    """model=small under ZeRO-3 over dp 2 (NCCL, prefetch 1): two consecutive layers are gathered at once, each
    layer's matrices m a byte an element instead of its m + 2h parameters in float32, beside one unit's float32
    gradients; the layer norms (2h each of 6 layers) are kept whole."""
    from nanoexp.observe.memory_estimate import estimate
    from nanoexp.model.shape import model_shape

    h, kv, i, layers = 512, 4 * 64, 1536, 6
    m = 2 * h * h + 2 * h * kv + 3 * h * i
    parts = {}
    for name, extra in (("float32", []), ("fp8", GATHER)):
        cfg = compose_config(["model=small", "model.fp8.enabled=true", "optimizer.zero_stage=3",
                              "parallelism=dp2tp1pp1"] + extra)
        parts[name] = estimate(cfg, model_shape(cfg), 0, "cuda")
    assert parts["float32"]["in_flight"] == 4 * (m + 2 * h) + 4 * 2 * (m + 2 * h)
    assert parts["fp8"]["in_flight"] == 4 * m + 2 * m
    assert parts["fp8"]["parameters"] - parts["float32"]["parameters"] == 4 * layers * 2 * h / 2


@pytest.mark.slow
def test_fp8_gathers_compose_with_bf16_recomputation_evaluation_and_resume(tmp_path):
    """Against float32 gathers at dp 2 in bf16 autocast: with recomputation (a layer's forward again in its
    backward, from the bytes gathered then) and in-loop evaluation the same losses, and a resume from the float32
    gathers' checkpoint (the norms sharded there, kept whole here) continues with the same step."""
    run = FAST + FP8_ZERO3 + LAYOUTS["dp2"] + ["model.dtype=bfloat16", "tokens.train_steps=3",
                                               "tokens.val_check_interval=2", "checkpoint.checkpoint_interval=2"]
    float32 = train(tmp_path / "float32", run)
    ours = train(tmp_path / "fp8", run + GATHER + ["parallelism.recompute_layer=true"])
    evals = [r["eval_loss"] for r in float32 if "eval_loss" in r]
    assert len(evals) == 2 and evals == [r["eval_loss"] for r in ours if "eval_loss" in r]
    np.testing.assert_array_equal(curves(ours)[0], curves(float32)[0])
    resumed = train(tmp_path / "resumed", run + GATHER + [
        f"checkpoint.resume_checkpoint_path={tmp_path}/float32/checkpoints/2"])
    assert [(r["step"], r["loss"]) for r in resumed if "loss" in r] == [(3, curves(float32)[0][2])]
