"""The time half of the cost model behind scripts/plan.py (memory.py is the memory half, comm.py the collectives').

One optimizer step on the busiest pipeline rank is
    m x (F + B)  +  bubble  +  exposed communication  +  optimizer update  +  the host's fixed ops
- F, B: one micro-batch's forward and backward on the slowest stage (`stage_times`; the rule for each kind of op
  is `micro_batch_times`'): matmuls at their number format's peak times `gemm_efficiency`, causal attention at
  ATTENTION_EFFICIENCY, the other ops by the bytes they move, recomputation a forward again, the host's launches.
- bubble: verify/pipeline_bubble.py's simulation of the schedule (its entry: chunks, W apart), F and B each + 1 hop.
- communication (comm.py): each group's bytes (traffic.py) over the link it crosses, hidden behind the compute
  it overlaps, up to it; tp's collectives and the experts' all-to-alls are exposed in nanoexp.
- on a CPU only (`cpu_overhead`): Python's fitted cost per step and per micro-batch and layer
  (benchmarks/bench_plan_cpu.py --calibrate; docs/planning.md, "This CPU").
Fitted on published rows (docs/planning.md says which): GEMM_EFFICIENCY, ATTENTION_EFFICIENCY and comm.OVERLAP;
every other number is counted from the code, a datasheet's, or measured, and says so where it is defined.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import NamedTuple

from nanoexp.config import ConfigError, batch_accumulation, recompute_mode
from nanoexp.numerics.converters import planned_product_dtype
from nanoexp.observe.metrics import (
    down_projection_params,
    flops_per_token,
    layer_matmul_params,
)
from nanoexp.parallel.layout import Layout, split_layers
from nanoexp.parallel.pipeline.schedules import SCHEDULES
from nanoexp.plan.comm import exposed, group_seconds
from nanoexp.plan.hardware import GB, Hardware, per_rank
from nanoexp.plan.memory import device_gib, limit_gib
from nanoexp.plan.traffic import held_by_rank
from nanoexp.model.shape import model_shape
from nanoexp.runtime.recompute import RecomputePolicy
from nanoexp.verify.pipeline_bubble import idle_by_dependencies

GEMM_EFFICIENCY = 0.52        # fitted: the best share of peak a large GEMM reaches
GEMM_KNEE = 512               # a GEMM whose size d (harmonic mean of M, K, N) is this reaches half of it: where
#   moving its bf16 operands and result once (3 x 2 bytes an element; d/3 FLOPs a byte) takes as long at HBM bandwidth
#   as its FLOPs at GEMM_EFFICIENCY of the peak (the additive roofline, d/(d + 3 x 0.52 x 989/3.35): 460 on an H100),
#   rounded to a tile multiple; not fitted
ATTENTION_EFFICIENCY = 0.20   # fitted: causal attention's share of the bf16 peak, forward and backward (SDPA)
FUSED_ATTENTION = 0.50        # cuDNN / FlashAttention-3 kernels (FA3 paper: ~75 % forward, ~55 % backward, causal less)
ELEMENTWISE_FUSED = 120.0     # bytes per token, layer and hidden unit of the non-matmul ops, fused (counted:
ELEMENTWISE_EAGER = 360.0     # norms 8, rotary 5, SwiGLU 21, residuals 4 forward, 2x that backward; eager ~3x)
ATTENTION_BACKWARD = 2.5      # flash attention's backward over its forward: 5 matmuls of the s x s tile to 2 (FA2
#                               paper, Dao 2023, section 3.1), counted as metrics.py and hardware.measure_rates do
UPDATE_BYTES = 28             # AdamW's bytes a parameter of the rank's shard: reads and writes the float32 weight
#                               and both moments (4 + 4 + 2 x (4 + 4)), reads the float32 gradient (4)
# Ops eager PyTorch issues, each costing the host Hardware.launch_us, counted with a TorchDispatchMode on
# model=tiny under bf16 autocast (benchmarks/bench_plan_speed.py --host): a decoder block's forward and backward,
# and a step's clip_grad_norm_, foreach AdamW and zero_grad (a foreach op is one whatever the tensors)
OPS_FORWARD = 82
OPS_BACKWARD = 155
FIXED_STEP_OPS = 98
MODEL_ERROR = 0.07            # the median |error| of the published rows (published.py; test_plan holds it): two
#                               layouts closer than this are a tie to the model


class StageTimes(NamedTuple):
    """One micro-batch on the busiest pipeline rank (`stage_times`), the mean over the ranks of its F + B, and of
    it the time the busiest waits for the host to issue its ops (a launch-bound micro-batch)."""
    busiest: int
    forward: float
    backward: float
    mean: float
    waiting: float = 0.0


@dataclass(frozen=True)
class Framework:
    """How an implementation runs a layout, beyond what the config says. The default is nanoexp's own."""
    name: str = "nanoexp"
    elementwise: float = ELEMENTWISE_EAGER   # bytes per token, layer and hidden unit (fused kernels move fewer)
    dp_bytes_per_value: float = 4.0          # nanoexp reduces and gathers float32; bf16 frameworks 2
    tp_overlap: bool = False                 # Megatron's tp-comm-overlap, torchtitan's async TP
    fp8: bool = False                        # the decoder blocks' linears in FP8 (not the LM head)
    fp8_casts_fused: bool = False            # casts fused into the norms/activations, weights cast once a step (TE)
    attention_efficiency: float | None = None   # None: ATTENTION_EFFICIENCY (SDPA's, as nanoexp and torchtitan run it)

    def describe(self) -> str:
        """One line: what the prediction assumes of the implementation (scripts/plan.py's header)."""
        kernels = "fused elementwise kernels" if self.elementwise < ELEMENTWISE_EAGER else "eager (no compile, no fusion)"
        attention = self.attention_efficiency or ATTENTION_EFFICIENCY
        return (f"{self.name}: {kernels}, SDPA-class attention at {attention:.0%} of the bf16 peak, "
                f"{self.dp_bytes_per_value:g}-byte gradients and gathers, tp's collectives "
                f"{'overlapped' if self.tp_overlap else 'not overlapped'}, {OPS_FORWARD + OPS_BACKWARD} host ops a "
                "layer and micro-batch")


