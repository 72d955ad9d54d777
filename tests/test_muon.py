"""Muon (optimizer.optimizer_factory.name=muon): one process against torch.optim.Muon + torch.optim.AdamW built by
hand, layouts against one process, exact resume, and what validation refuses.

Layouts see the one-process gradients up to reduction order (float32, CPU/gloo) and orthogonalise them in
bfloat16, as torch.optim.Muon does: the tolerances below are measured, not AdamW's of tests/test_parallel.py.
"""
import copy
import os

import numpy as np
import pytest
import torch

from nanoexp.checkpoint import CheckpointReader
from nanoexp.optim.lr_table import lr_table
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.model.placement import value_name
from nanoexp.runtime.build import build_model
from nanoexp.optim import muon
from nanoexp.optim.muon import TensorParallelMuon, takes_muon
from nanoexp.optim.schedule import set_lr
from nanoexp.runtime.optim import build_optimizer
from tests.distributed import run_distributed
from tests.helpers import FAST, compose_config, compute_gradients, start_error, tiered, train, train_losses

MUON = ["optimizer.optimizer_factory.name=muon"]
STEPS = ["tokens.train_steps=8", "tokens.val_check_interval=0", "optimizer.learning_rate_scheduler.learning_rate=1e-3",
         "optimizer.learning_rate_scheduler.lr_warmup_steps=2"]
CONSTANT_LR = ["tokens.val_check_interval=0", "optimizer.learning_rate_scheduler.learning_rate=1e-3",
               "optimizer.learning_rate_scheduler.lr_warmup_steps=0",
               "optimizer.learning_rate_scheduler.lr_decay_style=constant"]


@pytest.mark.parametrize("shape, adjust_lr_fn", [((48, 16), "original"), ((16, 48), "match_rms_adamw")])
def test_update_equals_torch_muon_on_one_matrix(shape, adjust_lr_fn):
    """Tall and wide, both learning-rate adjustments, 3 steps: bit for bit (the same operations)."""
    torch.manual_seed(0)
    ours, theirs = torch.nn.Parameter(torch.randn(shape)), torch.nn.Parameter(torch.randn(shape))
    theirs.data.copy_(ours.data)
    a = TensorParallelMuon([ours], lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust_lr_fn)
    b = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust_lr_fn)
    for _ in range(3):
        grad = torch.randn(shape)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
    assert torch.equal(ours, theirs)
    assert torch.equal(a.state[ours]["momentum_buffer"], b.state[theirs]["momentum_buffer"])


def test_which_parameters_muon_takes():
    """The hidden matrices and the experts; not the embedding, the head, the router or the norms."""
    model = build_model(compose_config(["model=moe_tiny"] + FAST), ParallelContext())
    taken = {n for n, p in model.named_parameters() if takes_muon(value_name(n, p), p)}
    assert "model.layers.0.self_attn.q_proj.weight" in taken and "model.layers.1.mlp.experts.up_proj" in taken
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in taken
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.router.weight",
                 "model.layers.0.input_layernorm.weight", "model.norm.weight"):
        assert name not in taken, name


