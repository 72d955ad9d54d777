"""Per-rank memory estimated from the config alone (what scripts/estimate_memory.py and make_config.py print):
model state by ZeRO stage, the activations of the micro-batches the engine holds at once, what ZeRO-2/3 hold while
they work and gloo's copies. The terms, their derivations and their measurements: docs/memory.md."""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

from nanoexp.config import batch_accumulation, optimizer_name
from nanoexp.instruments.memory import CUDA_CONTEXT_MB, MB
from nanoexp.model.llama import LlamaShape
from nanoexp.model.moe import moe_layer_shapes
from nanoexp.model.shape import model_shape
from nanoexp.numerics.converters import gathered_bytes
from nanoexp.parallel.context_parallel import CP_KERNELS, RankAttention
from nanoexp.parallel.layout import Layout
from nanoexp.parallel.pipeline.schedules import SCHEDULES, compute_order
from nanoexp.optim.registry import OPTIMIZERS
from nanoexp.runtime.recompute import RecomputePolicy



def layer_floats_per_token(shape: LlamaShape, tp: int, recompute, sequence_parallel: bool = False,
                           cp: int = 1, cp_mode: str = "ring", moe: bool = False, ep: int = 1,
                           kept: tuple[str, ...] = ("matmul", "attention")) -> float:
    """Floats one decoder layer keeps for backward per token on a rank (docs/memory.md), under `recompute`: the
    layer's mode of parallelism.recompute (none, full, selective with the op groups `kept`; True: full, False: none,
    as parallelism.recompute_layer); under cp > 1 per token of the rank's s/cp, with cp_mode's attention (its
    CP_KERNELS entry's saved_floats); `moe`: a MoE layer's (moe_floats_per_token in place of the MLP's 4i / tp)."""
    mode = {False: "none", True: "full"}.get(recompute, recompute)
    h, i, heads = shape.hidden_size, shape.intermediate_size, shape.num_attention_heads
    kv = shape.num_key_value_heads * shape.head_dim
    layer_input = h / (tp if sequence_parallel else 1)
    if mode == "full":
        return layer_input
    if mode == "selective":
        return layer_input + kept_floats_per_token(shape, tp, kept, cp, moe)[0]
    # The two residual inputs, their normalised values and norms' 1/rms (sharded along the sequence
    # under SP); the column layers' full inputs; q, k, v, attention output and its log-sum-exp; the MLP.
    norms = 4 * h + 2
    context = CP_KERNELS[cp_mode].saved_floats(rank_attention(shape, tp, cp)) if cp > 1 else 0
    mlp = moe_floats_per_token(shape, ep) / (tp if sequence_parallel else 1) if moe else 4 * i / tp
    return norms / (tp if sequence_parallel else 1) + 2 * h + (2 * h + 2 * kv + heads) / tp + mlp + context


def kept_floats_per_token(shape: LlamaShape, tp: int, kept: tuple[str, ...], cp: int = 1,
                          moe: bool = False) -> tuple[float, float]:
    """(floats per token of the op outputs a selectively recomputed layer keeps, of them those its plain backward
    saves too): `matmul` keeps each projection's output (q, k, v; o and down before their tp reduction, whole
    sequence; gate, up; a MoE layer's router logits and each routed and shared expert's three), `attention` its
    output and log-sum-exp; under cp > 1 attention is a context-parallel kernel, which no group keeps. Of these, v,
    gate and up, the router logits and attention's output are what the plain layer saves as well."""
    h, i, heads = shape.hidden_size, shape.intermediate_size, shape.num_attention_heads
    kv = shape.num_key_value_heads * shape.head_dim
    held = also_saved = 0.0
    if "attention" in kept and cp == 1:
        held, also_saved = (h + heads) / tp, (h + heads) / tp
    if "matmul" in kept:
        if moe:
            m = shape.moe
            width = m.top_k * 2 * m.intermediate_size + 2 * m.num_shared_experts * m.intermediate_size
            mlp, mlp_saved = m.num_experts + width + m.top_k * h + (h if m.num_shared_experts else 0), m.num_experts + width
        else:
            mlp, mlp_saved = 2 * i / tp + h, 2 * i / tp
        held += (h + 2 * kv) / tp + h + mlp
        also_saved += kv / tp + mlp_saved
    return held, also_saved