NANOEXP = Framework()


@dataclass
class Prediction:
    """A layout's predicted step on a cluster. `overrides()` gives the Hydra overrides that select it. Memory is
    GiB (2^30 bytes); `margin_gib` is how far below what fits it sits (memory.limit_gib: 90 % of the device)."""
    dp: int
    cp: int
    ep: int
    tp: int
    pp: int
    zero_stage: int
    schedule: str
    virtual_stages: int
    micro_batch: int
    recompute: str   # parallelism.recompute: none | full | selective | every_k
    step_time_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    memory_gib: float
    fits: bool
    breakdown: dict[str, float] = field(default_factory=dict)   # seconds per step: compute, exposed comm, bubble, ...
    dp_shard: int | None = None   # hybrid sharding: ZeRO over dp_shard x cp ranks, replicated across (None: all dp)
    margin_gib: float = float("nan")
    uneven_s: float = 0.0   # of compute: what pricing every stage at the slowest costs over the mean stage

    @property
    def name(self) -> str:
        """The layout's name, with "/shard<dp_shard>" under hybrid sharding (dp4tp1pp1/shard2)."""
        name = Layout(dp=self.dp, cp=self.cp, tp=self.tp, pp=self.pp, ep=self.ep).name
        return name + (f"/shard{self.dp_shard}" if self.dp_shard is not None else "")

    def tied_with(self, other: "Prediction") -> bool:
        """Whether the two are closer than the model's own error (MODEL_ERROR): the model cannot order them."""
        fast, slow = sorted((self.tokens_per_s_per_gpu, other.tokens_per_s_per_gpu), reverse=True)
        return fast - slow <= MODEL_ERROR * fast

    def overrides(self) -> list[str]:
        """parallelism.dp=..., ..., optimizer.zero_stage, tokens.micro_batch_size: `python train.py <these>`."""
        return [f"parallelism.dp={self.dp}", f"parallelism.cp={self.cp}", f"parallelism.ep={self.ep}",
                f"parallelism.tp={self.tp}", f"parallelism.pp={self.pp}", f"parallelism.pp_engine={self.schedule}",
                f"parallelism.pp_virtual_stages={self.virtual_stages}",
                f"parallelism.recompute={self.recompute}",
                f"optimizer.zero_stage={self.zero_stage}", f"tokens.micro_batch_size={self.micro_batch}"] + (
                    [f"parallelism.dp_shard={self.dp_shard}"] if self.dp_shard is not None else [])

    def as_dict(self) -> dict:
        keys = ("dp", "cp", "ep", "tp", "pp", "dp_shard", "zero_stage", "schedule", "virtual_stages", "micro_batch",
                "recompute", "step_time_s", "tokens_per_s_per_gpu", "mfu", "memory_gib", "margin_gib", "fits",
                "breakdown", "uneven_s")
        return {key: getattr(self, key) for key in keys} | {"layout": self.name, "overrides": self.overrides()}


