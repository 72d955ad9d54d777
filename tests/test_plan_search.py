"""The planner's search and what it says (issue 63): branch and bound answers as pricing every candidate does, at
4,096 GPUs in seconds; FP8 priced from the numerics registry; a faster GPU never predicted slower; uneven stages,
the host's ops, ties, GiB and the memory margin in what it prints; schedules from the registry."""
from __future__ import annotations

import ast
import os
import statistics

import pytest

from nanoexp.config import ConfigError, compose, normalize
from nanoexp.parallel.pipeline.schedules import SCHEDULES
from nanoexp.model.shape import model_shape
from nanoexp.parallel.layout import Layout
from nanoexp.plan import cost, search
from nanoexp.plan.comm import group_seconds
from nanoexp.plan.cost import MODEL_ERROR, OPS_BACKWARD, OPS_FORWARD, predict
from nanoexp.plan.hardware import GPUS
from nanoexp.plan.memory import limit_gib


def _config(overrides, seq=8192, batch=128):
    cfg = compose([f"tokens.sequence_length={seq}", f"tokens.global_batch_size={batch}", *overrides])
    normalize(cfg)
    cfg.tokens.batch_accumulation_per_replica = None
    return cfg


def every_candidate(cfg, gpus: int, gpus_per_node: int, hw) -> list:
    """Every valid candidate priced in full, in rank's order (tokens/s, then enumeration): the search's reference."""
    priced = []
    for structure, problem in search.checked_structures(cfg, gpus, gpus_per_node):
        for choice in variants_if(problem is None, structure, gpus_per_node):
            search.apply(cfg, choice)
            if choice.dp_shard is None or search.problem_of(cfg, gpus) is None:
                priced.append(predict(cfg, hw, gpus_per_node))
    ranked = sorted(enumerate(priced), key=lambda item: (-item[1].tokens_per_s_per_gpu, item[0]))
    return [p for _, p in ranked if p.fits]


def variants_if(valid: bool, structure, gpus_per_node: int):
    return search.variants(structure, gpus_per_node) if valid else ()


def key(p) -> tuple:
    return p.name, p.zero_stage, p.schedule, p.virtual_stages, p.micro_batch, p.recompute, p.tokens_per_s_per_gpu


@pytest.mark.slow
@pytest.mark.parametrize("model, gpus", [("tiny", 8), ("moe_tiny", 4)])
def test_branch_and_bound_ranks_as_pricing_every_candidate(model, gpus):
    """rank's answer, whole (top=None) and its top 5, is the one of pricing every valid candidate in full and
    sorting them (ties in the order of enumeration); the top 5 prices a fraction of them."""
    cfg = _config([f"model={model}"], seq=256, batch=32)
    reference = every_candidate(cfg, gpus, gpus, GPUS["h100"])
    everything = search.rank(cfg, gpus, gpus, "h100", top=None)
    assert [key(p) for p in everything.predictions] == [key(p) for p in reference]
    top = search.rank(cfg, gpus, gpus, "h100", top=5)
    assert [key(p) for p in top.predictions] == [key(p) for p in reference[:5]]
    assert top.priced < everything.priced / 4


@pytest.mark.slow
def test_4096_gpus_are_planned_by_pricing_a_few_candidates():
    """Llama 3 8B on 4,096 H100s (16M tokens a step): of ~24,000 candidates a handful are priced in full, the rest
    bounded away; the answer is data parallelism over tp4 (the count, not a time: the CPU's speed varies)."""
    cfg = _config(["model=llama3_8b"], batch=2048)
    ranking = search.rank(cfg, 4096, 8, "h100", top=5)
    best = ranking.predictions[0]
    assert (best.name, best.zero_stage) == ("dp1024tp4pp1", 3) and len(ranking.predictions) == 5
    bounded = next(count for reason, count in ranking.reasons.items() if reason.startswith("could not beat"))
    assert ranking.priced <= 20 and bounded > 20000
    assert sum(ranking.reasons.values()) + len(ranking.predictions) > 30000   # every candidate is accounted for


