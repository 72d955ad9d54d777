"""Bytes one rank sends per optimizer step, per process group: the analytic minimum that
nanoexp/verify/comm_counter.py's counts are checked against (tests/test_comm_counter.py through
benchmarks/bench_parallel.py, which calls `sent_bytes`), and what the cost model divides by a link's bandwidth.

Sent bytes follow comm_counter's ring rules: an all-reduce of B bytes over n ranks sends 2(n-1)/n x B, a
reduce-scatter or all-gather (n-1)/n of the whole, a send its tensor. Per step, with m micro-batches, s' = seq / cp
the tokens of a sample a rank holds, A = micro_batch x s' x hidden x activation bytes and N the parameters the rank
holds, `sent_bytes` lists each group's (benchmarks/bench_parallel.py's docstring explains each line).
"""
from __future__ import annotations

from nanoexp.observe.memory_estimate import held_modules, held_parameters, rank_attention
from nanoexp.parallel.context_parallel import CP_KERNELS
from nanoexp.parallel.layout import Layout
from nanoexp.parallel.zero.units import ZeroStage
from nanoexp.runtime.recompute import RecomputePolicy

GROUPS = ("dp", "dp_cp", "cp", "ep", "edp", "tp", "pp", "model_parallel", "embedding", "shard", "replica",
          "expert_shard")


_HELD: dict[tuple, tuple[int, tuple[int, ...], int]] = {}


def held_by_rank(shape, layout: Layout, pp_rank: int) -> tuple[int, tuple[int, ...], int]:
    """(parameters pipeline rank `pp_rank` holds per tp rank, layers of each of its chunks, routed experts' share of
    them): memory_estimate.held_parameters and held_modules, kept by shape and layout (the planner asks often)."""
    key = (repr(shape), layout, pp_rank)
    if key not in _HELD:
        held, chunks = held_parameters(shape, layout, pp_rank)
        experts = sum(module.experts for module in held_modules(shape, layout, pp_rank))   # ep > 1 only
        _HELD[key] = held, tuple(chunks), experts
    return _HELD[key]


def matrix_share(shape, layout: Layout, pp_rank: int) -> float:
    """Of the parameters ZeRO shards over dp x cp on this rank (not the routed experts), the share in the decoder
    layers' matrices: what a number format gathers narrower at ZeRO-3 (memory_estimate.gathered_narrow's)."""
    held, _, experts = held_by_rank(shape, layout, pp_rank)
    matrices = sum(max(u.hidden_matrices - u.experts, 0) for u in held_modules(shape, layout, pp_rank))
    return matrices / (held - experts) if held > experts else 0.0


def ring(n: int) -> float:
    """What an all-reduce sends per byte of its tensor."""
    return 2 * (n - 1) / n


def zero_collectives(cfg, m: int) -> dict[str, int]:
    """ZeRO's passes over dp x cp per step by collective: the engine's own count (units.ZeroStage.collectives)."""
    return ZeroStage(cfg.optimizer.zero_stage).collectives(m, cfg.optimizer.zero3_reshard_after_forward)


def zero_passes(cfg, m: int) -> int:
    """All of ZeRO's passes a step (zero_collectives)."""
    return sum(zero_collectives(cfg, m).values())


def collective_shares(cfg, layout: Layout, m: int) -> dict[str, dict[str, float]]:
    """Each group's bytes by the collective that sends them, as shares (a group not named: all-reduces and
    sends). One gloo collective moves a byte at another rate than the next (hardware.Hardware.collective_speed)."""
    zero = zero_collectives(cfg, m)
    total = sum(zero.values())
    shares = {group: {kind: passes / total for kind, passes in zero.items()}
              for group in ("dp", "dp_cp", "edp", "shard", "expert_shard")}
    if layout.sequence_parallel:   # a gather before each tp block, a reduce-scatter after it; backward swaps them
        shares["tp"] = {"all_gather": 0.5, "reduce_scatter": 0.5}
    return shares


def hybrid_sent_bytes(cfg, layout: Layout, held: float, m: int, experts: float = 0) -> dict[str, float]:
    """ZeRO's bytes per step under hybrid sharding (docs/zero.md#hybrid-sharding), of `held` parameters, `experts`
    of them routed experts: over the shard group of n = dp_shard x cp ranks the passes of full sharding,
    zero_passes x (n-1)/n x 4N; over the replica group of R = dp / dp_shard, one all-reduce of the rank's shard a
    step, 2(R-1)/R x 4N/n. The experts shard over n_e = n / ep ranks ("expert_shard") and all-reduce their shard
    over the same replica group. A group of one rank shards nothing: its state is all-reduced whole (stage 0)."""
    n, replicas, passes = layout.shard_size, layout.replicas, zero_passes(cfg, m)
    n_e, dense = n // layout.ep, held - experts
    return {"shard": ring(n) / 2 * passes * 4 * dense,
            "expert_shard": ring(n_e) / 2 * passes * 4 * experts,
            "replica": ring(replicas) * 4 * (dense / n + experts / n_e)}