def gemm_efficiency(m: float, k: float, n: float, hw: Hardware | None = None) -> float:
    """Share of peak of an m x k by k x n product: the device's own figure where it states one (a CPU, measured),
    else GEMM_EFFICIENCY x d / (d + GEMM_KNEE), d the harmonic mean."""
    if hw is not None and hw.gemm_efficiency is not None:
        return hw.gemm_efficiency
    d = 3 / (1 / m + 1 / k + 1 / n)
    return GEMM_EFFICIENCY * d / (d + GEMM_KNEE)


def per_layer_params(shape) -> tuple[tuple[int, int], ...]:
    """(matmul parameters a token goes through, those recomputation runs again: all but the down projections) of
    each decoder block (metrics.layer_matmul_params, down_projection_params), computed once a shape."""
    key = repr(shape)
    if key not in _PER_LAYER:
        _PER_LAYER[key] = tuple((layer_matmul_params(shape, n), layer_matmul_params(shape, n)
                                 - down_projection_params(shape, n)) for n in range(shape.num_hidden_layers))
    return _PER_LAYER[key]


_PER_LAYER: dict[str, tuple] = {}


_MODEL_FLOPS: dict[tuple, float] = {}


def model_flops(shape, seq: int) -> float:
    """metrics.flops_per_token (what MFU counts), once a shape and sequence length."""
    key = (repr(shape), seq)
    if key not in _MODEL_FLOPS:
        _MODEL_FLOPS[key] = flops_per_token(shape, seq)
    return _MODEL_FLOPS[key]


