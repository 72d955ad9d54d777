"""bf16 (model.dtype=bfloat16: bf16 autocast, float32 master weights and gradients): every layout
trains the same model as one bf16 process, and every gradient reduction runs in float32.

Reference: one bf16 process with the same seed, data and global batch, computed once per test session.
benchmarks/bench_bf16.py measures every file of conf/parallelism/ the same way (table in the README).
"""
import os
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.checks import check_config
from nanoexp.runtime.trainer import Trainer
from tests.distributed import run_distributed
from tests.helpers import FAST, compose_config, tiered, train, train_losses
from tests.test_parallel import INTERLEAVED, TIED

BF16 = FAST + ["model.dtype=bfloat16", "tokens.train_steps=8", "tokens.val_check_interval=0"]

# The contract: within 2e-3 relative loss over 8 steps. Layouts differ from one process only in
# rounding: each tp rank rounds its partial row-parallel output to bf16 (8-bit mantissa, 2^-8 =
# 3.9e-3 per element) before the sum, where one process rounds the whole sum once, and float32
# reductions run in another order. Averaged over the batch's tokens this moves the loss by 0.9e-4 to
# 1.2e-4 relative in 8 steps for these layouts with this small model (9.1e-5 at most over every layout
# of the default model, README table).
LOSS_RTOL = 2e-3
# The loss alone is a weak detector: AdamW is blind to a gradient's scale, so averaging the dp
# gradients by sum instead of mean moved the loss by only 1.1e-4, and a missing sum of the
# sequence-parallel norm gradients by 2.2e-4. The gradient norm shows the first (relative error 1.0)
# and a missing tied-embedding sum (0.72); correct layouts stay within 1.3e-3 (measured, 8 steps).
# The sharp check of each gradient is the float32 parity in tests/test_parallel.py.
GRAD_NORM_RTOL = 5e-3

CASES = {
    "dp2tp2pp2": ["parallelism=dp2tp2pp2"],
    "dp2tp2pp1-reduce_scatter": ["parallelism=dp2tp2pp1", "parallelism.tp_mode=reduce_scatter"],
    "dp1tp2pp2-interleaved-tied": ["parallelism=dp1tp2pp2"] + INTERLEAVED + TIED,
    # context parallelism: its attention under the trainer's bf16 autocast, both cp modes
    "dp1cp2tp1pp1": ["parallelism=dp1cp2tp1pp1"],
    "dp2cp2tp1pp1-all_gather": ["parallelism=dp2cp2tp1pp1", "parallelism.cp_mode=all_gather"],
    "dp1cp2tp2pp2-reduce_scatter": ["parallelism=dp1cp2tp2pp2", "parallelism.tp_mode=reduce_scatter"],
    # ZeRO-3: float32 master weights sharded, each layer gathered in float32 and cast by autocast as it runs
    "dp2tp1pp2-zero3": ["parallelism=dp2tp1pp2", "optimizer.zero_stage=3"],
}


@pytest.fixture
def reference(train_once):
    """One bf16 process, untied or tied, trained once per test session."""
    return lambda kind: train_once(BF16 + (TIED if kind == "tied" else []))[1]


def grad_norms(records) -> list[float]:
    return [r["grad_norm"] for r in records if "loss" in r]


@pytest.mark.parametrize("name", tiered(CASES, quick=["dp2tp1pp2-zero3"]))
def test_bf16_layout_matches_one_bf16_process(name, reference, tmp_path):
    records = train(tmp_path, BF16 + CASES[name])
    expected = reference("tied" if TIED[0] in CASES[name] else "untied")
    assert len(train_losses(records)) == len(train_losses(expected)) == 8
    np.testing.assert_allclose(train_losses(records), train_losses(expected), rtol=LOSS_RTOL, atol=0)
    np.testing.assert_allclose(grad_norms(records), grad_norms(expected), rtol=GRAD_NORM_RTOL, atol=0)


def _in_forward() -> bool:
    """Whether a forward() is on the call stack: a module's, or an autograd Function's (which runs with
    grad mode off, so torch.is_grad_enabled() cannot tell). Backward is driven by the engine's own
    functions and autograd's C++ loop, never from inside a forward()."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "forward":
        frame = frame.f_back
    return frame is not None


def _reduction_dtypes(rank, world_size, overrides):
    """One bf16 training step; the dtypes of the reductions inside forward() and outside it (backward,
    gradient hooks and syncs, step loss, gradient norm)."""
    seen = {True: set(), False: set()}
    real = {name: getattr(dist, name) for name in ("all_reduce", "reduce_scatter", "reduce_scatter_tensor")}

    def recording(name):
        def reduce(output, *args, **kwargs):
            inputs = args[0] if args and isinstance(args[0], list) else args[:1]
            tensors = [t for t in [output, *inputs] if isinstance(t, torch.Tensor)]
            seen[_in_forward()].update(str(t.dtype) for t in tensors)
            return real[name](output, *args, **kwargs)
        return reduce

    for name in real:
        setattr(dist, name, recording(name))   # this forked rank only
    cfg = compose_config(FAST + ["model.dtype=bfloat16"] + overrides)
    check_config(cfg, world_size)
    trainer = Trainer(cfg, ParallelContext(Layout.from_config(cfg)), run_dir=os.devnull)
    trainer.train_step(trainer.batches.next_step(), lr=1e-3)
    trainer.batches.close()
    return {"forward": sorted(seen[True]), "gradients": sorted(seen[False])}


@pytest.mark.parametrize("overrides", [
    ["parallelism=dp2tp2pp2", "parallelism.tp_mode=reduce_scatter"] + TIED,   # SP norms, tied embedding, dp
    ["parallelism=dp2tp2pp2"],                                                  # tp all-reduce backward
], ids=["sp-tied", "all_reduce"])
def test_bf16_gradient_reductions_run_in_float32(overrides):
    results = run_distributed(_reduction_dtypes, 8, overrides)
    assert all(r["gradients"] == ["torch.float32"] for r in results), results
    # The forward sums of row-parallel partial outputs are bf16 by design (tensor_parallel.py).
    assert any("torch.bfloat16" in r["forward"] for r in results), results
