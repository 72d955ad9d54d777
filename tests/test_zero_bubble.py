"""The zero-bubble schedule zb_h1 (schedules.py) and the backward split it runs (pipeline/weight_grad.py): the
weight gradients a B step leaves for its W, the order of each rank's steps against torch.distributed.pipelining's
own table, NCCL's rules, and training on every layout it supports as one process does (test_parallel.py's
tolerances: the split only reorders float32 sums)."""
import numpy as np
import pytest
import torch

from nanoexp.model.linear import Linear
from nanoexp.parallel.pipeline.schedules import compute_order
from nanoexp.parallel.pipeline.weight_grad import defer_weight_gradients
from nanoexp.verify.p2p_plan import check, named_plan
from nanoexp.verify.pipeline_bubble import idle_by_dependencies, idle_under_nccl
from tests.helpers import FAST, SLOW, compose_config, tiered, train, train_losses
from tests.test_parallel import STEPS, TIED, assert_same_curve, assert_same_steps

ZB = ["parallelism.pp_engine=zb_h1"]


# -- the split ---------------------------------------------------------------------------------------------------
def test_b_leaves_the_weight_gradient_to_w_and_w_gives_the_plain_one():
    torch.manual_seed(0)
    layer, x = Linear(8, 6), torch.randn(3, 5, 8)
    torch.nn.init.normal_(layer.weight)
    x_plain = x.clone().requires_grad_()
    layer(x_plain).square().sum().backward()
    expected, expected_x = layer.weight.grad.clone(), x_plain.grad
    layer.weight.grad, heard = None, []
    layer.weight.register_post_accumulate_grad_hook(lambda p: heard.append(p.grad.clone()))
    store = defer_weight_gradients(layer)
    x_split = x.clone().requires_grad_()
    with store.deferring((0, 7)):
        layer(x_split).square().sum().backward()
    assert layer.weight.grad is None and not heard   # B: the input's gradient only, no call of the weight's hooks
    torch.testing.assert_close(x_split.grad, expected_x, rtol=0, atol=0)
    store.run((0, 7))   # W: through autograd, so the gradient hooks hear of it
    torch.testing.assert_close(layer.weight.grad, expected, rtol=1e-6, atol=1e-6)
    assert len(heard) == 1 and not store.pending