def micro_batch_times(cfg, layout: Layout, shape, pp_rank: int, hw: Hardware, fw: Framework) -> tuple[float, float]:
    """(F, B) seconds of one micro-batch on pipeline rank `pp_rank` (B with any recomputation). Matmuls take their
    FLOPs (metrics.layer_matmul_params, split over tp) at the peak of the dtype their number format multiplies in
    (the numerics registry's planned_product_dtype: FP8 on FP8 units, with its casts) times an efficiency that grows
    with the GEMM's sizes (`gemm_efficiency`); causal attention its FLOPs (half the s x s square; backward
    ATTENTION_BACKWARD forwards) at ATTENTION_EFFICIENCY; the other ops (norms, SwiGLU, rotary, residuals) the
    bytes they move at HBM bandwidth. Recomputation adds, for each block its mode recomputes, a forward but the
    down projection, less what selective keeps (metrics.hardware_flops_per_token's rule). At least the time eager
    PyTorch's host takes to issue their ops, OPS x Hardware.launch_us (a micro-batch of small kernels waits)."""
    s, h, tp = cfg.tokens.sequence_length, shape.hidden_size, layout.tp
    tokens = cfg.tokens.micro_batch_size * s / layout.cp
    width = shape.moe.intermediate_size if shape.moe else shape.intermediate_size
    fp8 = fw.fp8 or fp8_products(cfg, hw)
    linear_rate = hw.peak_tflops(fp8) * 1e12 * gemm_efficiency(tokens, h, width / tp, hw)
    layers = [n for chunk in layout.stage_layers(shape.num_hidden_layers, pp_rank) for n in chunk]
    params = per_layer_params(shape)
    matmul = sum(2 * tokens * params[n][0] / tp for n in layers)
    attention_time = attention_seconds(cfg, layout, shape, len(layers), hw, fw)
    moved = tokens * len(layers) * h * fw.elementwise / tp
    if fp8 and not fw.fp8_casts_fused:   # casts to FP8: each linear's input forward, its output gradient backward, its weight both ways
        moved += len(layers) * 3 * (tokens * (3 * h + width + 1.5 * h + h + 2 * width + h) / tp
                                    + 2 * params[layers[0]][0] / tp)
    elementwise = moved / (hw.memory_gbps * GB)
    head = 0.0
    if pp_rank == layout.head_rank:
        head = 2 * tokens * shape.vocab_size * h / tp / (hw.bf16_tflops * 1e12 * gemm_efficiency(tokens, h, shape.vocab_size / tp, hw))
    forward = matmul / linear_rate + attention_time + elementwise / 3 + head
    backward = 2 * matmul / linear_rate + ATTENTION_BACKWARD * attention_time + 2 * elementwise / 3 + 2 * head
    # what the recomputed layers run again (metrics.hardware_flops_per_token's rule): their products but the down
    # projection unless selective keeps the products, their attention unless it keeps attention's (never under
    # cp: a context-parallel kernel), their elementwise ops
    policy = RecomputePolicy.from_config(cfg)
    again = [n for n in layers if policy.recomputes(n)]
    share = len(again) / len(layers)
    if again:
        redo = 0.0 if policy.keeps("matmul") else sum(2 * tokens * params[n][1] / tp for n in again)
        attention_again = 0.0 if policy.keeps("attention") and layout.cp == 1 else share * attention_time
        backward += redo / linear_rate + attention_again + share * elementwise / 3
    host = hw.launch_us * 1e-6 * len(layers)   # the host issues each op; the GPU waits for a slower host
    return (max(forward, host * OPS_FORWARD),
            max(backward, host * (OPS_BACKWARD + share * OPS_FORWARD)))


def fp8_products(cfg, hw: Hardware) -> bool:
    """Whether the decoder's linears multiply in FP8 on `hw`: the number format's own answer (the numerics
    registry's planned_product_dtype). ConfigError where a GPU would emulate them in float32, a rate the table
    lacks; a CPU's products run at its measured peak either way."""
    dtype = planned_product_dtype(cfg, hw.fp8_units)
    if dtype == "float32" and not hw.cpu:
        why = "model.fp8.emulate=true" if hw.fp8_units else "it has no FP8 units"
        raise ConfigError(f"model.fp8: the linears' products would be emulated in float32 on {hw.name} ({why}), "
                          "whose rate the planner has no figure for: plan for h100, h200 or b200, or without FP8")
    return dtype == "float8"


