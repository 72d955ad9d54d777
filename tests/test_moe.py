"""Mixture of experts: the layer against a token-by-token reference, its losses' gradients, the grouped expert
kernel against the loop, and every layout training the one-process model (language-model loss, load-balancing and
z losses, expert loads).

Tolerances: the layer in float64 is the reference's math in another order (1e-12). The kernels in float32: the
same products summed in another order (1e-6, below). Layouts: those of tests/test_parallel.py (float32 reductions
in another order); measured over 8 steps at most 9.5e-7 on the loss, 4.8e-7 on the aux loss (about 2.5) and 1.9e-6
on the z loss (about 10: 2e-7 relative).
"""
import dataclasses
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nanoexp.model.experts import grouped_mm_takes
from nanoexp.model.moe import MoE, MoeLosses, MoeShape
from nanoexp.parallel.context import ParallelContext
from nanoexp.interop.hf_checkpoint import convert_to_hf
from tests.helpers import FAST, SLOW, compose_config, start_error, tiered, train
from tests.test_parallel import FIRST_STEP_ATOL, INTERLEAVED, LATER_STEP_ATOL, assert_same_steps

MOE = ["model=moe_tiny"]
STEPS = ["tokens.train_steps=8", "tokens.val_check_interval=0", "optimizer.learning_rate_scheduler.learning_rate=1e-3",
         "optimizer.learning_rate_scheduler.lr_warmup_steps=2"]
# FAST's 4 layers: layers 1 and 3 are MoE; 8 experts of width 96, top-2, one shared expert.
EP2 = ["parallelism.ep=2"]
LAYOUTS = {   # ep: expert parallelism over the dp x cp ranks (dp2ep2: dp4 in two ep groups)
    "ep2": ["parallelism=dp2tp1pp1"] + EP2,
    "ep4": ["parallelism=dp4tp1pp1", "parallelism.ep=4"],
    "dp2ep2-zero1": ["parallelism=dp4tp1pp1", "optimizer.zero_stage=1"] + EP2,
    "ep2tp2": ["parallelism=dp2tp2pp1"] + EP2,
    "ep2pp2-1f1b": ["parallelism=dp2tp1pp2"] + EP2,
    "ep2cp2": ["parallelism=dp1cp2tp1pp1"] + EP2,
    # without ep (ep2tp2 and ep2pp2 above run tp's all_reduce mode and 1F1B)
    "tp2-reduce_scatter": ["parallelism=dp1tp2pp1", "parallelism.tp_mode=reduce_scatter"],
    "pp2-interleaved": ["parallelism=dp1tp1pp2"] + INTERLEAVED,
    "ep2-dp2tp2pp2-reduce_scatter-recompute": ["parallelism=dp2tp2pp2", "parallelism.tp_mode=reduce_scatter",
                                               "parallelism.recompute_layer=true"] + EP2,
    "dp1cp2tp2-recompute": ["parallelism=dp1cp2tp2pp1", "parallelism.recompute_layer=true"],
    # an expert with no token on one rank leaves its gradient missing there: ZeRO-3 must keep one order
    "dp2pp2-zero3": ["parallelism=dp2tp1pp2", "optimizer.zero_stage=3"],
    "dp2cp2-zero1-normalized": ["parallelism=dp2cp2tp1pp1", "optimizer.zero_stage=1",
                                "model.moe.router=softmax_topk_normalized"],
    # experts sharded over edp by ZeRO-3; under sequence parallelism kept whole, their state sharded (ZeRO-2)
    "ep2-zero3": ["parallelism=dp2tp1pp1", "optimizer.zero_stage=3"] + EP2,
    "ep2tp2-reduce_scatter-zero2": ["parallelism=dp2tp2pp1", "parallelism.tp_mode=reduce_scatter",
                                    "optimizer.zero_stage=2"] + EP2,
    "ep4-dp2cp2": ["parallelism=dp2cp2tp1pp1", "parallelism.ep=4"],
    # zero bubble V: the stacked experts' weight gradients come in B (they are not linears), the rest's in W
    "ep2-zbv": ["parallelism=dp2tp1pp2", "parallelism.pp_engine=zbv", "parallelism.pp_virtual_stages=2"] + EP2,
    # the loop kernel, against its own one-process run
    "ep2tp2-loop": ["parallelism=dp2tp2pp1"] + EP2 + ["model.moe.expert_kernel=loop"],
}
AUX_ATOL, Z_ATOL = 1e-5, 1e-5   # measured 4.8e-7 and 1.9e-6 (module docstring)
# The gradient norm is where a wrong gradient shows (AdamW hides a wrongly scaled one from the loss): measured
# at most 2.2e-7 relative; expert gradients averaged over edp instead of dp x cp make it 6e-3.
GRAD_NORM_RTOL = 1e-5