def _runs_fp8(overrides, gpu="h100"):
    return predict(_config(["model=llama3_8b", "parallelism.dp=8", *overrides]), GPUS[gpu], 8, with_memory=False)


def test_fp8_is_priced_from_the_format_registry():
    """model.fp8.enabled: the linears at the FP8 peak (the registry's planned_product_dtype), their casts moved;
    MFU against the FP8 peak, as the run reports it; gather_in_fp8 shrinks ZeRO-3's gathers (gathered_bytes);
    on an A100 (no FP8 units) the products would be emulated, which the planner refuses to price, naming the key."""
    bf16, fp8 = _runs_fp8([]), _runs_fp8(["model.fp8.enabled=true"])
    assert fp8.tokens_per_s_per_gpu > 1.2 * bf16.tokens_per_s_per_gpu
    assert fp8.mfu < bf16.mfu   # the same work against twice the peak
    zero3 = ["model.fp8.enabled=true", "optimizer.zero_stage=3"]
    cfg = _config(["model=llama3_8b", "parallelism.dp=8", *zero3])
    plain, narrow = (group_seconds(c, Layout.from_config(c), model_shape(c), 0, 16, 32, GPUS["h100"], cost.NANOEXP,
                                   8)[0]["dp"]
                     for c in (cfg, _config(["model=llama3_8b", "parallelism.dp=8", *zero3, "model.fp8.gather_in_fp8=true"])))
    assert narrow < 0.75 * plain
    with pytest.raises(ConfigError, match="model.fp8"):
        _runs_fp8(["model.fp8.enabled=true"], gpu="a100")


def _faster_never_slower(cfg, gpus: int, pairs) -> list:
    slower = []
    for structure, problem in search.checked_structures(cfg, gpus, 8):
        for choice in variants_if(problem is None, structure, 8):
            search.apply(cfg, choice)
            for slow, fast in pairs:
                a, b = (predict(cfg, GPUS[g], 8, with_memory=False).tokens_per_s_per_gpu for g in (slow, fast))
                if b < a:
                    slower.append((choice, slow, fast))
    return slower


def test_a_faster_gpu_is_never_predicted_slower_under_zero3_and_ring_attention():
    """The layouts issue 63 found (ZeRO-3 with cp 8 or 16 over two nodes): attention is one window, the ring's
    or ZeRO's, so B200 (every figure at least H100's) is never predicted slower than H100."""
    cfg = _config(["model=llama3_8b", "optimizer.zero_stage=3"])
    for cp, tp in ((8, 2), (16, 1), (8, 1)):
        cfg.parallelism.dp, cfg.parallelism.cp, cfg.parallelism.tp = 16 // (cp * tp), cp, tp
        for mb in (1, 2, 4):
            cfg.tokens.micro_batch_size = mb
            h100, b200 = (predict(cfg, GPUS[g], 8, with_memory=False).tokens_per_s_per_gpu for g in ("h100", "b200"))
            assert b200 >= h100, (cp, tp, mb)


@pytest.mark.slow
def test_a_faster_gpu_is_never_predicted_slower_on_any_layout():
    """Every valid candidate of Llama 3 8B on 16 GPUs (2,940): B200 >= H100 >= A100 on the same layout."""
    assert _faster_never_slower(_config(["model=llama3_8b"]), 16, [("h100", "b200"), ("a100", "h100")]) == []


def test_the_last_stage_carries_the_head_and_prices_the_schedule():
    """A 131k vocabulary on pp4: the last stage (the LM head) is the slowest; every stage is priced at it
    (compute = m x its F + B) and the breakdown says what the unevenness costs."""
    cfg = _config(["model=llama3_8b", "model.model_config.vocab_size=131072", "parallelism.dp=2",
                   "parallelism.pp=4"])
    p = predict(cfg, GPUS["h100"], 8, with_memory=False)
    times = cost.stage_times(cfg, Layout.from_config(cfg), model_shape(cfg), GPUS["h100"], cost.NANOEXP)
    assert times.busiest == 3 and times.forward + times.backward > 1.05 * times.mean
    assert p.uneven_s == pytest.approx(p.breakdown["compute"] * (1 - times.mean / (times.forward + times.backward)))