# -- the schedule ------------------------------------------------------------------------------------------------
def torch_zb1p_order(pp: int, m: int, rank: int) -> list[tuple[str, int]]:
    """torch.distributed.pipelining's ScheduleInterleavedZeroBubble with one stage per rank (ZB-H1): its
    pipeline_order row for `rank`, as (F | B | W, micro-batch), without the idle slots it marks None. The table is
    computed from the shape alone (no process group is needed, so the schedule's own pieces are read)."""
    from torch.distributed.pipelining import schedules as torch_schedules
    table = object.__new__(torch_schedules.ScheduleInterleavedZeroBubble)
    table.pp_group_size, table.n_local_stages, table._n_microbatches, table.rank = pp, 1, m, rank
    table.number_of_rounds = max(1, m // pp)
    table.microbatches_per_round = m // table.number_of_rounds
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    return [(kinds[a.computation_type.name], a.microbatch_index)
            for a in table._calculate_single_rank_operations(rank) if a is not None]


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zb_h1_runs_torchs_order(pp):
    """Every rank's compute order equals torch's table for the micro-batch counts torch accepts (a multiple of its
    rounds of pp), m 1..16."""
    compared = 0
    for m in range(1, 17):
        if m % max(1, m // pp):
            continue
        for rank in range(pp):
            ours = [(kind, mb) for kind, _, mb in compute_order("zb_h1", pp, 1, m, rank)]
            assert ours == torch_zb1p_order(pp, m, rank), (pp, m, rank)
            compared += 1
    assert compared >= 8 * pp


def test_zb_h1_plans_pass_nccl_rules():
    """pp 2..8, m 1..16, training and evaluation, every message named (as test_p2p_plan.py checks the others)."""
    batches = sum(check(named_plan("zb_h1", pp, 1, m, forward_only)) for pp in range(2, 9) for m in range(1, 17)
                  for forward_only in (False, True))
    assert batches > 15_000


TIMES = [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (2.0, 1.0, 1.0)]   # (F, B, W): B and W split a backward


def test_zb_h1_order_has_the_papers_bubble():
    """With its data dependencies alone, zb_h1's order idles (p-1)(T_F + T_B - T_W) per rank, ZB-H1's figure
    (Qi et al. 2024, table 3), against 1f1b's (p-1)(T_F + T_B + T_W): a third of it when the three are equal."""
    for t_f, t_b, t_w in TIMES:
        for pp, m in [(2, 2), (2, 8), (4, 4), (4, 8), (8, 16)]:
            idle = idle_by_dependencies("zb_h1", pp, 1, m, t_f, t_b, t_w)
            assert idle == pytest.approx((pp - 1) * (t_f + t_b - t_w), abs=1e-12), (t_f, t_b, t_w, pp, m)


def test_under_nccl_rules_zb_h1_keeps_the_papers_bubble():
    """The engine posts each batch without waiting and waits for a received tensor only when its op runs
    (pipeline/mailbox.py), so a steady W runs while the next input is on the way: under NCCL's rules (batches in
    order on one stream, a send done once its receive is posted) zb_h1 still idles (p-1)(T_F + T_B - T_W), and 1f1b
    (p-1)(T_F + T_B + T_W). Waiting for each batch as a whole had cost zb_h1 (p-1)·T_W more for m > p."""
    for t_f, t_b, t_w in TIMES:
        for pp, m in [(2, 2), (2, 8), (4, 4), (4, 8), (8, 16)]:
            zero_bubble = idle_under_nccl("zb_h1", pp, 1, m, t_f, t_b, t_w)
            one_f_one_b = idle_under_nccl("1f1b", pp, 1, m, t_f, t_b, t_w)
            assert one_f_one_b == pytest.approx((pp - 1) * (t_f + t_b + t_w), abs=1e-12)
            assert zero_bubble == pytest.approx((pp - 1) * (t_f + t_b - t_w), abs=1e-12), (t_f, t_b, t_w, pp, m)


def test_w_fills_the_cool_down_of_1f1b():
    """Rank r defers its first r Ws to the end, where 1f1b idles; the last rank's, the most, fill its cool-down."""
    order = compute_order("zb_h1", 4, 1, 8, 3)
    assert [kind for kind, _, _ in order[-3:]] == ["W", "W", "W"]
    assert [kind for kind, _, _ in compute_order("zb_h1", 4, 1, 8, 0)][:5] == ["F", "F", "F", "F", "B"]


# -- training ----------------------------------------------------------------------------------------------------
CASES = {
    "dp1tp1pp2": ["parallelism=dp1tp1pp2"],
    "dp1tp1pp4": ["parallelism=dp1tp1pp4"],
    "dp2tp2pp2-reduce_scatter": ["parallelism=dp2tp2pp2", "parallelism.tp_mode=reduce_scatter"],
    "dp1cp2tp1pp2-recompute": ["parallelism=dp1cp2tp1pp2", "parallelism.recompute_layer=true"],
    "dp2tp1pp2-zero1": ["parallelism=dp2tp1pp2", "optimizer.zero_stage=1"],
    # ZeRO-2: B's gradients (norms, embedding) wait in .grad for the next W's reduce-scatters
    "dp2tp1pp2-zero2": ["parallelism=dp2tp1pp2", "optimizer.zero_stage=2"],
    # ZeRO-3: B gathers each layer's weights for the input's gradient and frees them; W reduce-scatters
    "dp2tp1pp2-zero3": ["parallelism=dp2tp1pp2", "optimizer.zero_stage=3"],
}
OTHER_MODELS = {   # name: (the model's overrides, the layout's)
    "tied-dp2tp1pp2-zero1": (TIED, ["parallelism=dp2tp1pp2", "optimizer.zero_stage=1"]),
    "moe-dp2tp1pp2-ep2": (["model=moe_tiny"], ["parallelism=dp2tp1pp2", "parallelism.ep=2"]),
}


@pytest.fixture
def one_process(train_once):
    """The one-process run of a model (its overrides), trained once per test session."""
    return lambda model: train_once(FAST + STEPS + model)[1]


@pytest.mark.parametrize("name", tiered(CASES, quick=["dp2tp1pp2-zero3"]))
def test_zb_h1_trains_the_one_process_model(name, tmp_path, one_process):
    assert_same_curve(train(tmp_path, FAST + STEPS + CASES[name] + ZB), one_process([]))


@pytest.mark.parametrize("name", tiered(OTHER_MODELS, quick=[]))
def test_zb_h1_trains_the_one_process_model_of_other_models(name, tmp_path, one_process):
    model, layout = OTHER_MODELS[name]
    assert_same_curve(train(tmp_path, FAST + STEPS + model + layout + ZB), one_process(model))


@SLOW
def test_zb_h1_in_bf16_keeps_the_bf16_contract(tmp_path, train_once):
    """bf16 autocast: W's product grad_out^T x runs in bf16 as autocast's linear backward does, summed in another
    order (measured 9.1e-5 relative loss at most over 10 steps of pp2): test_bf16_parity.py's tolerances."""
    from tests.test_bf16_parity import BF16, GRAD_NORM_RTOL, LOSS_RTOL, grad_norms
    one, split = train_once(BF16)[1], train(tmp_path / "zb", BF16 + ["parallelism=dp1tp1pp2"] + ZB)
    assert len(train_losses(split)) == len(train_losses(one)) == 8
    np.testing.assert_allclose(train_losses(split), train_losses(one), rtol=LOSS_RTOL, atol=0)
    np.testing.assert_allclose(grad_norms(split), grad_norms(one), rtol=GRAD_NORM_RTOL, atol=0)


def test_a_zb_h1_checkpoint_resumes_on_1f1b(tmp_path):
    run = FAST + STEPS + ["parallelism=dp1tp1pp2", "checkpoint.checkpoint_interval=5"]
    zero_bubble = train(tmp_path / "zb", run + ZB)
    resumed = train(tmp_path / "1f1b", run + [f"checkpoint.resume_checkpoint_path={tmp_path}/zb/checkpoints/5"])
    assert_same_steps(resumed, zero_bubble, steps=range(6, 11))


def test_the_runtime_counts_a_micro_batch_held_until_its_w(tmp_path):
    """The memory line's micro-batches in flight (the engine's count) hold each from its F to its W: on pp2 with
    m = 4, zb_h1's last rank keeps two where 1f1b's keeps one (its W runs after the next B), the same as the
    memory estimate's replay of the schedule."""
    import json
    from nanoexp.observe.memory_estimate import in_flight_layers
    from nanoexp.parallel.layout import Layout
    run = FAST + ["tokens.train_steps=2", "tokens.val_check_interval=0", "parallelism=dp1tp1pp2"]
    train(tmp_path, run + ZB)
    memory = json.load(open(tmp_path / "summary.json"))["memory"]
    assert [rank["micro_batches_in_flight"] for rank in memory] == [2, 2]
    cfg = compose_config(run + ZB)
    layers, _ = in_flight_layers(cfg, Layout.from_config(cfg), 1, [2])
    assert layers == 2 * 2   # two micro-batches of the stage's two layers