def rank_attention(shape: LlamaShape, tp: int, cp: int, **micro_batch) -> RankAttention:
    """A layer's attention on a rank, as the CP kernels' facts take it."""
    return RankAttention(shape.num_attention_heads // tp, shape.num_key_value_heads // tp, shape.head_dim, cp,
                         **micro_batch)


def moe_floats_per_token(shape: LlamaShape, ep: int) -> float:
    """A MoE block's saved floats per token it routes (counted from autograd's tensors, tests/test_memory.py):
    router logits and probabilities (2E) and a scalar; per assignment (top_k of them) the expert's input,
    its output before weighting, its SwiGLU's 4 i_e, the weight and the int64 token and slot indices
    (3h + 4 i_e + 7); under ep > 1, measured, h + 2 more per row a rank's experts compute (the received rows and
    their int64 order; with even routing a rank computes as many rows as it sends); the shared experts' SwiGLU
    (4 x their width)."""
    moe, h = shape.moe, shape.hidden_size
    per_assignment = 3 * h + 4 * moe.intermediate_size + 7 + (h + 2 if ep > 1 else 0)
    return 2 * moe.num_experts + 1 + moe.top_k * per_assignment + 4 * moe.intermediate_size * moe.num_shared_experts


class HeldModule(NamedTuple):
    """One module's parameters on a rank (its tp slices): those ZeRO-2/3 shard over dp x cp, and those every
    rank keeps whole (sequence-parallel norms, a tied embedding or its copy); under expert parallelism the routed
    `experts` are counted apart: ZeRO shards them over edp, not dp x cp (kept whole under SP, as the norms)."""
    sharded: int
    whole: int
    experts: int = 0
    hidden_matrices: int = 0   # of all of these, the elements of hidden matrices: what Muon updates (muon.py)
    wire_bytes: int = 4        # bytes per element of its ZeRO-3 gathers (a number format's gathered_bytes)


def gathered_narrow(module: HeldModule, wire_bytes: int) -> HeldModule:
    """A decoder layer whose dp x cp-sharded matrices a number format gathers in `wire_bytes` an element
    (numerics/converters.gathered_bytes), and the rest beside them (norms, router) kept whole (gradient_sync.py)."""
    matrices = module.hidden_matrices - module.experts
    if matrices <= 0:
        return module
    return module._replace(sharded=matrices, whole=module.whole + module.sharded - matrices, wire_bytes=wire_bytes)


def held_modules(shape: LlamaShape, layout: Layout, pp_rank: int) -> tuple[HeldModule, ...]:
    """The modules pp rank `pp_rank` holds, in forward order: the embedding (first stage), each decoder layer of
    its chunks, the final norm and the LM head (last stage; none of its own when tied on one stage). Kept by
    shape (this object: shapes are never changed in place) and layout, for the planner, which asks often."""
    key = (id(shape), layout, pp_rank)
    if key not in _HELD or _HELD[key][0] is not shape:
        if len(_HELD) > 4096:
            _HELD.clear()
        _HELD[key] = shape, tuple(_held_modules(shape, layout, pp_rank))   # the shape kept: its id stays its own
    return _HELD[key][1]


_HELD: dict[tuple, tuple] = {}


