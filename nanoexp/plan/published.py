"""Published training throughputs, as data, and the cost model's prediction of each (docs/planning.md).

Each row names the file its numbers come from. Where a table leaves out what the model needs, the row says what
was assumed (`assumed`). Megatron-LM's README table is an image (images/model_table.png): its GPU counts, TP, PP
and MFU are as issue 53 transcribes them; the GPT shapes (hidden size, layers) are chosen to give the named
parameter count with a vocabulary of 131,072, and the global batch of 1,536 sequences is assumed ("we modestly
increase batch size").
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from nanoexp.config import compose, normalize
from nanoexp.parallel.layout import Layout
from nanoexp.plan.cost import (
    ELEMENTWISE_EAGER,
    ELEMENTWISE_FUSED,
    FUSED_ATTENTION,
    Framework,
    predict,
)
from nanoexp.plan.hardware import GPUS, Hardware
from nanoexp.plan.search import Choice, apply, checked_structures, plain_copy, problem_of, variants

MEGATRON_README = "NVIDIA/Megatron-LM README.md (images/model_table.png)"
TITAN_H100 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TITAN_H200 = "pytorch/torchtitan benchmarks/llama3_8b_h200_2025-06_torchtitan.md"
BRIDGE = "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md (25.11 container)"

# Megatron-Core: fused kernels (Transformer Engine), distributed optimizer (float32 gradients reduce-scattered,
# bf16 parameters gathered), TP communication overlapped, cuDNN fused attention.
MEGATRON = Framework("megatron", elementwise=ELEMENTWISE_FUSED, dp_bytes_per_value=3.0, tp_overlap=True,
                     attention_efficiency=FUSED_ATTENTION)
MEGATRON_FP8 = dataclasses.replace(MEGATRON, name="megatron fp8", fp8=True, fp8_casts_fused=True)
# torchtitan: FSDP2 gathers bf16 (FP8 with float8 all-gather) and reduce-scatters float32; eager or compiled.
TITAN = Framework("torchtitan", elementwise=ELEMENTWISE_EAGER, dp_bytes_per_value=3.0)
TITAN_COMPILE = dataclasses.replace(TITAN, name="torchtitan compile", elementwise=ELEMENTWISE_FUSED)
TITAN_FP8 = dataclasses.replace(TITAN_COMPILE, name="torchtitan compile fp8", fp8=True, dp_bytes_per_value=2.5)
TITAN_FP8_ASYNC_TP = dataclasses.replace(TITAN_FP8, name="torchtitan compile fp8 async-TP", tp_overlap=True)
# torchtitan's H100s (its file): 96 GB HBM2e at 2.4 TB/s, 500 W, "the actual peak between SXM and NVL": the
# midpoint of the two datasheet peaks (989 and 835.5 bf16) is used.
H100_TITAN = dataclasses.replace(GPUS["h100"], name="H100 96GB HBM2e 500W", memory_gb=96.0, memory_gbps=2400.0,
                                 bf16_tflops=912.0, fp8_tflops=1824.0)


def gpt(hidden: int, layers: int, heads: int) -> list[str]:
    """Megatron's GPT rows as a Llama shape: MHA, an MLP of 8h^2 parameters (SwiGLU at 8h/3, as GELU's 4h)."""
    width = int(8 * hidden / 3 / 256) * 256
    return ["model=llama3_8b", f"model.model_config.hidden_size={hidden}", f"model.model_config.num_hidden_layers={layers}",
            f"model.model_config.num_attention_heads={heads}", f"model.model_config.num_key_value_heads={heads}",
            f"model.model_config.intermediate_size={width}", "model.model_config.vocab_size=131072"]


@dataclass(frozen=True)
class Row:
    name: str
    source: str
    model: tuple[str, ...]      # Hydra overrides giving the shape
    hw: Hardware
    gpus: int
    seq: int
    global_batch: int           # sequences
    micro_batch: int
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    zero_stage: int = 1
    recompute: str = "none"   # parallelism.recompute of the published run
    framework: Framework = MEGATRON
    metric: str = "tokens_per_s_per_gpu"   # or "mfu"
    value: float = 0.0
    fit: bool = False           # one of the rows the global constants were fitted on
    assumed: str = ""


def _titan(name, hw, gpus, dp, seq, batch, mb, fw, value, *, source=TITAN_H100, model=("model=llama3_8b",), **kw):
    return Row(name, source, model, hw, gpus, seq, batch, mb, dp, zero_stage=kw.pop("zero_stage", 3), framework=fw,
               value=value, **kw)


ROWS = [
    Row("Megatron 1.7B TP1 (48)", MEGATRON_README, tuple(gpt(2048, 24, 16)), GPUS["h100"], 48, 4096, 1536, 1, 48,
        metric="mfu", value=0.41, fit=True, assumed="shape, batch"),
    Row("Megatron 7.1B TP2 (96)", MEGATRON_README, tuple(gpt(4096, 30, 32)), GPUS["h100"], 96, 4096, 1536, 1, 48,
        tp=2, metric="mfu", value=0.47, fit=True, assumed="shape, batch"),
    Row("Megatron 16B TP4 (192)", MEGATRON_README, tuple(gpt(6144, 32, 48)), GPUS["h100"], 192, 4096, 1536, 1, 48,
        tp=4, metric="mfu", value=0.49, assumed="shape, batch"),
    Row("Megatron 32B TP8 (384)", MEGATRON_README, tuple(gpt(8192, 37, 64)), GPUS["h100"], 384, 4096, 1536, 1, 48,
        tp=8, metric="mfu", value=0.46, fit=True, assumed="shape, batch"),
    Row("Megatron 70B TP8 PP2 (768)", MEGATRON_README, tuple(gpt(8192, 80, 64)), GPUS["h100"], 768, 4096, 1536, 1, 48,
        tp=8, pp=2, schedule="interleaved_1f1b", virtual_stages=4, metric="mfu", value=0.42,
        assumed="shape, batch, interleaving"),
    Row("Megatron 462B TP8 PP16 (6144)", MEGATRON_README, tuple(gpt(16384, 144, 128)), GPUS["h100"], 6144, 4096, 1536,
        1, 48, tp=8, pp=16, schedule="interleaved_1f1b", virtual_stages=3, metric="mfu", value=0.47,
        assumed="shape, batch, interleaving"),
    _titan("titan 8B FSDP (8)", H100_TITAN, 8, 8, 8192, 16, 2, TITAN, 5762, fit=True),
    _titan("titan 8B FSDP compile (8)", H100_TITAN, 8, 8, 8192, 16, 2, TITAN_COMPILE, 6667),
    _titan("titan 8B FSDP compile fp8 (8)", H100_TITAN, 8, 8, 8192, 16, 2, TITAN_FP8, 8532, fit=True),
    _titan("titan 8B FSDP (128)", H100_TITAN, 128, 128, 8192, 256, 2, TITAN, 5605, fit=True),
    _titan("titan 8B FSDP compile (128)", H100_TITAN, 128, 128, 8192, 256, 2, TITAN_COMPILE, 6514),
    _titan("titan 8B FSDP compile fp8 (128)", H100_TITAN, 128, 128, 8192, 256, 2, TITAN_FP8, 8380, fit=True),
    *[_titan(f"titan 8B CP{cp} seq {seq // 1024}k (8)", H100_TITAN, 8, 8 // cp, seq, 8 // cp, 1, TITAN_FP8, value,
             cp=cp, recompute="full",
             fit=cp == 1)
      for cp, seq, value in ((1, 32768, 3890), (2, 65536, 2540), (4, 131072, 1071), (8, 262144, 548))],
    _titan("titan 70B FSDP32 TP8 (256)", H100_TITAN, 256, 32, 8192, 512, 16, TITAN_FP8, 829, tp=8, recompute="full",
           model=("model=llama3_70b",)),
    _titan("titan 70B FSDP32 TP8 async-TP (256)", H100_TITAN, 256, 32, 8192, 512, 16, TITAN_FP8_ASYNC_TP, 876, tp=8,
           recompute="full", model=("model=llama3_70b",)),
    _titan("titan 405B 1F1B (512)", H100_TITAN, 512, 8, 8192, 256, 4, TITAN_FP8_ASYNC_TP, 100, tp=8, pp=8,
           recompute="full", zero_stage=1, model=("model=llama3_405b",), assumed="8 micro-batches (the pp degree)"),
    _titan("titan 405B interleaved (512)", H100_TITAN, 512, 8, 8192, 256, 4, TITAN_FP8_ASYNC_TP, 128, tp=8, pp=8,
           schedule="interleaved_1f1b", virtual_stages=2, recompute="full", zero_stage=1, model=("model=llama3_405b",),
           assumed="8 micro-batches (the pp degree), 2 chunks a rank"),
    _titan("titan 8B compile fp8 (32 H200)", GPUS["h200"], 32, 32, 8192, 64, 2, TITAN_FP8, 10938, source=TITAN_H200),
    _titan("titan 8B compile fp8 (64 H200)", GPUS["h200"], 64, 64, 8192, 128, 2, TITAN_FP8, 10753, source=TITAN_H200),
    Row("Bridge 8B FP8 FSDP (8)", BRIDGE, ("model=llama3_8b",), GPUS["h100"], 8, 8192, 128, 1, 8, zero_stage=3,
        framework=MEGATRON_FP8, value=14451),
    Row("Bridge 70B FP8 TP4 PP8 VP5 (64)", BRIDGE, ("model=llama3_70b",), GPUS["h100"], 64, 8192, 128, 1, 2, tp=4,
        pp=8, schedule="interleaved_1f1b", virtual_stages=5, framework=MEGATRON_FP8, value=1602),
    Row("Bridge 405B FP8 TP8 PP8 CP2 VP8 (1024)", BRIDGE, ("model=llama3_405b",), GPUS["h100"], 1024, 8192, 512, 1, 8,
        tp=8, pp=8, cp=2, schedule="interleaved_1f1b", virtual_stages=8, framework=MEGATRON_FP8, value=292),
    Row("Bridge 8B FP8 (8 B200)", BRIDGE, ("model=llama3_8b",), GPUS["b200"], 8, 8192, 128, 2, 8,
        framework=MEGATRON_FP8, value=30624),
    Row("Bridge 405B FP8 TP4 PP8 CP2 VP8 (128 B200)", BRIDGE, ("model=llama3_405b",), GPUS["b200"], 128, 8192, 64, 1,
        2, tp=4, pp=8, cp=2, schedule="interleaved_1f1b", virtual_stages=8, framework=MEGATRON_FP8, value=661),
]


def config_of(row: Row):
    """The composed config of a row's model, sequence, batch and layout."""
    cfg = compose([*row.model, f"tokens.sequence_length={row.seq}", f"tokens.global_batch_size={row.global_batch}",
                   f"model.model_config.max_position_embeddings={max(row.seq, 8192)}"])
    normalize(cfg)
    apply(cfg, row_choice(row))
    return cfg


