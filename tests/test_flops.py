"""The analytic FLOP count behind `model_tflops_per_sec`/`mfu` and `hardware_tflops_per_sec`,
checked against torch.utils.flop_counter.FlopCounterMode on a real training step.

Convention: FlopCounterMode counts matmuls only (2·m·n·k each, forward and backward), which is
exactly what PaLM's 6N + 12·L·h·s formula counts (norms, rotary, softmax and the embedding
lookup are left out by both). On CPU it counts nothing for scaled_dot_product_attention, so the
step runs a math attention path (explicit q·kᵀ and p·v over the FULL s×s matrix, GQA heads
repeated), which is the full-attention convention the formula uses (not the causal half).
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import nanoexp.model.llama as llama
from nanoexp.metrics import flops_per_token, hardware_flops_per_token, job_peak, measure_cpu_peak
from nanoexp.parallel.context import ParallelContext
from nanoexp.model.build import build_model, model_shape
from tests.helpers import FAST, compose_config


def math_attention(q, k, v, scale=None):
    """Causal attention as plain matmuls over the full s x s score matrix (scores q·k * scale, None: 1/sqrt(d))."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    s = q.shape[-2]
    scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def counted_flops(overrides, monkeypatch) -> tuple[float, object, int]:
    """FLOPs FlopCounterMode sees in one forward + backward of one micro-batch."""
    monkeypatch.setattr(llama, "causal_attention", math_attention)
    cfg = compose_config(FAST + overrides)
    model = build_model(cfg, ParallelContext())
    b, s = cfg.tokens.micro_batch_size, cfg.tokens.sequence_length
    ids = torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).mean().backward()
    return counter.get_total_flops(), model_shape(cfg), b * s


def test_model_flops_match_flop_counter(monkeypatch):
    counted, shape, tokens = counted_flops([], monkeypatch)
    expected = flops_per_token(shape, 32) * tokens
    # Both count the same matmuls exactly; 1e-9 only absorbs float rounding of the formula.
    assert counted == pytest.approx(expected, rel=1e-9)


def test_recomputation_counts_as_hardware_not_model_flops(monkeypatch):
    counted, shape, tokens = counted_flops(["parallelism.recompute_layer=true"], monkeypatch)
    # The recomputed block forwards run inside backward and are counted by FlopCounterMode.
    assert counted == pytest.approx(hardware_flops_per_token(shape, 32, True) * tokens, rel=1e-9)
    assert counted > flops_per_token(shape, 32) * tokens * 1.2   # and they are not model FLOPs
    assert hardware_flops_per_token(shape, 32, False) == flops_per_token(shape, 32)


def test_peak_table_matches_names_and_dtypes(monkeypatch):
    gpu = torch.device("cuda", 0)   # only the device type is read; no GPU needed
    for name, dtype, peak in [("NVIDIA H200", "bfloat16", 989.0), ("NVIDIA H100 80GB HBM3", "bfloat16", 989.0),
                              ("NVIDIA H100 PCIe", "bfloat16", 756.0), ("NVIDIA A100-SXM4-80GB", "float32", 19.5),
                              ("NVIDIA GeForce RTX 4090", "bfloat16", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        job = job_peak(gpu, dtype, None, world_size=8, nodes=1)
        assert job.tflops == (None if peak is None else 8 * peak), name   # per GPU x GPUs
    assert job_peak(gpu, "bfloat16", 100.0, world_size=4, nodes=1).tflops == 400.0


def test_cpu_peak_is_per_node_and_measured_without_the_training_rng():
    """On CPU the ranks of a node share its cores: the job's peak is the node's times the nodes, not
    times the ranks. The measurement draws no random numbers (the training RNG stays where it was)."""
    cpu = torch.device("cpu")
    assert job_peak(cpu, "float32", None, world_size=8, nodes=1).tflops is None   # nothing measured
    assert job_peak(cpu, "float32", 2.5, world_size=8, nodes=2).tflops == 5.0
    torch.manual_seed(0)
    before = torch.get_rng_state()
    threads = torch.get_num_threads()
    measured = measure_cpu_peak("float32", threads=2)
    assert torch.equal(torch.get_rng_state(), before) and torch.get_num_threads() == threads
    # A 2-core CPU does 57-211 GFLOP/s here; any real machine lands between 1 GFLOP/s and 1 PFLOP/s.
    assert 1e-3 < measured.tflops < 1e3 and "1024x1024 float32" in measured.source
    job = job_peak(cpu, "float32", None, world_size=4, nodes=1, measured=measured)
    assert job.tflops == measured.tflops and "x 1 node" in job.source