def stage_times(cfg, layout: Layout, shape, hw: Hardware, fw: Framework) -> StageTimes:
    """(the busiest pipeline rank, its F, its B): the slowest stage, whose times the whole schedule is priced at
    (the last stage also runs the LM head). `hw` is one rank's device (hardware.per_rank)."""
    params, placed = per_layer_params(shape), layout.stages
    stages = split_layers(shape.num_hidden_layers, layout.pp * layout.virtual_stages)
    same: dict[tuple, tuple[float, float]] = {}   # ranks of the same layers (and the head or not): the same times
    times = []
    for r in range(layout.pp):
        chunks = (stages[placed.stage(c, r)] for c in range(layout.virtual_stages))
        key = (tuple(params[n] for chunk in chunks for n in chunk), r == placed.head_rank)
        if key not in same:
            same[key] = micro_batch_times(cfg, layout, shape, r, hw, fw)
        times.append(same[key])
    busiest = max(range(layout.pp), key=lambda r: sum(times[r]))
    kernels = sum(micro_batch_times(cfg, layout, shape, busiest, dataclasses.replace(hw, launch_us=0.0), fw))
    return StageTimes(busiest, *times[busiest], sum(f + b for f, b in times) / layout.pp,
                      sum(times[busiest]) - kernels)


def attention_seconds(cfg, layout: Layout, shape, layers: int, hw: Hardware, fw: Framework) -> float:
    """One micro-batch's causal attention forward through `layers` layers: its FLOPs (half the s x s square)
    at the attention rate."""
    s = cfg.tokens.sequence_length
    tokens = cfg.tokens.micro_batch_size * s / layout.cp
    flops = layers * 2 * tokens * s * shape.num_attention_heads * shape.head_dim / layout.tp
    return flops / (hw.bf16_tflops * 1e12 * attention_efficiency(fw, hw))


def attention_efficiency(fw: Framework, hw: Hardware) -> float:
    """The framework's kernels' figure where it states one, else the device's (a CPU's, measured), else SDPA's."""
    if fw.attention_efficiency is not None:
        return fw.attention_efficiency
    return ATTENTION_EFFICIENCY if hw.attention_efficiency is None else hw.attention_efficiency


def cpu_overhead(hw: Hardware, micro_batches: int, layers: int, messages: float) -> float:
    """What eager Python and gloo add to a step on a CPU (the Hardware's CPU-only terms; 0 on GPUs): a fixed cost
    per step, one per micro-batch and layer of the rank, and a latency per blocking message between a layer's or a
    stage's compute (tp's collectives; ring attention's K/V hops, cp - 1 per call; the pipeline's activations and
    gradients) beyond comm_seconds' latency: gloo's messages on a loaded CPU take milliseconds, not 50 µs."""
    return (hw.step_overhead_s + micro_batches * layers * hw.micro_batch_overhead_s
            + messages * hw.message_us * 1e-6)


@functools.lru_cache(maxsize=4096)
def bubble_share(schedule: str, pp: int, v: int, m: int, backward_ratio: float) -> float:
    """Idle time of the schedule in units of one micro-batch's F (F = 1, B = backward_ratio), simulated."""
    if pp == 1:
        return 0.0
    split = SCHEDULES[schedule].splits_backward   # the schedule says whether it runs W apart
    backward, weight = (backward_ratio / 2, backward_ratio / 2) if split else (backward_ratio, 0.0)
    simulated = min(m, 4 * pp * v)   # the idle time stops growing once the pipeline is full
    simulated -= simulated % pp if SCHEDULES[schedule].micro_batches_per_pp and simulated >= pp else 0
    try:
        return idle_by_dependencies(schedule, pp, v, simulated, 1.0, backward, weight)
    except ValueError:
        return (pp - 1) / v * (1 + backward_ratio)   # a shape the simulator refuses: the textbook bubble