def row_choice(row: Row) -> Choice:
    return Choice(row.dp, row.cp, 1, row.tp, row.pp, row.schedule, row.virtual_stages, row.micro_batch,
                  row.zero_stage, row.recompute)


def predicted(row: Row, cfg=None) -> float:
    """The row's metric as the cost model predicts it."""
    prediction = predict(cfg or config_of(row), row.hw, 8, row.framework, with_memory=False)
    return getattr(prediction, row.metric)


def relative_error(predicted_value: float, published_value: float) -> float:
    """(predicted - published) / published."""
    return (predicted_value - published_value) / published_value


def share_within(errors: list[float], tolerance: float = 0.15) -> float:
    """The share of `errors` (relative) within +-tolerance."""
    return sum(abs(e) <= tolerance for e in errors) / len(errors) if errors else math.nan


def layout_rank(row: Row) -> tuple[int, int, list[str]]:
    """(rank, layouts, the faster layouts' names): where the row's layout stands among the distinct dp x cp x tp x pp layouts of its GPU
    count that are valid and fit, each at its fastest schedule, ZeRO stage and recomputation, with the row's
    micro-batch and framework. Memory is estimated only for candidates faster than the row's own prediction."""
    cfg = plain_copy(config_of(row))   # read ~10^4 times: a plain copy (search.Plain), its keys checked by compose
    own = predict(cfg, row.hw, 8, row.framework, with_memory=False).tokens_per_s_per_gpu
    faster, layouts = set(), set()
    for structure, problem in checked_structures(cfg, row.gpus, 8, (row.micro_batch,), each_key=False):
        if problem:
            continue
        key = structure[:5]
        layouts.add(key)
        if key in faster or key == row_choice(row)[:5]:
            continue
        for choice in variants(structure):
            apply(cfg, choice)
            if predict(cfg, row.hw, 8, row.framework, with_memory=False).tokens_per_s_per_gpu > own \
                    and predict(cfg, row.hw, 8, row.framework).fits:
                faster.add(key)
                break
    names = [Layout(dp=dp, cp=cp, ep=ep, tp=tp, pp=pp).name for dp, cp, ep, tp, pp in sorted(faster)]
    return len(faster) + 1, len(layouts), names


