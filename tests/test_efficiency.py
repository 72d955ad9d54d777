"""The efficiency options change speed and memory, never the numbers: compile, activation
recomputation, fused AdamW, the attention fallback, and the torch.profiler trace."""
from __future__ import annotations

import glob
import json
import math
import os

import pytest
import torch
import torch._inductor.config

from nanoexp.observe.metrics import flops_per_token, hardware_flops_per_token
from nanoexp.model.attention import SDPA, Causal
from nanoexp.parallel.context import ParallelContext
from nanoexp.instruments.memory import saved_activation_bytes
from nanoexp.runtime.build import build_model
from nanoexp.model.shape import model_shape
from tests.helpers import FAST, SLOW, compose_config, train, train_losses

STEPS = ["tokens.train_steps=3", "tokens.val_check_interval=0"]


@pytest.fixture(scope="module")
def default_losses(tmp_path_factory):
    return train_losses(train(tmp_path_factory.mktemp("default"), FAST + STEPS))


def test_recompute_same_losses_and_hardware_flops(tmp_path, default_losses):
    records = [r for r in train(tmp_path, FAST + STEPS + ["parallelism.recompute_layer=true"]) if "loss" in r]
    # Recomputation reruns the same float32 ops in the same order: identical gradients.
    assert [r["loss"] for r in records] == default_losses
    shape = model_shape(compose_config(FAST))
    expected = hardware_flops_per_token(shape, 32, True) / flops_per_token(shape, 32)
    for r in records:   # MFU counts model FLOPs; the recomputed forward shows up only here
        assert r["hardware_tflops_per_sec"] / r["model_tflops_per_sec"] == pytest.approx(expected, rel=1e-9)


def test_recompute_saves_activation_memory():
    def saved_bytes(recompute: bool) -> int:
        cfg = compose_config(FAST + [f"parallelism.recompute_layer={str(recompute).lower()}"])
        model = build_model(cfg, ParallelContext())
        ids = torch.randint(0, 256, (cfg.tokens.micro_batch_size, cfg.tokens.sequence_length))
        with saved_activation_bytes(model.parameters()) as saved:
            loss = model(input_ids=ids, labels=ids).mean()
        loss.backward()
        return saved.bytes

    full, recomputed = saved_bytes(False), saved_bytes(True)
    # Per block only its input (b*s*h floats) stays, instead of ~20 tensors of that size or more.
    assert recomputed < 0.25 * full, (full, recomputed)


def test_fused_adamw_same_losses(tmp_path, default_losses):
    losses = train_losses(train(tmp_path, FAST + STEPS + ["optimizer.optimizer_factory.torch_adam_is_fused=true"]))
    # Fused and foreach AdamW round differently (fused computes in one kernel): a few float32 ulps.
    assert losses == pytest.approx(default_losses, rel=1e-5)


@SLOW
def test_compile_same_losses(tmp_path, default_losses, monkeypatch):
    # One in-process compile thread: a pool of compile workers costs more than it saves on 2 cores.
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)
    losses = train_losses(train(tmp_path, FAST + STEPS + ["model.compile=true"]))
    # Inductor fuses and reorders the elementwise float32 work of each block: rounding-level drift.
    assert losses == pytest.approx(default_losses, rel=1e-4)


def test_attention_fallback_without_flash_attn():
    """On CPU (or float32) the default kernel is SDPA; check it against explicit masked softmax."""
    q, k, v = (torch.randn(2, 4, 16, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    k, v = k[:, :2], v[:, :2]   # grouped-query: 2 KV heads for 4 query heads
    out = SDPA()(q, k, v, None, Causal())
    kf, vf = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ kf.transpose(-1, -2) / math.sqrt(8)).masked_fill(torch.ones(16, 16).triu(1).bool(), -math.inf)
    torch.testing.assert_close(out, scores.softmax(-1) @ vf, rtol=1e-5, atol=1e-6)   # float32 rounding


def test_profiler_writes_a_trace(tmp_path):
    train(tmp_path, FAST + ["tokens.train_steps=3", "tokens.val_check_interval=0", "logging.profiler.enabled=true",
                            "logging.profiler.wait=0", "logging.profiler.warmup=1", "logging.profiler.active=1"])
    traces = glob.glob(os.path.join(tmp_path, "profiler", "rank0*.pt.trace.json"))
    assert len(traces) == 1, os.listdir(tmp_path)
    with open(traces[0]) as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)   # the step's matmuls were recorded


def test_bad_profiler_schedule_names_the_key():
    from nanoexp.config import ConfigError
    from nanoexp.validation import validate
    with pytest.raises(ConfigError, match="logging.profiler"):
        validate(compose_config(FAST + ["logging.profiler.active=0"]))
