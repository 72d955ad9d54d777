"""The cost model's CPU-only terms (nanoexp/plan/hardware.py cpu_share, cost.py cpu_overhead): exact arithmetic on
a fixed Hardware, no measurement (benchmarks/bench_plan_cpu.py measures and fits them; timing is not tested)."""
from __future__ import annotations

import dataclasses

import pytest

from nanoexp.config import compose, normalize
from nanoexp.plan.cost import cpu_overhead, predict
from nanoexp.parallel.layout import Layout
from nanoexp.plan.hardware import GPUS, Hardware, cpu_share, per_rank

CPU = Hardware("a CPU", 0.5, 0.5, 16.0, 10.0, 1.5, 1.5, 50.0, 50.0, cuda_context_gb=0.0, cpu=True, launch_us=0.0)


def _config(overrides):
    cfg = compose(["model=small", *overrides])
    normalize(cfg)
    return cfg


def test_processes_share_the_cores():
    """Two ranks on two cores get half the node's compute each (a thread each, where one rank has both), four a
    quarter, one all; overheads stretch past one rank a core."""
    assert cpu_share(CPU, 1, 2).bf16_tflops == CPU.bf16_tflops
    assert cpu_share(CPU, 2, 2).bf16_tflops == pytest.approx(CPU.bf16_tflops / 2)
    four = cpu_share(CPU, 4, 2)
    assert (four.bf16_tflops, four.fp8_tflops, four.memory_gbps) == pytest.approx((0.125, 0.125, 2.5))
    assert four.intra_gbps == CPU.intra_gbps   # the links are measured between processes already
    slow = dataclasses.replace(CPU, step_overhead_s=0.1, micro_batch_overhead_s=0.01, message_us=200.0)
    two = cpu_share(slow, 2, 2)   # one core each: Python's overheads as on one process
    assert (two.step_overhead_s, two.micro_batch_overhead_s, two.memory_gb) == (0.1, 0.01, 8.0)
    stretched = cpu_share(slow, 4, 2)
    stretched_terms = (stretched.step_overhead_s, stretched.micro_batch_overhead_s, stretched.message_us)
    assert stretched_terms == pytest.approx((0.2, 0.02, 200.0))


def test_cpu_overhead_is_its_three_terms():
    hw = dataclasses.replace(CPU, step_overhead_s=0.1, micro_batch_overhead_s=0.01, message_us=200.0)
    assert cpu_overhead(hw, 8, 6, 1000) == pytest.approx(0.1 + 8 * 6 * 0.01 + 1000 * 200e-6)
    assert cpu_overhead(CPU, 8, 6, 1000) == 0.0


def test_the_overheads_add_to_the_step_and_gpus_have_none():
    """A cp2 step grows by exactly the overhead (per step + m x layers + the ring's messages: m x layers x 2
    calls x (cp - 1)); a GPU's breakdown has no CPU term, so GPU predictions are what they were."""
    cfg = _config(["parallelism.cp=2"])   # global 32 / micro-batch 4: m = 8, 6 layers on the one stage
    hw = dataclasses.replace(CPU, step_overhead_s=0.1, micro_batch_overhead_s=0.01, message_us=200.0)
    plain, loaded = predict(cfg, CPU, 2, with_memory=False), predict(cfg, hw, 2, with_memory=False)
    assert loaded.step_time_s - plain.step_time_s == pytest.approx(0.1 + 8 * 6 * 0.01 + 8 * 6 * 2 * 200e-6)
    assert loaded.breakdown["cpu_overhead"] == pytest.approx(loaded.step_time_s - plain.step_time_s)
    assert "cpu_overhead" not in predict(cfg, GPUS["h100"], 8, with_memory=False).breakdown


def test_tensor_parallel_collectives_are_messages():
    """tp2: m x (4 collectives a layer + 2) blocking messages (cost.predict's tp call count)."""
    cfg = _config(["parallelism.tp=2"])
    hw = dataclasses.replace(CPU, message_us=1000.0)
    extra = predict(cfg, hw, 2, with_memory=False).step_time_s - predict(cfg, CPU, 2, with_memory=False).step_time_s
    assert extra == pytest.approx(8 * (4 * 6 + 2) * 1e-3)


