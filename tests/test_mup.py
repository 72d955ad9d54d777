"""µP (model.parametrization=mup): the init and learning rates it promises, what --show-lrs prints, and the
coordinate check's property (activations keep their size as the width grows). Parity across layouts is
in tests/test_parallel.py, the HF export in tests/test_hf_conversion.py."""
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from benchmarks.mup_coord_check import coord_check, width_overrides
from nanoexp.config import normalize
from nanoexp.optim.lr_table import lr_table
from nanoexp.runtime.build import build_model
from nanoexp.optim.schedule import set_lr
from nanoexp.runtime.optim import build_optimizer
from nanoexp.parallel.context import ParallelContext
from nanoexp.validation import validate
from tests.helpers import FAST, compose_config, train, train_losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MUP = ["model.parametrization=mup", "model.mup.base_width=32"]
STD = 0.08   # conf/model/tiny.yaml's init_method.std


def group_lrs(overrides: list[str], lr: float) -> dict[str, float]:
    """The rate each optimizer group trains with after set_lr(lr), by group name."""
    cfg = compose_config(overrides)
    ctx = ParallelContext()
    optimizer = build_optimizer(cfg, build_model(cfg, ctx))
    set_lr(optimizer, lr)
    return {group["group"]: group["lr"] for group in optimizer.param_groups}


def test_mup_init_and_learning_rates_scale_with_the_width():
    """m = 128 / 32 = 4: hidden matrices std 0.08 / 2 and lr / 4; the embedding, the LM head and the norms
    keep the standard parametrization's init and rate."""
    cfg = compose_config(width_overrides(128, 16) + MUP)
    params = dict(build_model(cfg, ParallelContext()).named_parameters())
    # 128 x 128 = 16k draws: the sample std is within ~1% of the true one (5 standard errors < 3%).
    assert params["model.layers.0.self_attn.q_proj.weight"].std().item() == pytest.approx(STD / 2, rel=0.03)
    assert params["model.layers.3.mlp.down_proj.weight"].std().item() == pytest.approx(STD / 2, rel=0.03)
    assert params["model.embed_tokens.weight"].std().item() == pytest.approx(STD, rel=0.03)
    assert params["lm_head.weight"].std().item() == pytest.approx(STD, rel=0.03)
    assert params["model.norm.weight"].eq(1).all()
    assert group_lrs(width_overrides(128, 16) + MUP, 1e-3) == pytest.approx(
        {"matrices": 1e-3, "hidden": 1e-3 / 4, "vectors": 1e-3}, rel=1e-12)
    assert group_lrs(width_overrides(128, 16), 1e-3) == {"matrices": 1e-3, "vectors": 1e-3}


def test_the_hidden_matrices_decay_by_the_same_amount_at_every_width():
    """torch's AdamW shrinks a weight by lr·wd a step. µP divides the hidden matrices' lr by m, so their weight
    decay is multiplied by m: lr·wd, and the decay one step applies, do not depend on the width (before, the
    hidden group kept optimizer.weight_decay and its decay per step fell as 1/m)."""
    decays = {}
    for width in (32, 64, 128):
        cfg = compose_config(width_overrides(width, 16) + MUP + ["optimizer.weight_decay=0.1"])
        model = build_model(cfg, ParallelContext())
        optimizer = build_optimizer(cfg, model)
        set_lr(optimizer, 1e-2)
        groups = {group["group"]: group for group in optimizer.param_groups}
        assert groups["vectors"]["weight_decay"] == 0 and groups["matrices"]["weight_decay"] == 0.1
        weight = model.get_parameter("model.layers.0.mlp.up_proj.weight")
        before = weight.detach().clone()
        for param in model.parameters():   # no gradient signal: the step is the decay alone
            param.grad = torch.zeros_like(param)
        optimizer.step()
        decays[width] = (groups["hidden"]["lr"] * groups["hidden"]["weight_decay"], (weight / before).mean().item())
    for lr_wd, shrink in decays.values():   # float32 weights: the ratio to ~1e-7
        assert lr_wd == pytest.approx(1e-3, rel=1e-12) and shrink == pytest.approx(1 - 1e-3, abs=1e-6)


def test_mup_at_its_base_width_is_the_standard_parametrization(tmp_path):
    """m = 1 and attention_multiplier = sqrt(d_head) = 4: every multiplier is 1 and the attention scale is
    standard's, so the same seed trains the same model, loss for loss (the groups differ, the updates not)."""
    steps = FAST + ["tokens.train_steps=3", "tokens.val_check_interval=0", "checkpoint.save_final_state=false"]
    standard = train_losses(train(tmp_path / "standard", steps))
    mup = train_losses(train(tmp_path / "mup", steps + ["model.parametrization=mup", "model.mup.base_width=64",
                                                        "model.mup.attention_multiplier=4"]))
    assert mup == standard


