"""DualPipeV (schedules.py's dualpipe_v): its order against torch.distributed.pipelining's ScheduleDualPipeV table,
its rules, its messages under NCCL's rules, its bubble and memory simulated beside zbv's and 1f1b's, and training on
every layout it composes with as one process does (test_parallel.py's tolerances: the schedule, the V placement
and the B/W split only reorder float32 sums)."""
import numpy as np
import pytest

from nanoexp.parallel.pipeline.schedules import compute_order, schedule
from nanoexp.parallel.pipeline.stages import StageMap
from nanoexp.verify.p2p_plan import check, named_plan
from nanoexp.verify.pipeline_bubble import idle_by_dependencies, idle_under_nccl
from tests.helpers import FAST, SLOW, compose_config, start_error, tiered, train, train_losses
from tests.test_parallel import STEPS, TIED, assert_same_curve
from tests.test_zero_bubble import TIMES, one_process  # noqa: F401 (a fixture)
from tests.test_zero_bubble_v import EIGHT_LAYERS

DUALPIPEV = ["parallelism.pp_engine=dualpipev", "parallelism.pp_virtual_stages=2"]
# one sample a micro-batch: dp2 then still runs 4 micro-batches a step, the one per virtual stage that pp2 needs.
# Against the one-process run's two samples a micro-batch this only reorders float32 sums: each micro-batch's loss
# is its token sum over the step's token count (runtime/step.py), so test_parallel.py's tolerances hold.
MICRO_1 = ["tokens.micro_batch_size=1"]


# -- the order ---------------------------------------------------------------------------------------------------
def torch_dualpipev_order(pp: int, m: int, rank: int) -> tuple[list[tuple[str, int, int]], int]:
    """torch.distributed.pipelining's ScheduleDualPipeV: its pipeline_order row for `rank` as (F | B | W, virtual
    stage, micro-batch), computed from the shape alone, and how many overlapped pairs it holds. torch writes an
    overlapped forward and backward as one OVERLAP_F_B action whose sub_actions are the F and a FULL_BACKWARD: they
    are expanded in that order. Every backward of nanoexp's dualpipev is split, so a FULL_BACKWARD (input and weight
    gradients at once) is its B then, at once, its W; BACKWARD_INPUT is a B, BACKWARD_WEIGHT a W."""
    from torch.distributed.pipelining import schedules as torch_schedules
    table = object.__new__(torch_schedules.ScheduleDualPipeV)
    table.pp_group_size, table._n_microbatches = pp, m
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "BW", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    order, overlaps = [], 0
    for action in table._calculate_single_rank_operations(rank):
        overlaps += action.computation_type.name == "OVERLAP_F_B"
        for sub in action.sub_actions or (action,):
            order += [(kind, sub.stage_index, sub.microbatch_index) for kind in kinds[sub.computation_type.name]]
    return order, overlaps


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_dualpipev_runs_torchs_order(pp):
    """Every rank's compute order, as virtual stages, equals torch's table with its overlapped pairs expanded, for
    every m torch accepts from 2·pp to 2·pp + 12."""
    stages, overlaps = StageMap(pp, 2, "v"), 0
    for m in range(2 * pp, 2 * pp + 13):
        for rank in range(pp):
            ours = [(kind, stages.stage(chunk, rank), mb) for kind, chunk, mb in compute_order("dualpipev", pp, 2, m,
                                                                                                rank)]
            theirs, overlapped = torch_dualpipev_order(pp, m, rank)
            assert ours == theirs, (pp, m, rank)
            overlaps += overlapped
    assert overlaps > 0   # the comparison went through torch's overlapped actions


def test_dualpipev_pairs_a_forward_with_the_other_chunks_backward():
    """Rank 0 of two: 2·(p − 1) + 1 forwards of chunk 0, then the steady rounds (F 0, B 1, W 1, F 1, B 0, W 0), each
    forward followed by the other chunk's backward, a pair DualPipe overlaps (here: one after the other); the last
    rank owes its last Ws to the end of the cool-down."""
    first, last = (" ".join(f"{kind}{chunk}.{mb}" for kind, chunk, mb in compute_order("dualpipev", 2, 2, 8, rank))
                   for rank in (0, 1))
    assert first.startswith("F0.0 F0.1 F0.2 F1.0 B1.0 W1.0 F1.1 F0.3 B1.1 W1.1 F1.2 B0.0 W0.0 F0.4 ")
    assert last.endswith(" B1.7 B0.7 W1.7 W0.7")