def test_a_micro_batch_of_small_kernels_waits_for_the_host():
    """tiny on an H100: its kernels take less than the host issuing them, so a micro-batch takes the host's time
    (OPS a layer x Hardware.launch_us) and the step's fixed ops are counted once."""
    cfg = _config(["model=tiny", "parallelism.dp=8"], seq=128, batch=32)
    h100 = GPUS["h100"]
    times = cost.stage_times(cfg, Layout.from_config(cfg), model_shape(cfg), h100, cost.NANOEXP)
    layers = cfg.model.model_config.num_hidden_layers
    assert times.forward == pytest.approx(layers * OPS_FORWARD * h100.launch_us * 1e-6)
    assert times.backward == pytest.approx(layers * OPS_BACKWARD * h100.launch_us * 1e-6)
    p = predict(cfg, h100, 8, with_memory=False)
    fixed = cost.FIXED_STEP_OPS * h100.launch_us * 1e-6
    m = cfg.tokens.global_batch_size // (8 * cfg.tokens.micro_batch_size)   # micro-batches a step (dp8)
    assert p.breakdown["host"] == pytest.approx(fixed + m * times.waiting)
    assert p.breakdown["host"] > 0.9 * p.step_time_s and sum(p.breakdown.values()) == pytest.approx(p.step_time_s)


def test_the_margin_and_ties_are_the_model_s():
    cfg = _config(["model=llama3_8b", "parallelism.dp=8", "optimizer.zero_stage=3"])
    p = predict(cfg, GPUS["h100"], 8)
    assert p.margin_gib == pytest.approx(limit_gib(80.0) - p.memory_gib) and (p.margin_gib >= 0) == p.fits
    slower = predict(_config(["model=llama3_8b", "parallelism.dp=8", "optimizer.zero_stage=3",
                              "parallelism.recompute_layer=true"]), GPUS["h100"], 8)
    assert p.tied_with(p) and slower.tied_with(p) == (
        p.tokens_per_s_per_gpu - slower.tokens_per_s_per_gpu <= MODEL_ERROR * p.tokens_per_s_per_gpu)


@pytest.mark.slow
def test_the_model_error_is_the_published_rows_median():
    """cost.MODEL_ERROR, the width of a tie in scripts/plan.py's table, is the median |error| of the published
    rows (rounded to a percent): a change to the model that moves it must move the constant."""
    from nanoexp.plan.published import ROWS, check
    errors = [abs(check(row)["error"]) for row in ROWS]
    assert round(statistics.median(errors), 2) == MODEL_ERROR


def test_masking_keeps_names_whole():
    problem = "parallelism.pp=4: interleaved_1f1b sends micro-batches in groups of pp (got 6, 2·cp)"
    assert search.masked(problem) == "parallelism.pp=#: interleaved_1f1b sends micro-batches in groups of pp (got #, #·cp)"


def test_the_schedules_come_from_the_registry():
    """search tries each registry entry with its plan_chunks (afab, 1f1b's bubble at more memory, none), and no
    file of nanoexp/plan/ but published.py (data) names a schedule: a new schedule is planned from its entry."""
    assert search.planned_schedules(2) == [(name, v) for name, s in SCHEDULES.items() for v in s.plan_chunks]
    assert "afab" not in dict(search.planned_schedules(2)) and search.planned_schedules(1) == [("1f1b", 1)]
    folder = os.path.dirname(search.__file__)
    for name in os.listdir(folder):
        if name.endswith(".py") and name != "published.py":
            with open(os.path.join(folder, name)) as f:
                strings = {n.value for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.Constant)}
            assert not strings & set(SCHEDULES), (name, strings & set(SCHEDULES))
