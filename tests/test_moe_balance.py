"""Keeping a mixture of experts' routing even: DeepSeek-V3's routing bias (model.moe.balance=bias) and its
sequence-wise balancing loss, against their rules written out, on layouts against one process, and through a
checkpoint that moves between layouts.

Tolerances: the layouts' (tests/test_moe.py). The bias is moved by integer counts summed over every rank, so a
layout that routes as one process does holds the one-process bias exactly (compared with 0 tolerance).
"""
import numpy as np
import pytest
import torch

from nanoexp.checkpoint.load import CheckpointReader
from nanoexp.model.moe import MoE, MoeLosses, MoeShape, update_expert_biases
from tests.helpers import FAST, SLOW, compose_config, start_error, tiered, train
from tests.test_moe import EP2, GRAD_NORM_RTOL, MOE, STEPS, moe_curves
from tests.test_parallel import LATER_STEP_ATOL, assert_same_steps

# A rate 10x DeepSeek-V3's, so that in 8 steps the bias changes which experts tokens choose.
BIAS = ["model.moe.balance=bias", "model.moe.aux_loss_coef=0", "model.moe.bias_update_rate=0.01"]
SEQ_AUX = ["model.moe.seq_aux_loss_coef=0.01"]


def make_layer(balance: str = "bias", seq_aux_loss_coef: float = 0.0) -> MoE:
    moe = MoeShape(num_experts=4, top_k=2, intermediate_size=6, balance=balance, bias_update_rate=0.1,
                   seq_aux_loss_coef=seq_aux_loss_coef)
    torch.manual_seed(0)
    layer = MoE(8, moe, MoeLosses(moe, [0]), 0).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return layer


# -- the rules ------------------------------------------------------------------------------------------------
def test_the_bias_moves_by_the_sign_of_the_load_error():
    """DeepSeek-V3's rule: down by the rate for an expert above the mean load, up below it, still at the mean."""
    layer = make_layer()
    update_expert_biases(layer, torch.tensor([[10.0, 2.0, 4.0, 4.0]]))   # mean 5
    update_expert_biases(layer, torch.tensor([[10.0, 2.0, 3.0, 5.0]]))   # mean 5
    assert layer.expert_bias.tolist() == pytest.approx([-0.2, 0.2, 0.2, 0.1])


def test_the_bias_chooses_the_experts_and_the_probabilities_weigh_them():
    """A bias that makes expert 3 every token's first choice: it gets every token, weighted by its probability."""
    layer = make_layer()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    with torch.no_grad():
        tokens = x.reshape(-1, 8)
        probs = layer.router(tokens).softmax(-1)
        layer.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
        weights, chosen = layer.choose(probs)
    assert (chosen[:, 0] == 3).all()
    torch.testing.assert_close(weights, probs.gather(1, chosen), atol=0, rtol=0)


def test_the_sequence_loss_is_its_formula_per_sequence():
    """E * sum_e (n_e / kT) (sum_t p_te / T) per sequence, averaged over the sequences; it enters backward with its
    coefficient."""
    layer = make_layer("none", seq_aux_loss_coef=0.5)
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    with layer.losses.training_forward():
        out = layer(x)
    record, = layer.losses.records
    probs = layer.router(x.reshape(-1, 8)).softmax(-1).view(3, 4, 4)
    chosen = probs.topk(2, dim=-1).indices
    expected = torch.stack([4 * sum((chosen[b] == e).sum() / (2 * 4) * probs[b, :, e].mean() for e in range(4))
                            for b in range(3)]).mean()
    torch.testing.assert_close(record.seq_aux, expected.detach(), atol=1e-12, rtol=0)
    loss = out.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    layer.losses.moe = layer.moe = MoeShape(**{**layer.moe.__dict__, "seq_aux_loss_coef": 0.0})
    (layer(x).sum() + 0.5 * expected).backward()
    for name, p in layer.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-10, rtol=0, msg=name)


# -- layouts ------------------------------------------------------------------------------------------------
def final_bias(run_dir) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(str(run_dir / "checkpoints" / "8"))
    return {name: reader.full_tensor(name) for name, kind in reader.pieces if name.endswith("expert_bias")}