def predict(cfg, hw: Hardware, gpus_per_node: int, fw: Framework = NANOEXP, with_memory: bool = True, *,
            shape=None, times: StageTimes | None = None) -> Prediction:
    """The predicted step of the layout, schedule, ZeRO stage, micro-batch and recomputation of `cfg` on `hw` (a
    CPU node shared by the layout's ranks: hardware.per_rank). `shape` (model_shape) and `times` (stage_times on
    the rank's device) may be given by a caller that prices many layouts of one model."""
    layout, shape = Layout.from_config(cfg), shape or model_shape(cfg)
    node, hw = hw, per_rank(hw, layout.world_size)
    m = batch_accumulation(cfg)
    t = times or stage_times(cfg, layout, shape, hw, fw)
    held, held_layers, _ = held_by_rank(shape, layout, t.busiest)
    layers, stage = sum(held_layers), cfg.optimizer.zero_stage
    comm, calls, dp_group = group_seconds(cfg, layout, shape, t.busiest, m, layers, hw, fw, gpus_per_node)
    exposed_comm = exposed_seconds(cfg, layout, shape, comm, dp_group, m, t, layers, hw, fw)
    bubble = bubble_seconds(layout, m, t.forward, t.backward, comm["pp"] / (2 * m) if m else 0.0)
    shard = held / (layout.shard_size if stage >= 1 else 1)
    update = UPDATE_BYTES * shard / (hw.memory_gbps * GB)
    messages = ((calls["tp"] if layout.tp > 1 else 0) + calls["cp"] * (layout.cp - 1)
                + (calls["pp"] if layout.pp > 1 else 0) + (calls[dp_group] if stage >= 2 and layout.shard_size > 1 else 0))
    overhead = cpu_overhead(hw, m, layers, messages)
    fixed = FIXED_STEP_OPS * hw.launch_us * 1e-6   # the update's, clipping's and zeroing's ops, issued by the host
    step = m * (t.forward + t.backward) + bubble + exposed_comm + update + overhead + fixed
    if node.cores and layout.world_size > node.cores:
        # more ranks than cores: a rank idle in the bubble lends its core to the others (the scheduler is
        # work-conserving), so the bubble costs no time, down to the critical path of a core each
        step = max(step - bubble, step * node.cores / layout.world_size)
    # parts of the step that add up to it (before a CPU's cores are shared): kernels, waiting for the host, ...
    breakdown = {"compute": m * (t.forward + t.backward - t.waiting), "host": m * t.waiting + fixed,
                 "exposed_comm": exposed_comm, "bubble": bubble, "optimizer": update} | (
                     {"cpu_overhead": overhead} if overhead else {})
    uneven = min(m * (t.forward + t.backward - t.mean), breakdown["compute"])   # of compute: the slowest stage's
    prediction = dataclasses.replace(prediction_of(cfg, layout, shape, step, breakdown, hw), uneven_s=uneven)
    return with_memory_of(prediction, cfg, hw, shape) if with_memory else prediction


def exposed_seconds(cfg, layout: Layout, shape, comm: dict[str, float], dp_group: str, m: int, t: StageTimes,
                    layers: int, hw: Hardware, fw: Framework) -> float:
    """What the step waits for of each group's time, after what overlaps (the module docstring says what). The
    attention a ring's transfers hide behind is not counted again in ZeRO's window: each second of compute
    hides one collective's time once."""
    attention = attention_seconds(cfg, layout, shape, layers, hw, fw) if hw.overlaps_comm else 0.0
    tp_time, cp_time, ring = layer_comm_seconds(comm, m, t, attention, hw, fw)
    stage = cfg.optimizer.zero_stage
    window = {0: t.backward, 1: t.backward, 2: m * t.backward, 3: m * (t.forward + t.backward)}[stage]
    inside = {0: ATTENTION_BACKWARD, 1: ATTENTION_BACKWARD, 2: m * ATTENTION_BACKWARD,
              3: m * (1 + ATTENTION_BACKWARD)}[stage] * attention   # of it, attention
    window = max(window - ring * inside, 0.0) if hw.overlaps_comm else 0.0
    # the replicas' all-reduce runs once a step after the backward (GradientSync.finish): nothing to hide it behind
    return (exposed(comm[dp_group] + comm["edp"] + comm["expert_shard"], window) + comm["replica"] + tp_time
            + cp_time + comm["ep"] + comm["model_parallel"])