def test_one_process_equals_torch_muon_and_adamw_by_hand():
    """8 steps of nanoexp's optimizer against torch.optim.Muon on the matrices takes_muon names and
    torch.optim.AdamW (weight decay on 2-D only) on the rest, on the same model and batches."""
    cfg = compose_config(FAST + MUON + ["optimizer.weight_decay=0.1"])
    torch.manual_seed(0)
    model = build_model(cfg, ParallelContext())
    twin = copy.deepcopy(model)
    ours = build_optimizer(cfg, model)
    f, lr = cfg.optimizer.optimizer_factory, 1e-3
    named = [(value_name(n, p), p) for n, p in twin.named_parameters()]
    torch_muon = torch.optim.Muon([p for n, p in named if takes_muon(n, p)], lr=lr, weight_decay=0.1)
    adamw = torch.optim.AdamW([{"params": [p for n, p in named if not takes_muon(n, p) and p.ndim == 2]},
                               {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0}],
                              lr=lr, betas=(f.adam_beta1, f.adam_beta2), eps=f.adam_eps, weight_decay=0.1,
                              foreach=True)
    vocab = cfg.model.model_config.vocab_size
    for step in range(8):
        tokens = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(step))
        for m in (model, twin):
            m(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        set_lr(ours, lr)
        ours.step()
        torch_muon.step()
        adamw.step()
        for optimizer in (ours, torch_muon, adamw):
            optimizer.zero_grad()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name   # measured: bit for bit
    pairs = [(p, q) for p, q in zip(model.parameters(), twin.parameters()) if q in torch_muon.state]
    assert len(pairs) == 7 * cfg.model.model_config.num_hidden_layers and all(
        torch.equal(ours.state[p]["momentum_buffer"], torch_muon.state[q]["momentum_buffer"]) for p, q in pairs)


# Layouts against one process over 8 steps (FAST, lr 1e-3 after 2 warm-up steps).
LAYOUTS = {
    "dp2tp1pp2": ["parallelism=dp2tp1pp2"],
    "dp1cp2tp1pp1": ["parallelism=dp1cp2tp1pp1"],
    "dp1tp1pp2-interleaved": ["parallelism=dp1tp1pp2", "parallelism.pp_engine=interleaved_1f1b",
                              "parallelism.pp_virtual_stages=2"],
    "dp1tp2pp1-all_reduce": ["parallelism=dp1tp2pp1"],
    "dp1tp2pp1-reduce_scatter": ["parallelism=dp1tp2pp1", "parallelism.tp_mode=reduce_scatter"],
    # ZeRO: the momentum sharded in flat pieces that cut across matrices; the update direction put together
    "dp2-zero1": ["parallelism=dp2tp1pp1", "optimizer.zero_stage=1"],
    "dp2-zero2": ["parallelism=dp2tp1pp1", "optimizer.zero_stage=2"],
    "dp2tp2pp2-reduce_scatter-zero3": ["parallelism=dp2tp2pp2", "parallelism.tp_mode=reduce_scatter",
                                       "optimizer.zero_stage=3"],
    "dp2cp2-zero3": ["parallelism=dp2cp2tp1pp1", "optimizer.zero_stage=3"],
}
# Measured over 8 steps (dp2pp2, cp2, tp2 in both modes): step 1 equal (loss and grad_norm: 0 difference); step 2's
# grad_norm, the first read after a Muon update, within 5.5e-7 relative, so the first update matches to float32
# rounding (a wrong gather or slice moves it by far more); later, bfloat16 Newton–Schulz turns one-ulp differences
# of the gradients into whole bfloat16 roundings of the update, and the curves drift to 2.8e-5 in the loss and
# 3.0e-5 relative in the grad_norm by step 8. Tolerances: about 3x the measured figures.
FIRST_UPDATE_GRAD_NORM_RTOL = 2e-6
MUON_LOSS_ATOL = 1e-4
MUON_GRAD_NORM_RTOL = 1e-4


# moe_tiny: experts are Muon's matrices, orthogonalised one by one where they live (ep), put together from
# ZeRO's pieces over the edp ranks holding them; the router is AdamW's. With bfloat16 Newton–Schulz a layout's
# 1e-5 drift can flip a near-tie routing choice: ep2 measured a 1.6e-3 jump of one step's grad_norm (the loss
# within 9.5e-5), where float32 Newton–Schulz gives 4.8e-7 (loss) and 1.4e-7 (grad_norm) on every step. So the
# MoE layouts run Newton–Schulz in float32 on both sides and are held to AdamW's tolerances: the distributed
# update itself (the expert gathers, the edp pieces) is what they check; the bfloat16 path is the dense layouts'.
MOE_LOSS_ATOL, MOE_GRAD_NORM_RTOL = 2e-6, 1e-6
MOE_LAYOUTS = {
    "ep2": ["parallelism=dp2tp1pp1", "parallelism.ep=2"],
    "tp2-reduce_scatter": ["parallelism=dp1tp2pp1", "parallelism.tp_mode=reduce_scatter"],
    "dp2cp2-ep2-zero3": ["parallelism=dp2cp2tp1pp1", "parallelism.ep=2", "optimizer.zero_stage=3"],
}


@pytest.fixture
def reference(train_once):
    return train_once(FAST + STEPS + MUON)[1]


def orthogonalise_in_float32(update, coefficients=muon.NS_COEFFICIENTS, steps=5, eps=muon.EPS):
    """muon.orthogonalise's iteration in float32 (the same operations, without the bfloat16 casts)."""
    a, b, c = coefficients
    tall = update.shape[0] > update.shape[1]
    x = update.float().T if tall else update.float()
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(muon, "orthogonalise", orthogonalise_in_float32)
        return train(tmp_path_factory.mktemp("muon_moe_reference"), FAST + STEPS + MUON + ["model=moe_tiny"])


@pytest.mark.slow
@pytest.mark.parametrize("name", tiered(LAYOUTS, quick=["dp2tp2pp2-reduce_scatter-zero3"]))
def test_layout_reproduces_single_process(name, reference, tmp_path):
    assert_like_one_process(train(tmp_path, FAST + STEPS + MUON + LAYOUTS[name]), reference)


@pytest.mark.slow
@pytest.mark.parametrize("name", tiered(MOE_LAYOUTS, quick=["dp2cp2-ep2-zero3"]))
def test_moe_layout_reproduces_single_process(name, moe_reference, tmp_path, monkeypatch):
    monkeypatch.setattr(muon, "orthogonalise", orthogonalise_in_float32)   # local workers fork: they inherit it
    records = train(tmp_path, FAST + STEPS + MUON + ["model=moe_tiny"] + MOE_LAYOUTS[name])
    losses, expected = train_losses(records), train_losses(moe_reference)
    assert len(losses) == 8
    np.testing.assert_allclose(losses, expected, atol=MOE_LOSS_ATOL, rtol=0)
    np.testing.assert_allclose([r["grad_norm"] for r in records if "loss" in r],
                               [r["grad_norm"] for r in moe_reference if "loss" in r], rtol=MOE_GRAD_NORM_RTOL, atol=0)


def assert_like_one_process(records, reference):
    losses, expected = train_losses(records), train_losses(reference)
    norms = [r["grad_norm"] for r in records if "loss" in r]
    expected_norms = [r["grad_norm"] for r in reference if "loss" in r]
    assert len(losses) == len(expected) == 8
    assert abs(losses[0] - expected[0]) < 1e-5
    np.testing.assert_allclose(norms[:1], expected_norms[:1], rtol=5e-7, atol=0)
    np.testing.assert_allclose(norms[1], expected_norms[1], rtol=FIRST_UPDATE_GRAD_NORM_RTOL, atol=0)
    np.testing.assert_allclose(losses, expected, atol=MUON_LOSS_ATOL, rtol=0)
    np.testing.assert_allclose(norms, expected_norms, rtol=MUON_GRAD_NORM_RTOL, atol=0)


@pytest.mark.slow   # 12-45 s under load: out of the quick tier (the whole suite runs it)
def test_exact_resume_and_adamw_state_is_not_loaded(tmp_path, caplog):
    """A Muon run resumed from its step-3 checkpoint continues bit for bit (momentum_buffer saved beside AdamW's
    moments); an AdamW checkpoint resumed with Muon says that its state is not loaded."""
    run = FAST + CONSTANT_LR + MUON + ["checkpoint.checkpoint_interval=3"]
    full = train_losses(train(tmp_path / "full", run + ["tokens.train_steps=6"]))
    ckpt = tmp_path / "full" / "checkpoints"
    assert {kind for _, kind in CheckpointReader(str(ckpt / "3")).pieces} == {
        "param", "momentum_buffer", "exp_avg", "exp_avg_sq"}
    resumed = train_losses(train(tmp_path / "resumed", run + ["tokens.train_steps=6",
                                                                f"checkpoint.resume_checkpoint_path={ckpt}/3"]))
    assert resumed == full[3:]   # bit for bit
    train(tmp_path / "adamw", FAST + CONSTANT_LR + ["tokens.train_steps=2"])
    with caplog.at_level("INFO", logger="nanoexp"):
        train(tmp_path / "switched", run + ["tokens.train_steps=3",
                                            f"checkpoint.resume_checkpoint_path={tmp_path}/adamw/checkpoints/2"])
    assert "optimizer state is adamW's, this run's optimizer.optimizer_factory.name=muon: that state is not loaded" \
        in caplog.text


def test_a_bad_muon_setting_is_named():
    key = "optimizer.optimizer_factory.muon_adjust_lr_fn=none"
    message = start_error(compose_config(FAST + MUON + [key]))
    lines = [line for line in message.splitlines() if key in line]
    assert len(lines) == 1 and "allowed values" in lines[0], message


@pytest.mark.slow
def test_momentum_moves_between_zero_stages_and_layouts(tmp_path):
    """Saved by ZeRO-3 on dp2 tp2 (momentum in flat pieces of tp shards), resumed on one process, saved, resumed by
    ZeRO-1 on dp2 pp2: the curve stays the one-process run's, to the layouts' tolerance. The optimizer state lost
    on the way (checkpoint.load_optimizer=false from the first checkpoint) moves step 4's loss by 1.3e-3 here
    (measured), 12x the tolerance."""
    run = FAST + CONSTANT_LR + MUON + ["checkpoint.checkpoint_interval=2"]
    reference = train(tmp_path / "ref", run + ["tokens.train_steps=6"])
    a = train(tmp_path / "a", run + ["tokens.train_steps=2", "parallelism=dp2tp2pp1",
                                     "parallelism.tp_mode=reduce_scatter", "optimizer.zero_stage=3"])
    b = train(tmp_path / "b", run + ["tokens.train_steps=4", f"checkpoint.resume_checkpoint_path={tmp_path}/a/checkpoints/2"])
    c = train(tmp_path / "c", run + ["tokens.train_steps=6", "parallelism=dp2tp1pp2", "optimizer.zero_stage=1",
                                     f"checkpoint.resume_checkpoint_path={tmp_path}/b/checkpoints/4"])
    losses = train_losses(a) + train_losses(b) + train_losses(c)
    np.testing.assert_allclose(losses, train_losses(reference), atol=MUON_LOSS_ATOL, rtol=0)


def test_show_lrs_lists_which_optimizer_takes_each_parameter():
    """make_config.py --show-lrs splits each group by optimizer with takes_muon's rule: on moe_tiny the embedding,
    the head and the routers go to AdamW with the norms, every other matrix to Muon."""
    cfg = compose_config(["model=moe_tiny"] + MUON)
    rows = {tuple(line.split()[:3]): line for line in lr_table(cfg).splitlines()}
    muon_row, adamw_row = rows["matrices", "muon", "76"], rows["matrices", "adamW", "4"]
    assert "mlp.router" in adamw_row and "model.embed_tokens" in adamw_row and "lm_head" in adamw_row
    assert "mlp.router" not in muon_row and "self_attn.q_proj" in muon_row and "mlp.experts.7.down_proj" in muon_row
    assert ("vectors", "adamW", "9") in rows and "muon_adjust_lr_fn=original" in lr_table(cfg)


def _state_bytes(rank, world, overrides):
    """Bytes of the optimizer state after one step, and the estimate's, on this rank."""
    from nanoexp.observe.memory_estimate import estimate
    from nanoexp.model.shape import model_shape
    from nanoexp.runtime.trainer import Trainer
    from nanoexp.checks import check_config
    cfg = compose_config(FAST + MUON + overrides)
    check_config(cfg, world)
    ctx = ParallelContext(Layout.from_config(cfg))
    trainer = Trainer(cfg, ctx, run_dir=os.devnull)
    trainer.train_step(trainer.batches.next_step(), 1e-3)
    trainer.batches.close()
    held = sum(t.numel() * t.element_size() for state in trainer.optimizer.state.values()
               for t in state.values() if torch.is_tensor(t) and t.numel() > 1)   # AdamW's scalar step left out
    return held, estimate(cfg, model_shape(cfg), ctx.pp_rank)["optimizer"]


@pytest.mark.parametrize("world, overrides", [(1, []), (2, ["parallelism=dp2tp1pp1", "optimizer.zero_stage=1"]),
                                              (2, ["parallelism=dp1tp2pp1"])], ids=["one", "dp2-zero1", "tp2"])
def test_the_memory_estimate_counts_one_momentum_for_muons_matrices(world, overrides):
    """Muon keeps one float32 momentum per element of its matrices, AdamW two moments for the rest: the estimate's
    optimizer bytes are what the state holds, to the padding of ZeRO's flat units (under 0.1 %)."""
    for held, estimated in run_distributed(_state_bytes, world, overrides):
        assert abs(held - estimated) <= 1e-3 * held, (held, estimated)


def _muon_bytes(rank, world, overrides):
    """Bytes Muon's own update sends per step on this rank, by group, and the analytic figures (docs/optimizers.md):
    tp, an all-gather of each matrix's direction, (tp-1) x its shard; ZeRO, an all-reduce over dp x cp of each
    (tp-local) matrix, 2(d-1)/d of it."""
    from nanoexp.verify.comm_counter import CommCounter
    from nanoexp.runtime.trainer import Trainer
    from nanoexp.checks import check_config
    cfg = compose_config(FAST + MUON + overrides)
    check_config(cfg, world)
    ctx = ParallelContext(Layout.from_config(cfg))
    trainer = Trainer(cfg, ctx, run_dir=os.devnull)
    compute_gradients(trainer, trainer.batches.next_step())
    trainer.batches.close()
    optimizer = getattr(trainer.optimizer, "inner", trainer.optimizer)   # ZeRO's ShardedOptimizer wraps it
    with CommCounter({"tp": ctx.tp_group, "dp_cp": ctx.dp_cp_group}) as comm:
        optimizer.muon.step()
    names = {id(p): value_name(n, p) for n, p in trainer.model.named_parameters()}
    local = sum(4 * p.numel() for p in trainer.model.parameters() if takes_muon(names[id(p)], p))
    d = ctx.dp_cp
    analytic = {"tp": (ctx.tp - 1) * local, "dp_cp": 2 * (d - 1) * local // d if cfg.optimizer.zero_stage else 0}
    totals = comm.totals()
    return {group: (totals.get(group, {}).get("sent_bytes", 0), analytic[group]) for group in ("tp", "dp_cp")}


@pytest.mark.parametrize("overrides", [["parallelism=dp1tp2pp1"], ["parallelism=dp2tp1pp1", "optimizer.zero_stage=1"],
                                       ["parallelism=dp2tp2pp1", "optimizer.zero_stage=3"]],
                         ids=["tp2", "dp2-zero1", "dp2tp2-zero3"])
def test_muon_sends_the_analytic_bytes(overrides):
    """Counted by verify/comm_counter around Muon's step alone, against the figures of docs/optimizers.md."""
    for rank in run_distributed(_muon_bytes, 4 if "dp2tp2" in overrides[0] else 2, overrides):
        for group, (sent, analytic) in rank.items():
            assert sent == analytic, (group, sent, analytic)


@pytest.mark.slow   # 12-45 s under load: out of the quick tier (the whole suite runs it)
def test_coord_check_muon_under_mup_keeps_activations_steady_as_width_grows():
    """Muon under µP (optim/muon.py's hidden_lr_scale, through model/mup.py's lr_scale: no width multiplier on
    Muon's hidden matrices with the original adjustment, whose update has the same spectral norm at every width;
    µP's init, logit multiplier and AdamW rates for the rest). Widths 32, 64, 128 after 3 steps at lr 1e-2 (2026-12-03): under µP the attention, MLP and logit
    RMS stay within 1.28x across the 4x width range (lr 3e-2: 1.40x; match_rms_adamw with its 1/sqrt(m): 1.41x),
    under the standard parametrization they grow 3.0-10.4x. Bounds: µP within 1.5x, standard at least 2x up."""
    from benchmarks.mup_coord_check import coord_check
    rows = coord_check([32, 64, 128], steps=4, lr=1e-2, seeds=1, layers=2,
                       extra=["tokens.sequence_length=32", "tokens.global_batch_size=8"] + MUON)

    def rms(parametrization, activation):
        return [r["rms"] for r in rows if (r["parametrization"], r["activation"], r["step"])
                == (parametrization, activation, 4)]

    for activation in ("attention", "mlp", "logits"):
        mup, standard = rms("mup", activation), rms("standard", activation)
        assert max(mup) / min(mup) < 1.5, (activation, mup)
        assert standard == sorted(standard) and standard[-1] / standard[0] > 2, (activation, standard)


def test_mup_rates_of_muons_matrices():
    """The one rule (model/mup.py): hidden matrices get 1/m under AdamW, 1 under Muon's original adjustment,
    1/sqrt(m) under match_rms_adamw; their weight decay is over that scale (lr x wd independent of width)."""
    base = ["model.parametrization=mup", "model.mup.base_width=16"]   # FAST's hidden 64: m = 4
    for optimizer, scale in ((["optimizer.optimizer_factory.name=adamW"], 0.25), (MUON, 1.0),
                             (MUON + ["optimizer.optimizer_factory.muon_adjust_lr_fn=match_rms_adamw"], 0.5)):
        cfg = compose_config(FAST + base + optimizer)
        model = build_model(cfg, ParallelContext())
        hidden = [g for g in build_optimizer(cfg, model).param_groups if g.get("group") == "hidden"]
        assert hidden and all(g["lr_scale"] == scale and g["weight_decay"] == 0.1 / scale for g in hidden)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallelism=dp2tp2pp2", "parallelism.tp_mode=reduce_scatter"],
                                    ["parallelism=dp2tp1pp1", "optimizer.zero_stage=1"]], ids=["dp2tp2pp2-SP", "zero1"])
