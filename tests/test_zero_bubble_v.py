"""The V-shaped zero-bubble schedule zbv (schedules.py): two chunks per rank placed V-wise (stages.py), its order
against torch.distributed.pipelining's ScheduleZBVZeroBubble table, its messages under NCCL's rules, its bubble
simulated, and training on every layout it supports as one process does (test_parallel.py's tolerances: the
split and the placement only reorder float32 sums)."""
import numpy as np
import pytest

from nanoexp.parallel.layout import Layout
from nanoexp.parallel.pipeline.schedules import compute_order, schedule, stage_map
from nanoexp.parallel.pipeline.stages import StageMap
from nanoexp.verify.p2p_plan import check, named_plan
from nanoexp.verify.pipeline_bubble import idle_by_dependencies, idle_under_nccl
from tests.helpers import FAST, SLOW, compose_config, start_error, tiered, train, train_losses
from tests.test_parallel import STEPS, TIED, assert_same_curve, assert_same_steps
from tests.test_zero_bubble import TIMES, one_process  # noqa: F401 (a fixture)

ZBV = ["parallelism.pp_engine=zbv", "parallelism.pp_virtual_stages=2"]


# -- the placement -----------------------------------------------------------------------------------------------
def test_v_placement_goes_down_the_ranks_and_back():
    stages = StageMap(4, 2, "v")
    assert [stages.stage(0, r) for r in range(4)] == [0, 1, 2, 3]
    assert [stages.stage(1, r) for r in range(4)] == [7, 6, 5, 4]
    assert all(stages.holder(stages.stage(c, r)) == (r, c) for r in range(4) for c in range(2))
    assert stages.head_rank == 0 and StageMap(4, 2).head_rank == 3
    # the V's tip: the last rank hands chunk 0's output to its own chunk 1, and chunk 1's input gradient back
    assert stages.is_local(("send", "F", 0, 0), 3) and stages.is_local(("send", "B", 1, 0), 3)
    assert stages.peer(("send", "F", 1, 0), 3) == 2 and stages.other_end(("send", "F", 1, 0), 0) is None


def test_the_layout_puts_embedding_and_head_on_rank_0():
    layout = Layout(pp=2, schedule="zbv", virtual_stages=2)
    assert layout.stage_layers(4, 0) == [range(0, 1), range(3, 4)]
    assert layout.stage_layers(4, 1) == [range(1, 2), range(2, 3)]
    assert layout.head_rank == 0 and layout.tied_stages == (0,)
    # tied: the head is the embedding tensor itself (one rank), no copy to keep in step
    assert layout.lm_head_weight(0, tied=True) == "embedding" and layout.lm_head_weight(1, tied=True) is None
    assert not layout.embedding_has_copy(0, tied=True)