@pytest.mark.parametrize("overrides, message", [
    (["parallelism=dp2tp1pp2"], ("micro-batches per step (tokens.batch_accumulation_per_replica = 2) are fewer "
                                 "than parallelism.pp * pp_virtual_stages = 4: dualpipev needs one per virtual stage")),
    (["parallelism=dp1tp1pp2", "parallelism.pp_virtual_stages=3"],
     "parallelism.pp_virtual_stages=3: dualpipev runs exactly 2 chunks per rank"),
    (["parallelism=dp1tp1pp1"], "parallelism.pp_engine=dualpipev needs parallelism.pp >= 2"),
])
def test_what_dualpipev_cannot_run_is_named(overrides, message):
    assert message in start_error(compose_config(FAST + DUALPIPEV + overrides))


def test_the_schedule_refuses_fewer_micro_batches_than_stages_but_evaluates_any():
    with pytest.raises(ValueError, match="fewer than parallelism.pp"):
        schedule("dualpipev", 4, 2, 7, 0)
    assert [step[:2] for step in compute_order("dualpipev", 4, 2, 1, 0, forward_only=True)] == [("F", 0), ("F", 1)]


# -- messages and bubble -----------------------------------------------------------------------------------------
def test_dualpipev_plans_pass_nccl_rules():
    """pp 2..8, every m from 2·pp to 20 in training and 1..16 in evaluation, every message named: on each channel
    (activations one way, gradients the other) the receiver asks in the order the sender sends."""
    training = sum(check(named_plan("dualpipev", pp, 2, m)) for pp in range(2, 9) for m in range(2 * pp, 21))
    evaluation = sum(check(named_plan("dualpipev", pp, 2, m, forward_only=True)) for pp in range(2, 9)
                     for m in range(1, 17))
    assert training > 5_000 and evaluation > 5_000


def test_dualpipev_order_has_zbvs_bubble_and_beats_it_when_forwards_are_slower():
    """By data dependencies alone: on two ranks dualpipev idles as zbv, (p-1)(T_F + T_B - T_W)/2 when T_F <= T_B;
    with T_W = T_B it idles (p-1)(T_F + T_B - T_W)/2 on every pp even when T_F > T_B, where zbv idles more
    (4 T against 3 T on four ranks with T_F = 2 T_B); with T_W < T_B it idles a little more than zbv (3.25 against
    3 on four ranks with (T_F, T_B, T_W) = (1, 1.5, 0.5)). Always well under 1f1b's."""
    for t_f, t_b, t_w in TIMES:
        for pp, m in [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16)]:
            dualpipev = idle_by_dependencies("dualpipev", pp, 2, m, t_f, t_b, t_w)
            zbv = idle_by_dependencies("zbv", pp, 2, m, t_f, t_b, t_w)
            assert dualpipev < idle_by_dependencies("1f1b", pp, 1, m, t_f, t_b, t_w) / 2
            if pp == 2:
                assert dualpipev == pytest.approx(zbv, abs=1e-12)
            if t_w == t_b:
                assert dualpipev == pytest.approx((pp - 1) * (t_f + t_b - t_w) / 2, abs=1e-12), (t_f, pp, m)
    assert idle_by_dependencies("dualpipev", 4, 2, 8, 2.0, 1.0, 1.0) == pytest.approx(3.0)
    assert idle_by_dependencies("zbv", 4, 2, 8, 2.0, 1.0, 1.0) == pytest.approx(4.0)
    assert idle_by_dependencies("dualpipev", 4, 2, 8, 1.0, 1.5, 0.5) == pytest.approx(3.25)


def test_dualpipev_under_nccl_rules():
    """As the engine posts and waits under NCCL's rules (pipeline_bubble.idle_under_nccl): its dependency bound on
    two ranks; on four and eight its receives hold the in-order stream less than zbv's do: with equal times it
    idles 2 T (p = 4) and 8 T (p = 8), against zbv's 3.5 T and 9.5 T, zb_h1's 3 T and 7 T and 1f1b's 9 T and 21 T."""
    measured = {}
    for t_f, t_b, t_w in TIMES:
        for pp, m in [(2, 8), (4, 8), (8, 16)]:
            dualpipev = idle_under_nccl("dualpipev", pp, 2, m, t_f, t_b, t_w)
            assert dualpipev < idle_under_nccl("1f1b", pp, 1, m, t_f, t_b, t_w)
            measured[t_f, t_b, t_w, pp] = dualpipev
            if pp == 2:
                assert dualpipev == pytest.approx(idle_by_dependencies("dualpipev", pp, 2, m, t_f, t_b, t_w))
    assert measured[1.0, 1.0, 1.0, 4] == pytest.approx(2.0) and measured[1.0, 1.0, 1.0, 8] == pytest.approx(8.0)


