"""The communication half of a step's time (cost.py): each group's bytes a step (traffic.py) over the link it
crosses, with a latency per call, and what overlapping a collective with compute leaves exposed.

The rank grid is (pp, dp, cp, tp), tp innermost (parallel/layout.py), so a group crosses nodes when its ranks span
more than a node's. NCCL's rings move each collective's bytes at one bus bandwidth, LINK_EFFICIENCY of the link's;
gloo's reduce-scatter and all-gather run at their measured share of its all-reduce's rate
(Hardware.collective_speed). Under hybrid sharding ZeRO's collectives run on the shard group and the replicas'
all-reduce once a step.
"""
from __future__ import annotations

import math

from nanoexp.numerics.converters import gathered_bytes
from nanoexp.parallel.layout import Layout
from nanoexp.plan.hardware import GB, Hardware
from nanoexp.plan.traffic import collective_shares, matrix_share, sent_bytes

OVERLAP = 0.85                # fitted: the share of an overlapped collective's time that is hidden
LINK_EFFICIENCY = 0.80        # NCCL's bus bandwidth / the link's (nccl-tests on NVLink and InfiniBand)
BUCKET_MB = 25                # GradientSync's buckets on NCCL (model.ddp_bucket_cap_mb null; memory_estimate's too)
# Calls a step, each paying the link's latency (comm_seconds), counted from the code that makes them:
TP_CALLS_PER_LAYER = 4        # tp: 2 all-reduces a block forward (attention, MLP), 2 backward (traffic.sent_bytes)
TP_CALLS_OUTSIDE = 2          # tp: the embedding's output and the head's input, once a micro-batch each
CP_CALLS_PER_LAYER = 2        # cp: the attention's forward and its backward, each one exchange of K/V (CP_KERNELS)
EP_CALLS_PER_LAYER = 4        # ep: dispatch and combine all-to-alls, forward and backward
PP_CALLS_PER_MICRO_BATCH = 2  # pp: the activation forward, its gradient back
ZERO3_CALLS_PER_LAYER = 3     # ZeRO-3: a layer's gather before forward, before backward, its reduce-scatter (parallel/zero/units.py)

def crosses_nodes(layout: Layout, group: str, gpus_per_node: int) -> bool:
    """Whether a group of `group` spans nodes: the ranks it reaches, (pp, dp, cp, tp) with tp innermost. A shard
    group of hybrid sharding (and the experts' inside it) lies in a block of tp x shard_size consecutive ranks;
    its replica group reaches across all of dp, as the dp group does."""
    inner = layout.tp * layout.cp * layout.dp
    block = layout.tp * layout.shard_size
    span = {"tp": layout.tp, "cp": layout.tp * layout.cp, "ep": layout.tp * layout.ep, "dp": inner, "dp_cp": inner,
            "edp": inner, "pp": inner * layout.pp, "model_parallel": layout.world_size,
            "embedding": layout.world_size, "shard": block, "expert_shard": block, "replica": inner}[group]
    return span > gpus_per_node


def group_size(layout: Layout, group: str) -> int:
    return {"tp": layout.tp, "cp": layout.cp, "ep": layout.ep, "dp": layout.dp, "dp_cp": layout.dp_cp,
            "edp": layout.edp, "pp": 2, "model_parallel": layout.tp * layout.pp, "embedding": 2,
            "shard": layout.shard_size, "expert_shard": layout.shard_size // layout.ep,
            "replica": layout.replicas}[group]


def comm_seconds(nbytes: float, calls: float, n: int, crosses: bool, hw: Hardware) -> float:
    """A group's time: bytes over its link at LINK_EFFICIENCY, plus per call a latency per step of a tree
    (2 log2 n: NCCL pipelines a ring's steps, so large messages do not pay n - 1 latencies)."""
    if nbytes <= 0:
        return 0.0
    bandwidth = (hw.inter_gbps if crosses else hw.intra_gbps) * GB * LINK_EFFICIENCY
    latency = (hw.inter_latency_us if crosses else hw.intra_latency_us) * 1e-6
    return nbytes / bandwidth + calls * 2 * max(math.ceil(math.log2(n)), 1) * latency


def exposed(comm: float, window: float) -> float:
    """What a collective overlapped with `window` seconds of compute adds to the step. The windows: gradient
    buckets behind the last backward (ZeRO-0/1), reduce-scatters behind every backward (ZeRO-2), prefetched gathers
    behind every forward and backward (ZeRO-3), ring attention behind the attention. A second of compute hides one
    collective's time once: the attention the ring fills leaves ZeRO's window."""
    return max(comm - window, 0.0) + (1 - OVERLAP) * min(comm, window)


def group_seconds(cfg, layout: Layout, shape, busiest: int, m: int, layers: int, hw: Hardware, fw,
                  gpus_per_node: int) -> tuple[dict[str, float], dict[str, float], str]:
    """(seconds a step of each group's bytes, its calls a step, the group ZeRO runs on) of the busiest rank, under
    framework `fw` (cost.Framework: the bytes a value of its gradients and gathers)."""
    sent = sent_bytes(cfg, layout, shape, busiest, m)
    shares = collective_shares(cfg, layout, m)   # gloo's reduce-scatter and all-gather run slower than its all-reduce
    # ZeRO's group: dp x cp, or the shard group under hybrid sharding (dp x cp then carries only the loss scalars)
    dp_group = "shard" if layout.replicas > 1 else "dp" if layout.cp == 1 else "dp_cp"
    narrow = gathered_bytes(cfg) if cfg.optimizer.zero_stage == 3 else None   # the number format's (registry)
    for group in (dp_group, "replica", "expert_shard"):
        sent[group] *= fw.dp_bytes_per_value / 4
    if narrow is not None:   # ZeRO-3 gathers the layers' matrices in `narrow` bytes an element, not float32's 4
        gathers = shares.get(dp_group, {}).get("all_gather", 0.0)
        sent[dp_group] *= 1 - gathers * (1 - narrow / 4) * matrix_share(shape, layout, busiest)
    bucket = BUCKET_MB * 2 ** 20
    calls = {"tp": m * (TP_CALLS_PER_LAYER * layers + TP_CALLS_OUTSIDE), "cp": m * layers * CP_CALLS_PER_LAYER,
             "ep": m * layers * EP_CALLS_PER_LAYER, "pp": PP_CALLS_PER_MICRO_BATCH * m,
             # ZeRO-3 moves a layer a call (parallel/zero/units.py); the others buckets
             dp_group: m * ZERO3_CALLS_PER_LAYER * layers if cfg.optimizer.zero_stage == 3
             else max(1.0, sent[dp_group] / bucket),
             "replica": max(1.0, sent["replica"] / bucket)}
    comm = {g: comm_seconds(b * hw.slowdown(shares.get(g, {})), calls.get(g, 1), group_size(layout, g),
                            crosses_nodes(layout, g, gpus_per_node), hw) if b > 0 else 0.0 for g, b in sent.items()}
    return comm, calls, dp_group