def test_a_cpu_node_is_shared_by_the_layouts_ranks():
    """A device with cores (calibrate_cpu's) is one node the layout's ranks share: predict gives a dp2tp2 rank a
    quarter of a 2-core node's compute, as cpu_share(hw, 4, 2) would, and a quarter of its memory to fit in; a
    rank's share is not shared again, and a GPU (cores 0) is its rank's own."""
    node = dataclasses.replace(CPU, cores=2, step_overhead_s=0.1, micro_batch_overhead_s=0.01)
    cfg = _config(["parallelism.dp=2", "parallelism.tp=2"])
    shared = predict(cfg, node, 4, with_memory=False)
    by_hand = predict(cfg, cpu_share(node, 4, 2), 4, with_memory=False)
    assert shared.step_time_s == by_hand.step_time_s
    assert shared.step_time_s > predict(cfg, dataclasses.replace(CPU, step_overhead_s=0.1,
                                                                   micro_batch_overhead_s=0.01), 4,
                                        with_memory=False).step_time_s
    assert per_rank(per_rank(node, 4), 4) == per_rank(node, 4)
    assert per_rank(node, 4).memory_gb == CPU.memory_gb / 4
    assert per_rank(GPUS["h100"], 64) == GPUS["h100"]


def test_a_rank_gets_the_rates_measured_at_its_thread_count():
    """With rates measured at 1 and 4 threads (calibrate_cpu's), one of 2 ranks on 4 cores runs 2 threads: the rates
    half-way between; one of 8 ranks one thread time-sliced to half a core; eager elementwise and attention
    rates, which scale worse than matmuls, carry over as they were measured."""
    node = dataclasses.replace(CPU, cores=4, rates=((1, 0.1, 20.0, 0.04), (4, 0.4, 50.0, 0.1)))
    two = cpu_share(node, 2, 4)
    assert (two.bf16_tflops, two.memory_gbps, two.attention_efficiency) == pytest.approx((0.2, 30.0, 0.06 / 0.2))
    eight = cpu_share(node, 8, 4)
    assert (eight.bf16_tflops, eight.memory_gbps) == pytest.approx((0.05, 10.0))
    assert cpu_share(node, 1, 4).bf16_tflops == pytest.approx(0.4)


def test_slower_collectives_stretch_only_their_bytes():
    """A reduce-scatter at half the all-reduce's rate doubles the time of exactly ZeRO's reduce-scatter bytes: on
    dp2 ZeRO-2 (m = 8: 8 reduce-scatters and one all-gather of the 9 passes) the dp group's byte time grows by
    8/9 of itself; ZeRO-0 (all-reduces) and a GPU (no speeds: NCCL's) do not move."""
    from nanoexp.plan.traffic import collective_shares, zero_collectives
    zero2 = _config(["parallelism.dp=2", "optimizer.zero_stage=2"])
    assert zero_collectives(zero2, 8) == {"reduce_scatter": 8, "all_gather": 1}
    slow = dataclasses.replace(CPU, collective_speed=(("reduce_scatter", 0.5), ("all_gather", 1.0)))
    assert slow.slowdown(collective_shares(zero2, Layout.from_config(zero2), 8)["dp"]) == pytest.approx(17 / 9)
    grown = predict(zero2, slow, 2, with_memory=False).breakdown["exposed_comm"]
    base = predict(zero2, CPU, 2, with_memory=False).breakdown["exposed_comm"]
    assert grown > base
    zero0 = _config(["parallelism.dp=2"])
    assert predict(zero0, slow, 2, with_memory=False).step_time_s == predict(zero0, CPU, 2, with_memory=False).step_time_s
    assert GPUS["h100"].slowdown({"reduce_scatter": 1.0}) == 1.0


def test_idle_ranks_lend_their_cores():
    """Four ranks on two cores (dp2pp2): the pipeline's bubble costs no time, since a rank waiting in it leaves its
    core to another; two ranks on two cores (pp2) keep it."""
    node = dataclasses.replace(CPU, cores=2)
    for overrides, world in ((["parallelism.dp=2", "parallelism.pp=2"], 4), (["parallelism.pp=2"], 2)):
        p = predict(_config(overrides), node, world, with_memory=False)
        total = sum(p.breakdown.values())
        assert p.breakdown["bubble"] > 0
        expected = max(total - p.breakdown["bubble"], total * 2 / world) if world > 2 else total
        assert p.step_time_s == pytest.approx(expected)