# -- the schedule ------------------------------------------------------------------------------------------------
def torch_zbv_order(pp: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """torch.distributed.pipelining's ScheduleZBVZeroBubble: its pipeline_order row for `rank` as (F | B | W,
    virtual stage, micro-batch), without the idle slots it marks None (computed from the shape alone)."""
    from torch.distributed.pipelining import schedules as torch_schedules
    table = object.__new__(torch_schedules.ScheduleZBVZeroBubble)
    table.pp_group_size, table._n_microbatches, table.num_stages, table.rank = pp, m, 2 * pp, rank
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    return [(kinds[a.computation_type.name], a.stage_index, a.microbatch_index)
            for a in table._calculate_single_rank_operations(rank) if a is not None]


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zbv_runs_torchs_order(pp):
    """Every rank's compute order, as virtual stages, equals torch's table for m 1..16."""
    stages = stage_map("zbv", pp, 2)
    for m in range(1, 17):
        for rank in range(pp):
            ours = [(kind, stages.stage(chunk, rank), mb) for kind, chunk, mb in compute_order("zbv", pp, 2, m, rank)]
            assert ours == torch_zbv_order(pp, m, rank), (pp, m, rank)


def test_zbv_plans_pass_nccl_rules():
    """pp 2..8, m 1..16, training and evaluation, every message named: on each channel (which carries activations
    one way and gradients the other under V placement) the receiver asks in the order the sender sends."""
    batches = sum(check(named_plan("zbv", pp, 2, m, forward_only)) for pp in range(2, 9) for m in range(1, 17)
                  for forward_only in (False, True))
    assert batches > 20_000


def test_the_v_tip_is_handed_over_in_memory():
    steps = schedule("zbv", 4, 2, 8, 3)
    local = [step[1] for step in steps if step[0] == "LOCAL"]
    assert sorted(local) == sorted([("send", "F", 0, mb) for mb in range(8)] + [("send", "B", 1, mb) for mb in range(8)])
    assert not any(msg[0] == "send" and msg[1:3] in {("F", 0), ("B", 1)} for step in steps if step[0] == "P2P"
                   for msg in step[1])


def test_zbv_order_halves_zb_h1s_bubble():
    """By its data dependencies alone zbv idles (p-1)(T_F + T_B - T_W)/2 (half of ZB-H1's figure: each chunk is half
    a stage) when T_F <= T_B, and less than zb_h1 in every case tried."""
    for t_f, t_b, t_w in TIMES:
        for pp, m in [(2, 4), (2, 8), (4, 8), (8, 16)]:
            zbv = idle_by_dependencies("zbv", pp, 2, m, t_f, t_b, t_w)
            zb_h1 = idle_by_dependencies("zb_h1", pp, 1, m, t_f, t_b, t_w)
            assert zb_h1 == pytest.approx((pp - 1) * (t_f + t_b - t_w), abs=1e-12)
            if t_f <= t_b:
                assert zbv == pytest.approx((pp - 1) * (t_f + t_b - t_w) / 2, abs=1e-12), (t_f, t_b, t_w, pp, m)
            assert zbv < zb_h1


def test_zbv_under_nccl_rules():
    """Under NCCL's rules (the engine's posting, batches in order on one stream: pipeline_bubble.idle_under_nccl)
    zbv keeps its dependency bound on two ranks; on four and eight the in-order stream costs it more (a receive
    posted early holds the batches behind it), leaving it below 1f1b but not below zb_h1 with equal times."""
    measured = {}
    for t_f, t_b, t_w in TIMES:
        for pp, m in [(2, 8), (4, 8), (8, 16)]:
            zbv = idle_under_nccl("zbv", pp, 2, m, t_f, t_b, t_w)
            assert zbv < idle_under_nccl("1f1b", pp, 1, m, t_f, t_b, t_w)
            measured[t_f, t_b, t_w, pp] = zbv
            if pp == 2:
                assert zbv == pytest.approx(idle_by_dependencies("zbv", pp, 2, m, t_f, t_b, t_w), abs=1e-12)
    assert measured[1.0, 1.0, 1.0, 4] == pytest.approx(3.5) and measured[1.0, 1.0, 1.0, 8] == pytest.approx(9.5)


# -- training ----------------------------------------------------------------------------------------------------
EIGHT_LAYERS = ["model.model_config.num_hidden_layers=8"]   # pp4 x 2 chunks
CASES = {   # name: (model overrides, layout overrides)
    "dp1tp1pp2": ([], ["parallelism=dp1tp1pp2"]),
    "dp1tp1pp4": (EIGHT_LAYERS, ["parallelism=dp1tp1pp4"]),
    "dp2tp2pp2-reduce_scatter": ([], ["parallelism=dp2tp2pp2", "parallelism.tp_mode=reduce_scatter"]),
    "dp1cp2tp1pp2-recompute": ([], ["parallelism=dp1cp2tp1pp2", "parallelism.recompute_layer=true"]),
    "dp2tp1pp2-zero1": ([], ["parallelism=dp2tp1pp2", "optimizer.zero_stage=1"]),
    "dp2tp1pp2-zero2": ([], ["parallelism=dp2tp1pp2", "optimizer.zero_stage=2"]),
    "dp2tp1pp2-zero3-recompute": ([], ["parallelism=dp2tp1pp2", "optimizer.zero_stage=3",
                                       "parallelism.recompute_layer=true"]),
    # tied on one rank across its two chunks: one gradient from the embedding's B, one from the head's W
    "tied-dp2tp1pp2-zero1": (TIED, ["parallelism=dp2tp1pp2", "optimizer.zero_stage=1"]),
    "moe-dp2tp1pp2-ep2": (["model=moe_tiny"], ["parallelism=dp2tp1pp2", "parallelism.ep=2"]),
}


@pytest.mark.parametrize("name", tiered(CASES, quick=["dp2tp1pp2-zero3-recompute"]))
def test_zbv_trains_the_one_process_model(name, tmp_path, one_process):
    model, layout = CASES[name]
    assert_same_curve(train(tmp_path, FAST + STEPS + model + layout + ZBV), one_process(model))


@SLOW
def test_zbv_in_bf16_keeps_the_bf16_contract(tmp_path, train_once):
    from tests.test_bf16_parity import BF16, GRAD_NORM_RTOL, LOSS_RTOL, grad_norms
    one, split = train_once(BF16)[1], train(tmp_path / "zbv", BF16 + ["parallelism=dp1tp1pp2"] + ZBV)
    assert len(train_losses(split)) == len(train_losses(one)) == 8
    np.testing.assert_allclose(train_losses(split), train_losses(one), rtol=LOSS_RTOL, atol=0)
    np.testing.assert_allclose(grad_norms(split), grad_norms(one), rtol=GRAD_NORM_RTOL, atol=0)


def test_a_zbv_checkpoint_resumes_on_1f1b(tmp_path):
    """The head lives on rank 0 under zbv and on the last rank under 1f1b: checkpoints name parameters, not ranks."""
    run = FAST + STEPS + TIED + ["parallelism=dp1tp1pp2", "checkpoint.checkpoint_interval=5"]
    zero_bubble = train(tmp_path / "zbv", run + ZBV)
    resumed = train(tmp_path / "1f1b", run + [f"checkpoint.resume_checkpoint_path={tmp_path}/zbv/checkpoints/5"])
    assert_same_steps(resumed, zero_bubble, steps=range(6, 11))


@pytest.mark.parametrize("overrides, message", [
    (["parallelism.pp_virtual_stages=3"], "parallelism.pp_virtual_stages=3: zbv runs exactly 2 chunks per rank"),
    (["parallelism.pp_virtual_stages=1"], "zbv runs exactly 2 chunks per rank"),
    (["parallelism=dp1tp1pp4"], "num_hidden_layers=4 is smaller than parallelism.pp * pp_virtual_stages = 8"),
])
def test_what_zbv_cannot_run_is_named(overrides, message):
    assert message in start_error(compose_config(FAST + ["parallelism=dp1tp1pp2"] + ZBV + overrides))