def test_bf16_layout_matches_one_bf16_process(layout, tmp_path):
    """Muon under bf16 autocast, against one bf16 process, to tests/test_bf16_parity.py's contract (measured: loss
    within 6.6e-4 absolute, about 1.1e-4 relative, grad_norm 1.7e-3 relative on dp2 tp2 pp2 SP; ZeRO-1 3.7e-5 and
    6.5e-6)."""
    from tests.test_bf16_parity import GRAD_NORM_RTOL, LOSS_RTOL
    bf16 = FAST + STEPS + MUON + ["model.dtype=bfloat16"]
    expected, records = train(tmp_path / "one", bf16), train(tmp_path / "layout", bf16 + layout)
    np.testing.assert_allclose(train_losses(records), train_losses(expected), rtol=LOSS_RTOL, atol=0)
    np.testing.assert_allclose([r["grad_norm"] for r in records if "loss" in r],
                               [r["grad_norm"] for r in expected if "loss" in r], rtol=GRAD_NORM_RTOL, atol=0)


@pytest.mark.slow
def test_the_optimizer_bench_times_both_optimizers(tmp_path):
    """benchmarks/bench_optimizer.py: each optimizer's step and its share of the step, from the real Trainer."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_optimizer.py"), "--layouts",
                             "dp1tp1pp1", "--steps", "1", "--warmup", "0", *FAST], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("dp1tp1pp1 ")]
    assert [row[1] for row in rows] == ["adamW", "muon"] and all(row[-1].endswith("%") for row in rows), result.stdout


@pytest.mark.parametrize("override, message", [
    ("optimizer.optimizer_factory.muon_adjust_lr_fn=sqrt",
     "optimizer.optimizer_factory.muon_adjust_lr_fn=sqrt: allowed values are original, match_rms_adamw"),
    ("optimizer.optimizer_factory.muon_ns_coefficients=[3.4,-4.7]",
     "optimizer.optimizer_factory.muon_ns_coefficients=[3.4, -4.7]: must be three numbers (a, b, c)"),
    ("parallelism.dp_shard=1", "parallelism.dp_shard=1: Muon gathers its matrices over all of dp x cp and has no "
     "hybrid sharding; use AdamW or parallelism.dp_shard=null"),
    ("optimizer.optimizer_factory.muon_ns_coefficients=[1e30,1e30,1e30]",
     "optimizer.optimizer_factory.muon_ns_coefficients=[1e+30, 1e+30, 1e+30]: the Newton–Schulz iteration diverges "
     "in 5 steps (muon_ns_steps) on a unit-norm matrix, its singular values pass 1000; torch's are "
     "[3.4445, -4.775, 2.0315]")])
def test_muons_own_settings_are_checked_by_its_registry_entry(override, message):
    """Muon's OPTIMIZERS entry says what of its settings cannot run (optim/muon.py problems), one line naming the
    key."""
    assert message in start_error(compose_config(FAST + MUON + [override]))
    assert muon.problems(compose_config(FAST + MUON)) == []


@pytest.mark.parametrize("coefficients, steps, diverges", [
    ((3.4445, -4.775, 2.0315), 5, False), ((3.4445, -4.775, 2.0315), 99, False),   # torch's, any number of steps
    ((1.5, -0.5, 0.0), 5, False), ((1.875, -1.25, 0.375), 5, False),   # cubic and quintic Newton–Schulz
    ((1e30, 1e30, 1e30), 5, True), ((100.0, 0.0, 0.0), 5, True),
    ((8.2872, -23.5959, 17.3004), 5, True)])   # Polar Express's first step, repeated: it leaves [0, 1]
def test_coefficients_whose_iteration_diverges_are_found(coefficients, steps, diverges):
    """The check iterates the singular values' polynomial; the real orthogonalisation of a unit-norm matrix agrees:
    bounded (every singular value below 2) where the check passes, past its bound or not finite where it fails."""
    assert muon.diverges(coefficients, steps) == diverges
    matrix = torch.linspace(-1, 1, 64 * 32).reshape(64, 32).sin()   # full rank, no random generator
    update = muon.orthogonalise(matrix, coefficients, steps).float()
    bounded = bool(update.isfinite().all()) and torch.linalg.svdvals(update).max() < 2
    assert bounded == (not diverges)