def all_to_all_bytes(cfg, layout: Layout, shape, pp_rank: int, micro_batches: int, tokens: int) -> float:
    """Expert parallelism per step: each of the `tokens` a micro-batch has this rank route sends its hidden state
    (float32) to its top_k experts and gets their outputs back, in every MoE layer of this stage, forward and
    backward (and forward again under recomputation); with even routing (ep-1)/ep of the rows go to another
    rank. Before the rows, each forward exchanges the E counts (int64)."""
    moe, layers = shape.moe, layout.stage_layers(shape.num_hidden_layers, pp_rank)
    moe_layers = [n for chunk in layers for n in chunk if shape.is_moe_layer(n)]
    forwards = 1 + RecomputePolicy.from_config(cfg).share(moe_layers)   # any mode reruns the all-to-all in place
    rows = 4 * shape.hidden_size * tokens * moe.top_k * (2 * forwards + 2)
    counts = 8 * moe.num_experts * forwards
    return micro_batches * len(moe_layers) * (rows + counts) * (layout.ep - 1) / layout.ep


def activation_bytes(cfg) -> int:
    return 2 if cfg.model.dtype == "bfloat16" else 4   # TP and CP messages run in the autocast dtype


# Per group, what `sent_bytes` counts:
# dp (dp_cp with cp > 1)  zero_passes x (n-1)/n x 4N, plus the step loss and the token count (float32 scalars);
# edp  the experts' gradients over the expert-data-parallel ranks; ep  the all-to-all of routed tokens;
# shard, replica, expert_shard  under hybrid sharding (`hybrid_sent_bytes`): ZeRO's passes over the shard group
#      in place of dp x cp's, and one all-reduce of the rank's shard a step across the replicas;
# cp   per layer and micro-batch, what parallelism.cp_mode's kernel says it sends (its CP_KERNELS entry's
#      sent_bytes), the forward's share again under recomputation;
# tp   4 all-reduces of A per layer (2 forward, 2 backward; the same bytes as sequence parallelism's gathers
#      and reduce-scatters; one more when the block is recomputed), one for the embedding and one for the
#      head's input, the vocab-parallel loss' 3;
# pp   the activation to the next stage and its gradient back, float32, per micro-batch, plus the step loss;
# model_parallel  the squared gradient norm.
def sent_bytes(cfg, layout: Layout, shape, pp_rank: int, m: int) -> dict[str, float]:
    """Bytes the rank of pipeline stage `pp_rank` sends per optimizer step of `m` micro-batches, per group (the
    comment above says what each group's count is)."""
    mb, s, h = cfg.tokens.micro_batch_size, layout.local_tokens(cfg.tokens.sequence_length), shape.hidden_size
    first, last, sp = pp_rank == 0, pp_rank == layout.head_rank, layout.sequence_parallel
    act = activation_bytes(cfg)
    out = {name: 0.0 for name in GROUPS}
    held, chunks, experts = held_by_rank(shape, layout, pp_rank)
    layers = sum(chunks)
    again = RecomputePolicy.from_config(cfg).share(n for chunk in layout.stage_layers(shape.num_hidden_layers, pp_rank)
                                                   for n in chunk)   # the share of layers recomputed
    hybrid = layout.replicas > 1
    if layout.dp_cp > 1:   # every cp rank holds the full weights: gradients over dp x cp
        scalars = 1 + last   # the step loss; the target-token count on the loss stage
        out["dp" if layout.cp == 1 else "dp_cp"] = ring(layout.dp_cp) * 4 * (
            (0 if hybrid else (held - experts) * zero_passes(cfg, m) / 2) + scalars)
    if hybrid:
        out.update(hybrid_sent_bytes(cfg, layout, held, m, experts))
    if layout.ep > 1:
        out["ep"] = all_to_all_bytes(cfg, layout, shape, pp_rank, m, mb * s // (layout.tp if sp else 1))
        if not hybrid:
            out["edp"] = ring(layout.edp) * 4 * experts * zero_passes(cfg, m) / 2 if layout.edp > 1 else 0
    if layout.cp > 1:
        attention = rank_attention(shape, layout.tp, layout.cp, batch=mb, sequence=cfg.tokens.sequence_length,
                                   act_bytes=act, documents=cfg.model.attention_mask == "document")
        forwards = 1 + again   # the context-parallel kernel runs again in every mode (no op group keeps it)
        out["cp"] = m * layers * CP_KERNELS[layout.cp_mode].sent_bytes(attention, forwards)
    if layout.tp > 1:
        # a recomputed block repeats its attention's forward all-reduce, not its MLP's: recomputation stops once
        # every saved tensor is back, and nothing saves the down projection's output (metrics.py); selective too, as
        # the all-reduce works in place and no policy keeps it (model/saved_ops.py)
        per_layer = 4 + again
        per_micro = (per_layer * layers + first + last) * ring(layout.tp) * mb * s * h * act
        if last:
            per_micro += 3 * ring(layout.tp) * mb * s * 4
        out["tp"] = m * per_micro
        if sp:
            out["tp"] += ring(layout.tp) * 4 * (2 * layers + last) * h   # the norm weights' gradients
    if layout.pp > 1:
        boundary = mb * (s // layout.tp if sp else s) * h * 4
        out["pp"] = m * boundary * ((not last) + (not first)) + ring(layout.pp) * 4
    if layout.tp * layout.pp > 1:
        out["model_parallel"] = ring(layout.tp * layout.pp) * 4
    return out