def _held_modules(shape: LlamaShape, layout: Layout, pp_rank: int) -> list[HeldModule]:
    h, i, kv = shape.hidden_size, shape.intermediate_size, shape.num_key_value_heads * shape.head_dim
    tied, sp = shape.tie_word_embeddings, layout.sequence_parallel
    embedding = shape.vocab_size * h // layout.tp
    attention, norms = (2 * h * h + 2 * h * kv) // layout.tp, 2 * h
    held = [HeldModule(0, embedding) if tied else HeldModule(embedding, 0)] if pp_rank == 0 else []
    for n in (n for chunk in layout.stage_layers(shape.num_hidden_layers, pp_rank) for n in chunk):
        if shape.is_moe_layer(n):   # experts whole on every tp rank; under SP kept whole, as the norms (moe.py)
            moe = sum(math.prod(s) for s in moe_layer_shapes(h, shape.moe, "").values())
            experts = moe - shape.moe.num_experts * h   # all but the router
            if layout.ep > 1:   # the routed experts split over ep (HeldModule.experts); router and shared ones whole
                routed = 3 * h * shape.moe.intermediate_size * shape.moe.num_experts
                matrices = attention + experts - routed + routed // layout.ep
                held.append(HeldModule(attention, norms + moe - routed, routed // layout.ep, matrices) if sp
                            else HeldModule(attention + norms + moe - routed, 0, routed // layout.ep, matrices))
                continue
            held.append(HeldModule(attention, norms + moe, 0, attention + experts) if sp
                        else HeldModule(attention + moe + norms, 0, 0, attention + experts))
        else:
            matrices = attention + 3 * h * i // layout.tp
            held.append(HeldModule(matrices, norms, 0, matrices) if sp else HeldModule(matrices + norms, 0, 0, matrices))
    head = layout.lm_head_weight(pp_rank, tied)
    if head is not None:
        held.append(HeldModule(0, h) if sp else HeldModule(h, 0))   # the final norm
        held += {"own": [HeldModule(embedding, 0)], "copy": [HeldModule(0, embedding)], "embedding": []}[head]
    return held


def held_parameters(shape: LlamaShape, layout: Layout, pp_rank: int) -> tuple[int, list[int]]:
    """(parameters this pp rank holds per tp rank, layers of each of its chunks)."""
    chunks = [len(layers) for layers in layout.stage_layers(shape.num_hidden_layers, pp_rank)]
    return sum(u.sharded + u.whole + u.experts for u in held_modules(shape, layout, pp_rank)), chunks


def in_flight_layers(cfg, layout: Layout, pp_rank: int, chunks: list[int]) -> tuple[int, int]:
    """(most layers' activations held at once, most loss-chunk micro-batches held at once) on this
    pp rank, replaying its engine's schedule for one step. A schedule with W steps holds a micro-batch until its
    W (the linears' inputs and output gradients wait for it; the rest is freed at B: an upper bound)."""
    loss_chunk = len(chunks) - 1 if pp_rank == layout.head_rank else None
    return _in_flight(layout.schedule, layout.pp, layout.virtual_stages, batch_accumulation(cfg), pp_rank,
                      tuple(chunks), loss_chunk)


@functools.lru_cache(maxsize=4096)   # the planner asks for the same schedules many times
def _in_flight(engine: str, pp: int, v: int, m: int, pp_rank: int, chunks: tuple[int, ...],
               loss_chunk: int | None) -> tuple[int, int]:
    held, layers, most, heads, most_heads = set(), 0, 0, 0, 0
    freed_at = "W" if SCHEDULES[engine].splits_backward else "B"
    for step in compute_order(engine, pp, v, m, pp_rank):
        if step[0] == "F":
            held.add(step[1:])
            layers += chunks[step[1]]
            heads += step[1] == loss_chunk
        elif step[0] == freed_at and step[1:] in held:
            held.discard(step[1:])
            layers -= chunks[step[1]]
            heads -= step[1] == loss_chunk
        most = max(most, layers)
        most_heads = max(most_heads, heads)
    return most, most_heads


def context_workspace(cfg, layout: Layout, shape: LlamaShape) -> float:
    """Bytes one layer's context-parallel attention holds only while it runs (cp > 1; its CP_KERNELS entry's
    workspace_bytes: the ring's tile of scores, the all-gather's dK/dV of the whole sequence, ...). SDPA without
    cp works in tiles: none."""
    if layout.cp == 1:
        return 0
    t = cfg.tokens
    return CP_KERNELS[layout.cp_mode].workspace_bytes(rank_attention(
        shape, layout.tp, layout.cp, batch=t.micro_batch_size, sequence=t.sequence_length,
        act_bytes=2 if cfg.model.dtype == "bfloat16" else 4, documents=cfg.model.attention_mask == "document"))


def activation_bytes(cfg, layout: Layout, shape: LlamaShape, pp_rank: int, chunks: list[int],
                     device_type: str = "cpu") -> float:
    """What autograd holds for backward at most, on this pp rank (docs/memory.md). Kept by shape, layout and the
    keys it reads: the planner asks for every ZeRO stage of a layout."""
    t = cfg.tokens
    key = (id(shape), layout, pp_rank, tuple(chunks), RecomputePolicy.from_config(cfg), device_type, cfg.model.dtype,
           t.micro_batch_size, t.sequence_length, batch_accumulation(cfg), cfg.model.attention_mask)
    if key not in _ACTIVATIONS or _ACTIVATIONS[key][0] is not shape:
        if len(_ACTIVATIONS) > 4096:
            _ACTIVATIONS.clear()
        _ACTIVATIONS[key] = shape, _activation_bytes(cfg, layout, shape, pp_rank, chunks, device_type)
    return _ACTIVATIONS[key][1]


_ACTIVATIONS: dict[tuple, tuple] = {}


def _activation_bytes(cfg, layout: Layout, shape: LlamaShape, pp_rank: int, chunks: list[int],
                      device_type: str) -> float:
    """The in-flight layers' kept floats (each layer as the stage's mean), what one layer's backward adds while the
    later layers of its chunk are freed (`backward_floats_per_token`), and the loss head's. Offload (CUDA) keeps a
    layer that is not recomputed on the host but while its backward runs, beside the one prefetched."""
    policy = RecomputePolicy.from_config(cfg)
    layers, heads = in_flight_layers(cfg, layout, pp_rank, chunks)
    act_bytes = 2 if cfg.model.dtype == "bfloat16" else 4
    tokens = cfg.tokens.micro_batch_size * layout.local_tokens(cfg.tokens.sequence_length)
    floats = dict(tp=layout.tp, sequence_parallel=layout.sequence_parallel, cp=layout.cp, cp_mode=layout.cp_mode,
                  ep=layout.ep)
    offloaded = policy.offload and device_type == "cuda"
    stage = layout.stage_layers(shape.num_hidden_layers, pp_rank)

    @functools.cache
    def kept(mode: str, moe: bool) -> float:   # dense and MoE layers keep different amounts
        if offloaded and mode == "none":
            return 0.0
        return layer_floats_per_token(shape, recompute=mode, moe=moe, kept=policy.saved, **floats)

    @functools.cache
    def backward_of(recomputed: bool, moe: bool) -> float:
        return backward_floats_per_token(shape, layout, policy, recomputed, moe, offloaded)

    ids = [n for chunk in stage for n in chunk]
    per_layer = sum(kept(policy.layer_mode(n), shape.is_moe_layer(n)) for n in ids) / len(ids)
    backward = 0.0
    for chunk in stage:   # a layer's backward runs once the later layers of its chunk are freed
        later = 0.0
        for n in reversed(chunk):
            backward = max(backward, backward_of(policy.recomputes(n), shape.is_moe_layer(n)) - later)
            later += kept(policy.layer_mode(n), shape.is_moe_layer(n))
    head = 3 * shape.hidden_size + 1 + shape.vocab_size / layout.tp   # final norm, its input, the softmax
    return (act_bytes * tokens * (layers * per_layer + backward + heads * head)
            + context_workspace(cfg, layout, shape))


def backward_floats_per_token(shape: LlamaShape, layout: Layout, policy: RecomputePolicy, recomputed: bool,
                              moe: bool = False, offloaded: bool = False) -> float:
    """Floats per token a layer's backward adds to what the layers keep: its gradients of the MLP's intermediate
    (the down projection's input gradient and one more, 2i/tp; measured with LiveTensorPeak), a `recomputed` layer
    re-materialised whole (selective: but the kept outputs its plain backward saves too), an offloaded layer and
    the one prefetched, and under ep a MoE layer's all-to-all rows (sent and received, k per token)."""
    sp = layout.sequence_parallel
    floats = dict(tp=layout.tp, sequence_parallel=sp, cp=layout.cp, cp_mode=layout.cp_mode, ep=layout.ep)
    plain = layer_floats_per_token(shape, recompute="none", moe=moe, **floats)
    width = shape.moe.intermediate_size * (shape.moe.top_k + shape.moe.num_shared_experts) if moe else \
        shape.intermediate_size / layout.tp
    held = 2 * width
    if recomputed:
        also = kept_floats_per_token(shape, layout.tp, policy.saved, layout.cp, moe)[1] if policy.mode == "selective" else 0
        held += plain - also
    elif offloaded:
        held += 2 * plain
    if layout.ep > 1 and moe:
        held += 2 * shape.moe.top_k * shape.hidden_size / (layout.tp if sp else 1)
    return held


def zero_stage(cfg, layout: Layout) -> int:
    """The ZeRO stage that shapes this rank's memory: 0 when its shard group (dp x cp, or dp_shard x cp under
    hybrid sharding) is a single rank: nothing to shard over."""
    return int(cfg.optimizer.zero_stage) if layout.shard_size > 1 else 0


def model_state(stage: int, held: list[HeldModule], d: int, edp: int | None = None,
                sequence_parallel: bool = False, state_bytes=OPTIMIZERS["adamw"].state_bytes) -> dict[str, float]:
    """Persistent bytes (parameters, gradients, the optimizer's state) and the update's temporaries, for ZeRO
    `stage` over d ranks (experts over `edp`). Each unit's flat buffer is padded to a multiple of d: a rank's shard
    is ceil(sharded / d). What a replica holds twice stays whole at every stage, its state sharded from stage 1.
    The optimizer's state is `state_bytes(hidden share)` an element (its OPTIMIZERS entry's: AdamW's two moments, 8;
    Muon's one momentum on the hidden matrices, 4, a rank's shard of them in proportion)."""
    edp, experts = edp or d, sum(u.experts for u in held)
    full = sum(u.sharded + u.whole for u in held) + experts
    kept = sum(u.whole for u in held) + (experts if sequence_parallel else 0)
    scattered = scattered_floats(held, d, edp, sequence_parallel)
    shard = scattered + kept   # what ZeRO-2/3 keep of the gradients (ZeRO-3: and of the parameters)
    updated = {0: full, 1: (full - experts) / d + experts / edp}.get(   # what the optimizer steps
        stage, scattered + sum(u.whole for u in held) / d + (experts / edp if sequence_parallel else 0))
    hidden_share = sum(u.hidden_matrices for u in held) / full if full else 0.0
    return {"parameters": 4 * (shard if stage == 3 else full), "gradients": 4 * (shard if stage >= 2 else full),
            "optimizer": state_bytes(hidden_share) * updated, "update_workspace": 4 * updated}


def scattered_floats(held: list[HeldModule], d: int, edp: int, sequence_parallel: bool) -> int:
    """A rank's shard of the units ZeRO-2/3 reduce-scatter (each padded to a multiple of its group), in floats."""
    return sum(-(-u.sharded // d) for u in held) + (0 if sequence_parallel else sum(-(-u.experts // edp) for u in held))


def most_consecutive(sizes: list[int], count: int) -> int:
    """The largest sum of `count` consecutive sizes (units run in order, forward and backward)."""
    count = max(1, min(count, len(sizes)))
    return max((sum(sizes[k:k + count]) for k in range(len(sizes) - count + 1)), default=0)


def bucket_floats(cfg, shape: LlamaShape, layout: Layout, device_type: str) -> float:
    """The most floats in one ZeRO-2 reduce-scatter: a bucket of model.ddp_bucket_cap_mb (4 MB on gloo, 25 on
    NCCL), or a single larger parameter (an MLP matrix; the embedding or head on the first and last stages)."""
    cap_mb = cfg.model.ddp_bucket_cap_mb or (4 if device_type == "cpu" else 25)
    largest = max(shape.intermediate_size, shape.vocab_size) * shape.hidden_size // layout.tp
    return max(cap_mb * 2**20 / 4, largest)


def units_in_flight(cfg, stage: int, held: list[HeldModule], device_type: str, bucket: float = math.inf) -> float:
    """Bytes ZeRO-2/3 hold only while units compute, beside the activations (docs/memory.md), and on gloo its
    copy of one unit's gradients in the reduce-scatter:
    * ZeRO-2: two buckets' gradients (of at most `bucket` floats each), the one filling and the one reduced;
    * ZeRO-3: the gathered units (a byte an element where gathered in FP8: a format's gathered_bytes) and one unit's gradients. Its
      backward's peak is at its first unit, where all the activations are held and no reduce-scatter has started;
      a later unit holds two units' gradients (and gloo's copy) beside the activations of the layers before it
      only (measured in docs/zero.md)."""
    if stage < 2:
        return 0
    sizes = [u.sharded for u in held]   # whole parameters are neither gathered nor reduce-scattered by unit
    gloo = max(sizes, default=0) if device_type == "cpu" else 0
    if stage == 2:   # reduced in buckets, not layers (GradientSync)
        sizes = [min(size, bucket) for size in sizes]
        return 4 * (most_consecutive(sizes, 2) + min(gloo, bucket))
    keep_all = not cfg.optimizer.zero3_reshard_after_forward   # every unit waits, whole, for its backward
    wire = [u.sharded * u.wire_bytes for u in held]
    gathered = sum(wire) if keep_all else most_consecutive(wire, 1 + cfg.optimizer.zero3_prefetch)
    return 4 * (max(sizes, default=0) + gloo) + gathered


def communication_bytes(stage: int, held: list[HeldModule], device_type: str) -> float:
    """gloo's copies held outside forward and backward: ZeRO-1's buckets as the last backward ends (all of the
    gradients), ZeRO-2's all-gather of one updated unit after the step. NCCL works in place: none."""
    if device_type != "cpu":
        return 0
    if stage == 1:
        return 4 * sum(u.sharded + u.whole + u.experts for u in held)
    return 4 * max((u.sharded for u in held), default=0) if stage == 2 else 0   # at most: buckets are smaller


def estimate(cfg, shape: LlamaShape, pp_rank: int, device_type: str = "cpu") -> dict[str, float]:
    """Bytes one rank of pipeline stage `pp_rank` is expected to hold above its runtime baseline, on a CPU
    (gloo) or CUDA (NCCL) device, by kind (see `total` for what coexists)."""
    layout = Layout.from_config(cfg)
    stage, held = zero_stage(cfg, layout), held_modules(shape, layout, pp_rank)
    wire_bytes = gathered_bytes(cfg) if stage == 3 else None
    if wire_bytes is not None:
        held = [gathered_narrow(u, wire_bytes) for u in held]
    _, chunks = held_parameters(shape, layout, pp_rank)
    state_bytes = OPTIMIZERS[optimizer_name(cfg)].state_bytes
    # ZeRO shards over the shard group (all of dp x cp without hybrid sharding), the experts over its edp ranks;
    # a group of one holds its part whole (16 bytes a parameter with AdamW), as stage 0 does
    shard_size = layout.shard_size
    edp = shard_size // layout.ep
    # With one micro-batch a step the backward's peak (its first unit: every activation held) comes before any
    # gradient shard has landed (zero/scattered.py allocates each at its first landing): they count after it only
    unlanded = 4 * scattered_floats(held, shard_size, edp, layout.sequence_parallel) if (
        stage >= 2 and batch_accumulation(cfg) == 1) else 0
    return {**model_state(stage, held, shard_size, edp, layout.sequence_parallel, state_bytes),
            "unlanded_gradients": unlanded,
            "activations": activation_bytes(cfg, layout, shape, pp_rank, chunks, device_type),
            "in_flight": units_in_flight(cfg, stage, held, device_type, bucket_floats(cfg, shape, layout, device_type)),
            "communication": communication_bytes(stage, held, device_type)}


def total(parts: dict[str, float]) -> float:
    """The peak: the model state plus the largest of what three moments of a step add: forward and backward
    (the activations, and ZeRO-2/3's units in flight beside them), the update (AdamW's sqrt of the second
    moment) and gloo's copies outside backward (ZeRO-1's buckets as it ends, ZeRO-2's gathers after the step).
    Gradient shards not landed yet at the backward's peak (one micro-batch a step) are absent from that moment."""
    backward = parts["activations"] + parts.get("in_flight", 0) - parts.get("unlanded_gradients", 0)
    return (parts["parameters"] + parts["gradients"] + parts["optimizer"]
            + max(backward, parts["update_workspace"], parts.get("communication", 0)))


def busiest_rank_estimate(cfg, shape: LlamaShape, device_type: str = "cpu") -> tuple[int, dict[str, float]]:
    """(pp rank, its estimate) of the rank with the largest total."""
    estimates = [(r, estimate(cfg, shape, r, device_type)) for r in range(Layout.from_config(cfg).pp)]
    return max(estimates, key=lambda item: total(item[1]))


def device_estimate(cfg, shape=None) -> dict[str, float]:
    """Bytes on the busiest GPU of this layout and ZeRO stage, by kind: the estimate of the busiest pipeline stage,
    the bf16 copies of the weights autocast keeps during a step (2 B per parameter held, whatever the stage: each
    matmul saves its weight's cast for backward), and the CUDA context (a nominal allowance: CUDA_CONTEXT_MB).
    `transient` is the largest of what a step's moments add (total): activations with ZeRO-2/3's units in flight,
    or the optimizer's temporaries. What the start-up memory check and the planner (plan/memory.py) compare."""
    shape = shape or model_shape(cfg)
    pp_rank, parts = busiest_rank_estimate(cfg, shape, "cuda")
    held, _ = held_parameters(shape, Layout.from_config(cfg), pp_rank)
    state = {kind: parts[kind] for kind in ("parameters", "gradients", "optimizer")}
    return {**state, "weight_copies": 2 * held if cfg.model.dtype == "bfloat16" else 0,
            "transient": total(parts) - sum(state.values()), "cuda_context": CUDA_CONTEXT_MB * MB}
