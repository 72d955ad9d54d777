"""benchmarks/bench.py's mixture-of-experts path on a small moe_tiny, two steps (no timing assertions): a Mixtral-shaped
one is compared with transformers' Mixtral from the same weights, a Qwen3-MoE-shaped one with Qwen3-MoE, any other
shape is timed alone, and the closing line compares a MoE with the dense model of the nearest active size."""
from types import SimpleNamespace

import pytest

from benchmarks.bench import bench_one, moe_comparisons, table_row
from tests.helpers import require

pytestmark = pytest.mark.slow   # its shared fixture trains the MoE shapes and their HF references: 100 s under load

SHAPE = ["model.model_config.hidden_size=64", "model.model_config.intermediate_size=128",
         "model.model_config.num_attention_heads=4", "model.model_config.num_key_value_heads=2",
         "tokens.sequence_length=32", "tokens.global_batch_size=8", "tokens.micro_batch_size=2"]
MIXTRAL = ["model.moe.num_shared_experts=0", "model.moe.layer_frequency=1", "model.moe.router=softmax_topk_normalized"]
ARGS = SimpleNamespace(warmup=1, steps=1)


@pytest.fixture(scope="module")
def results():
    require("transformers")
    return {"mixtral": bench_one("moe_tiny", "default", ARGS, SHAPE + MIXTRAL, peak_tflops=0.1),
            "moe_tiny": bench_one("moe_tiny", "default", ARGS, SHAPE, peak_tflops=0.1),
            "qwen3": bench_one("qwen3_moe_tiny", "default", ARGS, SHAPE, peak_tflops=0.1),
            "dense": bench_one("tiny", "default", ARGS, SHAPE, peak_tflops=0.1)}


def test_mixtral_shaped_moe_has_hf_reference_from_the_same_weights(results):
    r = results["mixtral"]
    assert r["moe"] and r["no_reference"] is None and r["active"] < r["parameters"]
    nanoexp, plain = r["sides"]["nanoexp"], r["sides"]["plain"]
    assert nanoexp["loss"] == pytest.approx(plain["loss"], abs=1e-5)   # step 1: same weights, same batches
    assert 0 < nanoexp["mfu"] and 0 < plain["mfu"] and nanoexp["act_mb"] > 0 and plain["act_mb"] > 0


def test_qwen3_shaped_moe_has_hf_reference_from_the_same_weights(results):
    r = results["qwen3"]
    assert r["no_reference"] is None and r["reference"].startswith("Qwen3MoeForCausalLM")
    assert r["sides"]["nanoexp"]["loss"] == pytest.approx(r["sides"]["plain"]["loss"], abs=1e-5)


def test_other_moe_shapes_are_timed_without_reference(results):
    r = results["moe_tiny"]
    assert "plain" not in r["sides"] and "layer_frequency" in r["no_reference"]
    row = table_row(r, 8)
    assert row.startswith("moe_tiny default") and " - " in row


def test_moe_is_compared_with_the_nearest_dense_model(results):
    lines = moe_comparisons(list(results.values()))
    assert len(lines) == 3 and all(" vs tiny (default)" in line for line in lines)
    assert "plain" in lines[0] and "plain" not in lines[1] and "plain" in lines[2]   # moe_tiny has no reference