# -- the layer ----------------------------------------------------------------------------------------
def make_layer(normalize: bool, shared: int = 1, capacity_factor: float | None = None) -> MoE:
    moe = MoeShape(num_experts=4, top_k=2, intermediate_size=6, num_shared_experts=shared, normalize_top_k=normalize,
                   aux_loss_coef=0.3, z_loss_coef=0.2, capacity_factor=capacity_factor)
    torch.manual_seed(0)
    layer = MoE(8, moe, MoeLosses(moe, [0]), 0).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return layer


def expert_output(layer: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e's SwiGLU on x, from its rows of the stacked weights."""
    experts = layer.experts
    return F.linear(F.silu(F.linear(x, experts.gate_proj[e])) * F.linear(x, experts.up_proj[e]), experts.down_proj[e])


def reference_forward(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the weighted sum of its top-k experts, plus the shared ones. With a capacity, an expert
    takes the first tokens in order that route to it, up to its capacity."""
    out, capacity, taken = [], layer.moe.capacity(x.numel() // x.shape[-1]), [0] * layer.moe.num_experts
    for token in x.reshape(-1, x.shape[-1]):
        probs = layer.router(token).softmax(-1)
        weights, chosen = probs.topk(layer.moe.top_k)
        if layer.moe.normalize_top_k:
            weights = weights / weights.sum()
        kept = [(w, int(e)) for w, e in zip(weights, chosen) if capacity is None or taken[int(e)] < capacity]
        for _, e in kept:
            taken[e] += 1
        y = sum((w * expert_output(layer, e, token) for w, e in kept), torch.zeros_like(token))
        out.append(y + (layer.shared_experts(token) if layer.shared_experts is not None else 0))
    return torch.stack(out).view(x.shape)


@pytest.mark.parametrize("normalize, shared, capacity_factor", [(False, 1, None), (True, 0, None), (False, 1, 0.5)])
def test_layer_is_the_weighted_sum_of_each_tokens_experts(normalize, shared, capacity_factor):
    layer = make_layer(normalize, shared, capacity_factor)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), reference_forward(layer, x), atol=1e-12, rtol=0)


def test_losses_enter_the_gradient_as_their_formulas_say():
    """One process, one micro-batch: backward of (output + attached losses) equals autograd of output plus
    coef x aux + coef x z, written out; the recorded values are those formulas."""
    layer = make_layer(normalize=False)
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    with layer.losses.training_forward():
        layer(x).sum().backward()
    ours = {n: p.grad.clone() for n, p in layer.named_parameters()}
    record, = layer.losses.records
    aux, z, counts = record.aux, record.z, record.counts
    assert record.dropped == 0
    layer.zero_grad()
    tokens = x.reshape(-1, 8)
    logits = layer.router(tokens)
    probs = logits.softmax(-1)
    chosen = probs.topk(2).indices
    share = torch.stack([(chosen == e).sum() for e in range(4)]).double() / (tokens.shape[0] * 2)
    expected_aux = 4 * (share * probs.mean(0)).sum()
    expected_z = torch.logsumexp(logits, -1).pow(2).mean()
    (reference_forward(layer, x).sum() + 0.3 * expected_aux + 0.2 * expected_z).backward()
    torch.testing.assert_close(aux, expected_aux.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(z, expected_z.detach(), atol=1e-12, rtol=0)
    assert counts.tolist() == [float((chosen == e).sum()) for e in range(4)]
    for name, p in layer.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, atol=1e-10, rtol=0, msg=name)


# -- the expert kernels ----------------------------------------------------------------------------
def kernel_run(kernel: str, capacity_factor: float | None, autocast: bool = False, width: int = 32):
    """Output and every gradient of a float32 layer (hidden 64, 64 experts of `width`, top-8, one shared) on 64
    tokens: 512 assignments, so some experts get no row."""
    moe = MoeShape(num_experts=64, top_k=8, intermediate_size=width, num_shared_experts=1, aux_loss_coef=0.3,
                   z_loss_coef=0.2, capacity_factor=capacity_factor, expert_kernel=kernel)
    torch.manual_seed(0)
    layer = MoE(64, moe, MoeLosses(moe, [0]), 0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2)))
    return {"output": y.detach(), "input": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}


@pytest.mark.parametrize("capacity_factor", [None, 0.5], ids=["dropless", "capacity"])
def test_grouped_kernel_gives_the_loops_output_and_gradients(capacity_factor):
    """float32: the same products, summed in another order: measured 4.8e-7 on values up to 38 (dropless), 0 with
    a capacity."""
    grouped, loop = kernel_run("grouped_mm", capacity_factor), kernel_run("loop", capacity_factor)
    for name in loop:
        torch.testing.assert_close(grouped[name], loop[name], atol=1e-6, rtol=0, msg=name)


def test_grouped_kernel_falls_back_to_the_loop_where_grouped_mm_does_not_run():
    """torch._grouped_mm on CPU (torch 2.13): float32, bf16 and fp16 with 16-byte rows, not float64; a bf16 width of
    12 runs the loop, bit for bit."""
    weights = torch.empty(4, 12, 64)
    assert grouped_mm_takes(torch.float32, weights) and not grouped_mm_takes(torch.float64, weights)
    assert not grouped_mm_takes(torch.bfloat16, weights) and grouped_mm_takes(torch.bfloat16, torch.empty(4, 16, 64))
    grouped, loop = (kernel_run(kernel, None, autocast=True, width=12) for kernel in ("grouped_mm", "loop"))
    for name in loop:
        assert torch.equal(grouped[name], loop[name]), name


# -- every layout trains the one-process model --------------------------------------------------------
def moe_curves(records, layers=(1, 3)) -> dict[str, np.ndarray]:
    steps = [r for r in records if "loss" in r]
    return {key: np.array([r[key] for r in steps]) for key in
            ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", *(f"moe_load_imbalance/layer_{n}" for n in layers))}


@pytest.fixture
def reference(train_once):
    return moe_curves(train_once(FAST + MOE + STEPS)[1])


@pytest.mark.slow
@pytest.mark.parametrize("name", tiered(LAYOUTS, quick=["ep2-dp2tp2pp2-reduce_scatter-recompute", "ep4-dp2cp2"]))
def test_layout_reproduces_single_process_moe_losses(name, train_once, tmp_path):
    ours = moe_curves(train(tmp_path, FAST + MOE + STEPS + LAYOUTS[name]))
    # a layout that changes the model (another router or kernel) against its own one-process run
    model = [o for o in LAYOUTS[name] if o.startswith("model.")]
    reference = moe_curves(train_once(FAST + MOE + STEPS + model)[1])
    assert len(ours["loss"]) == 8
    assert abs(ours["loss"][0] - reference["loss"][0]) < FIRST_STEP_ATOL
    np.testing.assert_allclose(ours["loss"], reference["loss"], atol=LATER_STEP_ATOL, rtol=0)
    np.testing.assert_allclose(ours["grad_norm"], reference["grad_norm"], rtol=GRAD_NORM_RTOL)
    np.testing.assert_allclose(ours["moe_aux_loss"], reference["moe_aux_loss"], atol=AUX_ATOL, rtol=0)
    np.testing.assert_allclose(ours["moe_z_loss"], reference["moe_z_loss"], atol=Z_ATOL, rtol=0)
    for layer in (1, 3):   # loads are counts: equal while the routing is (ties aside)
        key = f"moe_load_imbalance/layer_{layer}"
        np.testing.assert_allclose(ours[key], reference[key], atol=1e-6, rtol=0)


CAPACITY = ["model.moe.capacity_factor=1.0"]


@pytest.mark.parametrize("layout", [["parallelism=dp2tp1pp1"] + EP2, pytest.param(["parallelism=dp1tp2pp1"], marks=SLOW),
                                    pytest.param(["parallelism=dp1tp1pp2"], marks=SLOW)],
                         ids=["ep2", "tp2-all_reduce", "pp2"])
def test_a_capacity_drops_the_same_tokens_where_a_rank_holds_whole_micro_batches(layout, tmp_path, train_once):
    """A capacity counts a rank's tokens of the micro-batch: where every rank that routes holds the whole
    micro-batch (dp, tp without SP, pp) the same tokens are dropped as on one process; cp and SP are refused.
    Expert parallelism drops a token where it is routed, before it is sent: ep changes nothing here."""
    expected = train_once(FAST + MOE + STEPS + CAPACITY)[1]
    ours = train(tmp_path / "run", FAST + MOE + STEPS + CAPACITY + layout)
    dropped = [r["moe_dropped_fraction"] for r in expected if "loss" in r]
    assert 0 < min(dropped) and max(dropped) < 1   # measured 0.31-0.53: the early routing is uneven
    assert [r["moe_dropped_fraction"] for r in ours if "loss" in r] == dropped
    assert_same_steps(ours, expected, steps=range(1, 9))   # losses and gradient norms


def test_the_losses_train_the_router(reference, tmp_path):
    """Without the load-balancing and z losses the run differs (they reach the gradient), and the aux loss is
    at least its balanced value, 1 per MoE layer."""
    off = moe_curves(train(tmp_path, FAST + MOE + STEPS + ["model.moe.aux_loss_coef=0", "model.moe.z_loss_coef=0"]))
    assert off["loss"][0] == reference["loss"][0] and off["loss"][-1] != reference["loss"][-1]
    assert (reference["moe_aux_loss"] >= 2.0 - 1e-6).all()   # two MoE layers, each at least 1
    assert (reference["moe_load_imbalance/layer_1"] >= 1.0).all()


@pytest.mark.slow
def test_checkpoint_moves_between_layouts(tmp_path):
    constant = ["optimizer.learning_rate_scheduler.lr_decay_style=constant",
                "optimizer.learning_rate_scheduler.lr_warmup_steps=0"]
    run = FAST + MOE + STEPS + constant
    reference = train(tmp_path / "ref", run + ["tokens.train_steps=6"])
    a = train(tmp_path / "a", run + ["tokens.train_steps=3", "parallelism=dp2tp1pp2", "optimizer.zero_stage=3"] + EP2)
    b = train(tmp_path / "b", run + ["tokens.train_steps=6", "parallelism=dp1tp2pp1",
                                     "parallelism.tp_mode=reduce_scatter",
                                     f"checkpoint.resume_checkpoint_path={tmp_path}/a/checkpoints/3"])
    assert_same_steps(a + b, reference, steps=range(1, 7))   # losses and gradient norms
    with pytest.raises(ValueError, match="no Hugging Face architecture holds: model.moe.num_shared_experts=1"):
        convert_to_hf(str(tmp_path / "a" / "checkpoints" / "3"), str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf")


@pytest.mark.parametrize("overrides, message", [
    (["model.moe.top_k=9"], "model.moe.top_k=9: must be between 1 and model.moe.num_experts=8"),
    (["model.moe.router=sigmoid"],
     "model.moe.router=sigmoid: allowed values are softmax_topk, softmax_topk_normalized"),
    (CAPACITY + ["parallelism=dp1cp2tp1pp1"], "an expert's capacity counts a rank's tokens"),
    (CAPACITY + ["parallelism=dp1tp2pp1", "parallelism.tp_mode=reduce_scatter"], "use cp=1 and tp_mode=all_reduce"),
    (["parallelism=dp2tp1pp1", "parallelism.ep=4"], "parallelism.ep=4 does not divide parallelism.dp * cp = 2"),
    (["parallelism=dp2tp1pp1", "model.moe.num_experts=3", "model.moe.top_k=1"] + EP2,
     "model.moe.num_experts=3 is not divisible by parallelism.ep=2"),
    (["parallelism=dp2tp1pp1", "parallelism.ep=0"], "parallelism.ep=0: must be >= 1"),
])
def test_bad_moe_config_is_named(overrides, message):
    assert message in start_error(compose_config(MOE + overrides))


def test_expert_parallelism_needs_experts():
    assert "parallelism.ep=2 needs a mixture of experts" in start_error(compose_config(["parallelism=dp2tp1pp1"] + EP2))


# -- Hugging Face: a Mixtral ---------------------------------------------------------------------------
MIXTRAL = ["model.moe.num_shared_experts=0", "model.moe.layer_frequency=1", "model.moe.router=softmax_topk_normalized"]


def assert_mixtral_export_gives_our_logits(ckpt, folder):
    """Export checkpoint `ckpt` to `folder`; transformers' MixtralForCausalLM must give the checkpoint's logits
    (within the Llama export's bound). Returns the checkpoint's one-process model."""
    from transformers import MixtralForCausalLM

    from nanoexp.runtime.build import load_single_process
    from tests.test_hf_conversion import LOGITS_ATOL
    convert_to_hf(str(ckpt), str(folder))
    ours, _ = load_single_process(str(ckpt))
    hf = MixtralForCausalLM.from_pretrained(str(folder)).eval()
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(input_ids=ids), atol=LOGITS_ATOL, rtol=0)
    return ours


def test_mixtral_round_trip(tmp_path):
    """Trained on ep2 x pp2, exported: transformers' MixtralForCausalLM gives nanoexp's logits; imported back
    (convert_from_hf, then a resume on dp2), the weights are the same."""
    from nanoexp.interop.hf_checkpoint import convert_from_hf
    from nanoexp.runtime.build import load_single_process
    train(tmp_path / "run", FAST + MOE + MIXTRAL + ["tokens.train_steps=2", "tokens.val_check_interval=0",
                                                    "parallelism=dp2tp1pp2"] + EP2)
    ours = assert_mixtral_export_gives_our_logits(tmp_path / "run" / "checkpoints" / "2", tmp_path / "hf")
    convert_from_hf(str(tmp_path / "hf"), str(tmp_path / "back"), [])
    back, _ = load_single_process(str(tmp_path / "back" / "0"))
    for (name, p), q in zip(ours.named_parameters(), back.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=name)


# -- µP ----------------------------------------------------------------------------------------------
MUP = ["model.parametrization=mup", "model.mup.base_width=32"]   # FAST's hidden 64: m = 2


def test_mup_treats_the_router_as_an_output_layer_and_the_experts_as_hidden():
    """m = 2: the router keeps the init std and the rate (the "matrices" group, as the LM head) and its logits
    are multiplied by 1/m; the experts are hidden matrices (std / sqrt(m), lr / m)."""
    from nanoexp.runtime.build import build_model
    from nanoexp.optim.schedule import set_lr
    from nanoexp.runtime.optim import build_optimizer
    cfg = compose_config(FAST + MOE + MUP + ["model.model_config.hidden_size=256", "model.mup.base_width=64",
                                             "model.moe.moe_intermediate_size=256"])   # m = 4, enough draws
    model = build_model(cfg, ParallelContext())
    assert model.shape.moe.router_multiplier == 0.25
    std = cfg.model.init_method.std
    params = dict(model.named_parameters())
    assert params["model.layers.1.mlp.router.weight"].std().item() == pytest.approx(std, rel=0.05)
    assert params["model.layers.1.mlp.experts.up_proj"].std().item() == pytest.approx(std / 2, rel=0.05)
    optimizer = build_optimizer(cfg, model)
    set_lr(optimizer, 1e-3)
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    assert group_of[id(params["model.layers.1.mlp.router.weight"])]["lr"] == 1e-3
    assert group_of[id(params["model.layers.1.mlp.experts.up_proj"])]["lr"] == 1e-3 / 4
    # the multiplier on the logits: the layer routes as a standard one whose router weight is scaled by 1/m
    layer = model.model.layers["1"].mlp
    x = torch.randn(2, 8, 256)
    with torch.no_grad():
        ours = layer(x)
        layer.router.weight.mul_(0.25)
        layer.moe = dataclasses.replace(layer.moe, router_multiplier=1.0)
        torch.testing.assert_close(layer(x), ours, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_mup_moe_on_expert_parallel_layout_and_exported_to_mixtral(tmp_path):
    """µP with a MoE trains the one-process model on ep2 x pp2, and its Mixtral export (router multiplier
    folded into the router, as the logit multiplier into the LM head) gives nanoexp's logits."""
    run = FAST + MOE + MIXTRAL + MUP + STEPS + ["model.mup.attention_multiplier=4"]
    expected = moe_curves(train(tmp_path / "one", run))
    ours = moe_curves(train(tmp_path / "ep2pp2", run + ["parallelism=dp2tp1pp2"] + EP2))
    np.testing.assert_allclose(ours["loss"], expected["loss"], atol=LATER_STEP_ATOL, rtol=0)
    np.testing.assert_allclose(ours["grad_norm"], expected["grad_norm"], rtol=GRAD_NORM_RTOL)
    assert_mixtral_export_gives_our_logits(tmp_path / "ep2pp2" / "checkpoints" / "8", tmp_path / "hf")


@pytest.mark.slow
def test_bf16_expert_parallel_matches_one_bf16_process(tmp_path):
    """bf16 autocast on ep2: within the bf16 contract of tests/test_bf16_parity.py (measured 1.6e-4 relative
    on the loss, 1.2e-3 on the gradient norm; the routing in float32, the rows exchanged in float32)."""
    from tests.test_bf16_parity import GRAD_NORM_RTOL as BF16_GRAD_NORM_RTOL, LOSS_RTOL
    run = FAST + MOE + STEPS + ["model.dtype=bfloat16"]
    expected = moe_curves(train(tmp_path / "one", run))
    ours = moe_curves(train(tmp_path / "ep2", run + ["parallelism=dp2tp1pp1"] + EP2))
    np.testing.assert_allclose(ours["loss"], expected["loss"], rtol=LOSS_RTOL, atol=0)
    np.testing.assert_allclose(ours["grad_norm"], expected["grad_norm"], rtol=BF16_GRAD_NORM_RTOL, atol=0)


def test_olmoe_shape_counts_its_published_parameters_and_ep_shrinks_its_memory():
    """conf/model/olmoe_1b_7b: 6.9 B parameters, 1.3 B active (OLMoE's paper); on 8 GPUs with ZeRO-1, ep = 8
    holds 8 of the 64 experts per rank: the estimate falls from 61 to 19 GiB a rank (docs/moe.md)."""
    from nanoexp.observe.memory_estimate import estimate, total
    from nanoexp.model.shape import model_shape
    from nanoexp.model.llama import count_active_parameters, count_parameters
    from nanoexp.validation import validate
    per_rank = {}
    for ep in (1, 8):
        cfg = compose_config(["model=olmoe_1b_7b", "parallelism.dp=8", f"parallelism.ep={ep}", "optimizer.zero_stage=1",
                              "tokens.micro_batch_size=1", "tokens.sequence_length=4096",
                              "parallelism.recompute_layer=true"])
        validate(cfg, world_size=8)
        shape = model_shape(cfg)
        per_rank[ep] = total(estimate(cfg, shape, 0, "cuda")) / 2**30
    assert round(count_parameters(shape) / 1e9, 1) == 6.9 and round(count_active_parameters(shape) / 1e9, 1) == 1.3
    assert 55 < per_rank[1] < 65 and 15 < per_rank[8] < 22, per_rank
