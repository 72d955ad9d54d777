"""LR schedule values at chosen steps, and the global-norm clipping of one process."""
import math

import pytest
import torch

from nanoexp.optim.schedule import lr_at
from nanoexp.runtime.optim import clip_gradients, parameter_groups
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.gradient_sync import GradientSync
from tests.helpers import compose_config

SCHED = "optimizer.learning_rate_scheduler."


@pytest.mark.parametrize("style, expected", [
    # warm-up 10 steps to 1e-3, then 90 decay steps to 1e-4
    ("cosine", {1: 1e-4, 10: 1e-3, 55: 1e-4 + 0.9e-3 * 0.5, 100: 1e-4, 150: 1e-4}),
    ("linear", {5: 5e-4, 10: 1e-3, 55: 1e-3 - 0.9e-3 * 0.5, 100: 1e-4}),
    ("constant", {5: 5e-4, 10: 1e-3, 80: 1e-3}),
])
def test_schedule_values(style, expected):
    cfg = compose_config(["tokens.train_steps=100", SCHED + "learning_rate=1e-3", SCHED + "lr_warmup_steps=10",
                          SCHED + "min_decay_lr=1e-4", SCHED + f"lr_decay_style={style}"])
    for step, lr in expected.items():
        assert math.isclose(lr_at(step, cfg), lr, rel_tol=1e-12), (style, step)


def test_constant_warmup_and_explicit_decay_steps():
    cfg = compose_config(["tokens.train_steps=100", SCHED + "learning_rate=1e-3", SCHED + "lr_warmup_steps=10",
                          SCHED + "lr_warmup_style=constant", SCHED + "lr_decay_steps=20", SCHED + "min_decay_lr=0",
                          SCHED + "lr_decay_style=linear"])
    assert lr_at(1, cfg) == 1e-3
    assert math.isclose(lr_at(20, cfg), 0.5e-3)
    assert lr_at(30, cfg) == 0.0 and lr_at(90, cfg) == 0.0


def test_decay_starting_step_holds_the_peak_then_decays():
    """nanotron's lr_decay_starting_step: warm-up to step 10, the peak until step 40, cosine over 50 steps to 1e-4."""
    cfg = compose_config(["tokens.train_steps=100", SCHED + "learning_rate=1e-3", SCHED + "lr_warmup_steps=10",
                          SCHED + "min_decay_lr=1e-4", SCHED + "lr_decay_starting_step=40",
                          SCHED + "lr_decay_steps=50"])
    expected = {5: 5e-4, 10: 1e-3, 25: 1e-3, 40: 1e-3, 65: 1e-4 + 0.9e-3 * 0.5, 90: 1e-4, 100: 1e-4}
    for step, lr in expected.items():
        assert math.isclose(lr_at(step, cfg), lr, rel_tol=1e-12), step
    # Without lr_decay_steps the decay ends with training: from step 40 over 60 steps.
    cfg.optimizer.learning_rate_scheduler.lr_decay_steps = None
    assert math.isclose(lr_at(70, cfg), 1e-4 + 0.9e-3 * 0.5, rel_tol=1e-12) and math.isclose(lr_at(100, cfg), 1e-4)


def test_null_min_decay_lr_is_half_the_peak_and_follows_it():
    for peak in (3e-3, 1e-4):   # an LR sweep below the default's floor stays valid
        cfg = compose_config(["tokens.train_steps=100", SCHED + f"learning_rate={peak}", SCHED + "lr_warmup_steps=10",
                              SCHED + "min_decay_lr=null"])
        assert math.isclose(lr_at(100, cfg), peak / 2, rel_tol=1e-12)
        assert math.isclose(lr_at(55, cfg), peak * 0.75, rel_tol=1e-12)   # halfway down the cosine


def test_no_weight_decay_on_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=True), torch.nn.LayerNorm(4))
    decay, no_decay = parameter_groups(model, 0.1)
    assert [p.ndim for p in decay["params"]] == [2]
    assert all(p.ndim == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0


def test_clipping_matches_torch():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    sync = GradientSync([a], ParallelContext())   # the gradients become views of its flat buffer
    for p, q in zip(a, b):
        p.grad.copy_(torch.randn_like(p))
        q.grad = p.grad.clone()
    norm = clip_gradients(sync.norm_inputs(a), 0.5, "cpu")   # no ZeRO: the parameters' own gradients
    expected = torch.nn.utils.clip_grad_norm_(b, 0.5)
    assert math.isclose(norm, expected.item(), rel_tol=1e-6)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad)