def test_show_lrs_prints_the_rates_the_optimizer_uses():
    overrides = MUP + ["optimizer.learning_rate_scheduler.learning_rate=3e-3"]
    cfg = compose_config(overrides)
    normalize(cfg)
    validate(cfg)
    out = lr_table(cfg)   # what make_config.py --show-lrs prints
    assert "m = 96 / 32 = 3" in out
    printed = {match[0]: float(match[1]) for match in re.findall(r"^(\w+)\s+adamW\s+\d+\s+[\d,]+\s+\S+\s+\S+\s+(\S+)", out,
                                                                 re.MULTILINE)}
    expected = group_lrs(overrides, 3e-3)
    assert printed.keys() == expected.keys() == {"matrices", "hidden", "vectors"}
    for group, lr in expected.items():
        assert math.isclose(printed[group], lr, rel_tol=1e-3), (group, printed[group], lr)   # printed to 4 digits


def test_coord_check_mup_keeps_logits_steady_as_width_grows():
    """Widths 32, 64, 128 after 3 Adam steps at lr 1e-2. Under the standard parametrization every Adam
    step adds ~lr per LM-head entry along the features, so the logits grow about linearly with the
    width (measured 0.74, 1.31, 2.10) and the MLP outputs faster (0.27 -> 5.3); under µP the 1/m on the
    logits and the 1/m learning rate of hidden matrices cancel that (measured 0.74, 0.69, 0.67 and
    0.28 -> 0.25). Bounds: µP within a factor 1.5 across a 4x width range, standard at least 2x up."""
    rows = coord_check([32, 64, 128], steps=4, lr=1e-2, seeds=1, layers=2,
                       extra=["tokens.sequence_length=32", "tokens.global_batch_size=8"])

    def rms(parametrization, activation):
        return [r["rms"] for r in rows if (r["parametrization"], r["activation"], r["step"])
                == (parametrization, activation, 4)]

    for activation in ("logits", "mlp"):
        mup, standard = rms("mup", activation), rms("standard", activation)
        assert max(mup) / min(mup) < 1.5, (activation, mup)
        assert standard == sorted(standard) and standard[-1] / standard[0] > 2, (activation, standard)


def fake_job(folder, number: int, parametrization: str, width: int, lr: float, eval_loss: float | None,
             optimizer: str = "adamW") -> None:
    """A finished sweep job as summarize_sweep.py reads it: .hydra/ config and overrides, summary.json."""
    job = folder / str(number)
    (job / ".hydra").mkdir(parents=True)
    config = {"parallelism": {"dp": 1, "tp": 1, "pp": 1},
              "optimizer": {"learning_rate_scheduler": {"learning_rate": lr}, "optimizer_factory": {"name": optimizer}},
              "model": {"parametrization": parametrization, "model_config": {"hidden_size": width}}}
    (job / ".hydra" / "config.yaml").write_text(json.dumps(config))   # JSON is YAML
    (job / ".hydra" / "overrides.yaml").write_text(json.dumps([f"model.parametrization={parametrization}",
                                                               f"width={width}", f"lr={lr}", f"name={optimizer}"]))
    status = {"status": "completed", "eval_loss": eval_loss} if eval_loss else {"status": "failed", "error": "NaN"}
    (job / "summary.json").write_text(json.dumps(status))


@pytest.mark.slow
def test_summarize_sweep_prints_the_best_lr_per_width_and_plots_the_transfer(tmp_path):
    losses = {("standard", 64): [2.0, 1.9, 2.1], ("standard", 256): [1.8, 1.95, None],
              ("mup", 64): [2.0, 1.9, 2.1], ("mup", 256): [1.9, 1.7, 1.8]}
    lrs = [2 ** -9, 2 ** -8, 2 ** -7]
    jobs = [(key, lr, loss) for key, row in losses.items() for lr, loss in zip(lrs, row)]
    for number, ((parametrization, width), lr, loss) in enumerate(jobs):
        fake_job(tmp_path / "sweep", number, parametrization, width, lr, loss)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "summarize_sweep.py"), str(tmp_path / "sweep"),
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    best = re.findall(r"^(standard|mup)\s+(\d+)\s+(\S+) \(2\^(\S+)\)\s+(\S+)", result.stdout, re.MULTILINE)
    assert best == [("standard", "64", "0.003906", "-8", "1.9000"), ("standard", "256", "0.001953", "-9", "1.8000"),
                    ("mup", "64", "0.003906", "-8", "1.9000"), ("mup", "256", "0.003906", "-8", "1.7000")]
    assert (tmp_path / "out" / "lr_transfer.png").stat().st_size > 10_000


@pytest.mark.slow
def test_a_sweep_over_optimizers_gets_the_best_lr_of_each(tmp_path):
    """A sweep that tries AdamW and Muon (optimizer.optimizer_factory.name) ranks each optimizer's learning rates
    apart: one row and one panel per optimizer."""
    lrs = [2 ** -9, 2 ** -8, 2 ** -7]
    for number, (optimizer, lr, loss) in enumerate([("adamW", lr, loss) for lr, loss in zip(lrs, [2.0, 1.9, 2.1])]
                                                    + [("muon", lr, loss) for lr, loss in zip(lrs, [1.9, 1.8, 1.7])]):
        fake_job(tmp_path / "sweep", number, "standard", 64, lr, loss, optimizer)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "summarize_sweep.py"), str(tmp_path / "sweep"),
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    best = re.findall(r"^standard, (adamW|muon)\s+64\s+(\S+) \(2\^\S+\)\s+(\S+)", result.stdout, re.MULTILINE)
    assert best == [("adamW", "0.003906", "1.9000"), ("muon", "0.007812", "1.7000")]
