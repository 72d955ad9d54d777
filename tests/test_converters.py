"""The number-format seam (nanoexp/numerics/converters.py): a registered format converts the linears it selects,
on the model a run trains, and nothing else has to change."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoexp.model.linear import Linear, plain_matmul
from nanoexp.numerics import converters
from nanoexp.numerics.converters import Converter
from nanoexp.parallel.context import ParallelContext
from nanoexp.runtime.build import build_model
from tests.helpers import FAST, compose_config, train, train_losses


def bf16_matmul(x, weight, layer):
    """A toy number format: inputs and weights rounded to bfloat16, the product in float32."""
    return F.linear(x.to(torch.bfloat16).float(), weight.to(torch.bfloat16).float())


def all_but_head(name: str, layer: Linear, cfg, ctx) -> None:
    if not name.endswith("lm_head"):
        layer.matmul = bf16_matmul


def register_toy_format(monkeypatch):
    monkeypatch.setitem(converters.CONVERTERS, "toy_bf16", Converter(lambda cfg: cfg.general.seed == 7, all_but_head))


def test_a_format_converts_the_linears_it_selects(monkeypatch):
    register_toy_format(monkeypatch)
    model = build_model(compose_config(FAST + ["general.seed=7"]), ParallelContext())
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    assert linears["lm_head"].matmul is plain_matmul
    converted = [name for name, m in linears.items() if m.matmul is bf16_matmul]
    # every projection of the 4 layers (q, k, v, o and the MLP's gate, up, down), the head left alone
    assert len(converted) == 4 * 7 and len(linears) == 4 * 7 + 1
    assert "bf16_matmul" in repr(linears[converted[0]])
    off = build_model(compose_config(FAST + ["general.seed=8"]), ParallelContext())
    assert all(m.matmul is plain_matmul for m in off.modules() if isinstance(m, Linear))


def test_a_run_trains_with_the_format(monkeypatch, tmp_path):
    """Through the trainer: the format changes what the matmuls compute, so the losses leave the plain run's
    after the first step's update, by about bfloat16's rounding (2^-8 relative on each input)."""
    steps = FAST + ["general.seed=7", "tokens.train_steps=3", "checkpoint.checkpoint_interval=0",
                    "tokens.val_check_interval=0"]
    plain = train_losses(train(tmp_path / "plain", steps))
    register_toy_format(monkeypatch)
    toy = train_losses(train(tmp_path / "toy", steps))
    assert len(toy) == len(plain) == 3
    assert toy != plain
    assert max(abs(a - b) / b for a, b in zip(toy, plain)) < 1e-2