def check(row: Row) -> dict:
    """The row's published and predicted metric, the error, and whether nanoexp can run its layout as given."""
    cfg = config_of(row)
    value = predicted(row, cfg)
    return {"row": row, "predicted": value, "error": relative_error(value, row.value),
            "problem": problem_of(cfg, row.gpus)}


def fit_constants(rows: list[Row], grid: dict[str, list[float]]) -> dict[str, float]:
    """The values of the cost model's constants named in `grid` (cost.py's or comm.py's; every combination tried)
    that minimise the mean squared log error of `rows`; the modules are left as they were."""
    import itertools

    from nanoexp.plan import comm, cost
    owner = {name: comm if hasattr(comm, name) else cost for name in grid}
    saved = {name: getattr(owner[name], name) for name in grid}
    configs = [config_of(row) for row in rows]
    best, best_loss = saved, math.inf
    try:
        for values in itertools.product(*grid.values()):
            for name, value in zip(grid, values):
                setattr(owner[name], name, value)
            loss = sum(math.log(predicted(r, c) / r.value) ** 2 for r, c in zip(rows, configs)) / len(rows)
            if loss < best_loss:
                best, best_loss = dict(zip(grid, values)), loss
    finally:
        for name, value in saved.items():
            setattr(owner[name], name, value)
    return best