def test_the_planner_times_dualpipev_with_its_w_steps():
    """The performance model asks the schedule whether it splits B and W: on two ranks dualpipev's bubble is zbv's
    (0.5 F with B = 2 F, cut in B = W = F), not that of a whole backward in B and an empty W (1.5 F)."""
    from nanoexp.plan.cost import bubble_share
    assert bubble_share("dualpipev", 2, 2, 8, 2.0) == pytest.approx(bubble_share("zbv", 2, 2, 8, 2.0)) == 0.5


def held_at_peak(engine: str, pp: int, v: int, m: int, pp_rank: int) -> float:
    """The most micro-batches' saved tensors a rank holds at once, in whole stages (a chunk is 1/v of one): from F
    to W, or to B without W steps (the engine's max_in_flight, engine.py)."""
    order = compute_order(engine, pp, v, m, pp_rank)
    freed_by = "W" if any(kind == "W" for kind, _, _ in order) else "B"
    held = peak = 0
    for kind, _, _ in order:
        held += 1 if kind == "F" else -(kind == freed_by)
        peak = max(peak, held)
    return peak / v


def test_dualpipev_holds_half_a_micro_batch_more_than_zbv():
    """Every rank holds p + 1/2 micro-batches of a stage at its peak (2·p + 1 chunks: a steady round's forward runs
    before the backward that frees one), zbv's p and 1f1b's first rank's p, for any m."""
    for pp, m in [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16)]:
        assert [held_at_peak("dualpipev", pp, 2, m, r) for r in range(pp)] == [pp + 0.5] * pp
        assert [held_at_peak("zbv", pp, 2, m, r) for r in range(pp)] == [pp] * pp
        assert held_at_peak("1f1b", pp, 1, m, 0) == pp


# -- training ----------------------------------------------------------------------------------------------------
CASES = {   # name: (model overrides, shared with the one-process run; layout overrides)
    "dp1tp1pp2": ([], ["parallelism=dp1tp1pp2"]),
    "dp1tp2pp2-sequence_parallel": ([], ["parallelism=dp1tp2pp2", "parallelism.tp_mode=reduce_scatter"]),
    "dp1cp2tp1pp2-recompute": ([], ["parallelism=dp1cp2tp1pp2", "parallelism.recompute_layer=true"]),
    "dp2tp1pp2-zero1": ([], ["parallelism=dp2tp1pp2", "optimizer.zero_stage=1"] + MICRO_1),
    "dp2tp1pp2-zero3-recompute": ([], ["parallelism=dp2tp1pp2", "optimizer.zero_stage=3",
                                       "parallelism.recompute_layer=true"] + MICRO_1),
    # tied on rank 0 across its two chunks, as under zbv
    "tied-dp2tp1pp2-zero1": (TIED, ["parallelism=dp2tp1pp2", "optimizer.zero_stage=1"] + MICRO_1),
    # the balancing losses are taken per micro-batch: the one-process run cuts its micro-batches the same way
    "moe-dp2tp1pp2-ep2": (["model=moe_tiny"] + MICRO_1, ["parallelism=dp2tp1pp2", "parallelism.ep=2"]),
}


@pytest.mark.parametrize("name", tiered(CASES, quick=["dp1tp1pp2"]))
def test_dualpipev_trains_the_one_process_model(name, tmp_path, one_process):  # noqa: F811 (the fixture)
    model, layout = CASES[name]
    assert_same_curve(train(tmp_path, FAST + STEPS + model + layout + DUALPIPEV), one_process(model))


@SLOW
def test_dualpipev_in_bf16_keeps_the_bf16_contract(tmp_path, train_once):
    from tests.test_bf16_parity import BF16, GRAD_NORM_RTOL, LOSS_RTOL, grad_norms
    one, split = train_once(BF16)[1], train(tmp_path / "dualpipev", BF16 + ["parallelism=dp1tp1pp2"] + DUALPIPEV)
    assert len(train_losses(split)) == len(train_losses(one)) == 8
    np.testing.assert_allclose(train_losses(split), train_losses(one), rtol=LOSS_RTOL, atol=0)
    np.testing.assert_allclose(grad_norms(split), grad_norms(one), rtol=GRAD_NORM_RTOL, atol=0)