LAYOUTS = {   # loads summed over dp (ep), cp, tp under SP and the pipeline's stages
    "ep2": ["parallelism=dp2tp1pp1"] + EP2,
    "ep2cp2-seq_aux": ["parallelism=dp1cp2tp1pp1"] + EP2 + SEQ_AUX,
    "ep2-dp2tp2pp2-reduce_scatter-seq_aux": ["parallelism=dp2tp2pp2", "parallelism.tp_mode=reduce_scatter"]
                                            + EP2 + SEQ_AUX,
    "ep4-dp2cp2-zero3": ["parallelism=dp2cp2tp1pp1", "parallelism.ep=4", "optimizer.zero_stage=3"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", tiered(LAYOUTS, quick=["ep2cp2-seq_aux"]))
def test_bias_balance_trains_the_one_process_model(name, train_once, tmp_path):
    """Every replica moves its bias by the same loads: a replica whose bias differed would route other experts
    than one process and leave its losses. The saved bias is one process's, exactly."""
    run = FAST + MOE + STEPS + BIAS
    seq = [o for o in LAYOUTS[name] if o in SEQ_AUX]
    reference_dir, reference = train_once(run + seq)
    ours = moe_curves(train(tmp_path, run + LAYOUTS[name]))
    expected = moe_curves(reference)
    np.testing.assert_allclose(ours["loss"], expected["loss"], atol=LATER_STEP_ATOL, rtol=0)
    np.testing.assert_allclose(ours["grad_norm"], expected["grad_norm"], rtol=GRAD_NORM_RTOL)
    for key in ("moe_load_imbalance/layer_1", "moe_load_imbalance/layer_3"):
        np.testing.assert_allclose(ours[key], expected[key], atol=1e-6, rtol=0)
    biases, expected_biases = final_bias(tmp_path), final_bias(reference_dir)
    assert sorted(biases) == ["model.layers.1.mlp.expert_bias", "model.layers.3.mlp.expert_bias"]
    for name_, bias in biases.items():
        assert torch.equal(bias, expected_biases[name_]), name_
    assert max(bias.abs().max().item() for bias in biases.values()) > 0.01   # it moved, more than one step's rate


@SLOW
def test_the_bias_resumes_on_another_layout(tmp_path):
    """Saved on ep2 x pp2 with ZeRO-3, resumed on tp2 with sequence parallelism: the run continues as one
    uninterrupted run (the bias is in the checkpoint; without it the routing of step 4 would differ)."""
    run = FAST + MOE + STEPS + BIAS + ["optimizer.learning_rate_scheduler.lr_decay_style=constant",
                                       "optimizer.learning_rate_scheduler.lr_warmup_steps=0"]
    reference = train(tmp_path / "ref", run + ["tokens.train_steps=6"])
    a = train(tmp_path / "a", run + ["tokens.train_steps=3", "parallelism=dp2tp1pp2", "optimizer.zero_stage=3"] + EP2)
    b = train(tmp_path / "b", run + ["tokens.train_steps=6", "parallelism=dp1tp2pp1",
                                     "parallelism.tp_mode=reduce_scatter",
                                     f"checkpoint.resume_checkpoint_path={tmp_path}/a/checkpoints/3"])
    assert_same_steps(a + b, reference, steps=range(1, 7))


def test_a_checkpoint_without_the_bias_does_not_load_into_a_bias_run(tmp_path):
    short = ["tokens.val_check_interval=0", "optimizer.learning_rate_scheduler.lr_warmup_steps=0"]
    train(tmp_path / "a", FAST + MOE + short + ["tokens.train_steps=1"])
    with pytest.raises(Exception, match="expert_bias is missing"):
        train(tmp_path / "b", FAST + MOE + BIAS + short + ["tokens.train_steps=2",
                                                  f"checkpoint.resume_checkpoint_path={tmp_path}/a/checkpoints/1"])


def test_metrics_log_the_sequence_loss_and_the_loads(train_once):
    """Summed over the two MoE layers, each near 1 when the sequences' loads are even (at most E = 8)."""
    _, records = train_once(FAST + MOE + STEPS + BIAS + SEQ_AUX)
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 8 and all(1.0 < r["moe_seq_aux_loss"] < 16.0 for r in steps)
    assert all(r["moe_load_imbalance/layer_1"] >= 1.0 and r["moe_load_imbalance/layer_3"] >= 1.0 for r in steps)


@pytest.mark.parametrize("overrides, message", [
    (["model.moe.balance=bias"], "model.moe.aux_loss_coef=0.01 with model.moe.balance=bias: the load-balancing "
                                 "loss trains only under balance=aux_loss"),
    (["model.moe.bias_update_rate=0.01"], "model.moe.bias_update_rate=0.01 with model.moe.balance=aux_loss"),
    (["model.moe.balance=loss_free"], "model.moe.balance=loss_free: allowed values are aux_loss, bias, none"),
    (["model.moe.expert_kernel=triton"], "model.moe.expert_kernel=triton: allowed values are grouped_mm, loop"),
    (BIAS[:2] + ["model.moe.bias_update_rate=0"], "model.moe.bias_update_rate=0"),
    (["model.moe.seq_aux_loss_coef=-1"], "model.moe.seq_aux_loss_coef=-1"),
])
def test_bad_balance_config_is_named(overrides, message):
    assert message in start_error(compose_config(MOE + overrides))


def test_the_console_shows_each_layers_load():
    from nanoexp.observe.console import StepClock, step_line
    record = {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_sec": 1000.0, "peak_memory_mb": 10.0,
              "moe_aux_loss": 2.1, "moe_load_imbalance/layer_1": 1.3125, "moe_load_imbalance/layer_3": 1.04}
    assert "| load max/mean 1.31 1.04 |" in step_line(record, 10, StepClock())