def layer_comm_seconds(comm: dict[str, float], m: int, t: StageTimes, attention: float, hw: Hardware,
                       fw: Framework) -> tuple[float, float, float]:
    """(tp's, the ring's exposed seconds a step, the share of the attention's time the ring's transfers fill):
    the collectives inside the layers, whatever the ZeRO stage. `attention`: one micro-batch's forward."""
    window = m * (1 + ATTENTION_BACKWARD) * attention   # the ring's: forward and backward
    tp_time = exposed(comm["tp"], m * (t.forward + t.backward)) if fw.tp_overlap and hw.overlaps_comm else comm["tp"]
    return tp_time, exposed(comm["cp"], window), min(comm["cp"], window) / window if window else 0.0


def bound_terms(cfg, hw: Hardware, gpus_per_node: int, fw: Framework, shape,
                times: StageTimes) -> tuple[float, float, float]:
    """(compute and the host's fixed cost, the collectives inside the layers, one p2p hop) seconds a step of the
    layout, schedule, micro-batch and recomputation of `cfg` at any ZeRO stage and sharding: what a search bounds a
    step by before it prices it (no ZeRO variant's step is below these and the bubble: predict's sum)."""
    layout, m = Layout.from_config(cfg), batch_accumulation(cfg)
    hw = per_rank(hw, layout.world_size)
    layers = sum(held_by_rank(shape, layout, times.busiest)[1])
    comm, _, _ = group_seconds(cfg, layout, shape, times.busiest, m, layers, hw, fw, gpus_per_node)
    attention = attention_seconds(cfg, layout, shape, layers, hw, fw) if hw.overlaps_comm else 0.0
    tp_time, cp_time, _ = layer_comm_seconds(comm, m, times, attention, hw, fw)
    hop = comm["pp"] / (2 * m) if m else 0.0
    compute = m * (times.forward + times.backward) + FIXED_STEP_OPS * hw.launch_us * 1e-6
    return compute, tp_time + cp_time + comm["ep"] + comm["model_parallel"], hop


def bubble_seconds(layout: Layout, m: int, forward: float, backward: float, hop: float) -> float:
    """The schedule's idle time a step with these F and B and one p2p hop added to each (bubble_share, simulated);
    at least (pp - 1)/v forwards: the last stage waits for the first micro-batch to cross the others."""
    f, b = forward + hop, backward + hop
    return bubble_share(layout.schedule, layout.pp, layout.virtual_stages, m, round(b / f, 2)) * f


def prediction_of(cfg, layout: Layout, shape, step: float, breakdown: dict[str, float], hw: Hardware) -> Prediction:
    """The Prediction of a step of `step` seconds on `hw` (one rank's device; memory not estimated: with_memory_of)."""
    tokens = cfg.tokens.global_batch_size * cfg.tokens.sequence_length
    per_gpu = tokens / step / layout.world_size
    peak = hw.peak_tflops(fp8_products(cfg, hw))   # as the run's MFU: against the peak its products run at
    mfu = model_flops(shape, cfg.tokens.sequence_length) * per_gpu / (peak * 1e12)
    return Prediction(layout.dp, layout.cp, layout.ep, layout.tp, layout.pp, cfg.optimizer.zero_stage,
                      layout.schedule, layout.virtual_stages, cfg.tokens.micro_batch_size, recompute_mode(cfg),
                      step, per_gpu, mfu, float("nan"), True, breakdown, layout.dp_shard)


def with_memory_of(prediction: Prediction, cfg, hw: Hardware, shape=None) -> Prediction:
    """`prediction` with the memory of its busiest GPU (memory.device_gib), how far below what fits on `hw` (one
    rank's device: hardware.per_rank) it sits, and whether it fits."""
    memory, limit = device_gib(cfg, hw.cuda_context_gb, shape), limit_gib(hw.memory_gb)
    return dataclasses.replace(prediction, memory_gib=memory, margin_gib=limit - memory, fits=memory <= limit)
