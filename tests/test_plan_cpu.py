"""The cost model's CPU-only terms (nanoexp/plan/hardware.py cpu_share, cost.py cpu_overhead): exact arithmetic on
a fixed Hardware, no measurement (benchmarks/bench_plan_cpu.py measures and fits them; timing is not tested)."""
from __future__ import annotations

import dataclasses

import pytest

from nanoexp.config import compose, normalize
from nanoexp.plan.cost import cpu_overhead, predict
from nanoexp.plan.hardware import GPUS, Hardware, cpu_share

CPU = Hardware("a CPU", 0.5, 0.5, 16.0, 10.0, 1.5, 1.5, 50.0, 50.0, cuda_context_gb=0.0)


def _config(overrides):
    cfg = compose(["model=small", *overrides])
    normalize(cfg)
    return cfg


def test_processes_share_the_cores():
    """Two ranks on two cores get half the node's compute each, four a quarter, one all; overheads stretch past
    one rank a core."""
    assert cpu_share(CPU, 1, 2).bf16_tflops == CPU.bf16_tflops
    assert cpu_share(CPU, 2, 2).bf16_tflops == pytest.approx(CPU.bf16_tflops)
    four = cpu_share(CPU, 4, 2)
    assert (four.bf16_tflops, four.fp8_tflops, four.memory_gbps) == pytest.approx((0.25, 0.25, 5.0))
    assert four.intra_gbps == CPU.intra_gbps   # the links are measured between processes already
    slow = dataclasses.replace(CPU, step_overhead_s=0.1, micro_batch_overhead_s=0.01, message_us=200.0)
    assert cpu_share(slow, 2, 2) == slow   # one core each: Python's overheads as on one process
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
