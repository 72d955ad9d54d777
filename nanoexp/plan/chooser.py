"""scripts/make_config.py's chooser, memory only: every dp x cp x tp x pp layout of a GPU count, each at the lowest
ZeRO stage whose estimated memory fits (memory.py), and the one with the least model parallelism.

- Every layout of `gpus` processes (cp as the config has it) is checked with nanoexp's own `validate`
  (search.problem_of) and with tp <= GPUs per node (tensor parallelism stays inside a node).
- A layout's lowest ZeRO stage that fits is the lowest whose estimate (memory.estimate) is at most HEADROOM of the
  GPU's memory. Lower stages are cheaper (`dp_traffic_bytes`): ZeRO-0 and 1 move the bytes of one all-reduce of
  the gradients per step, ZeRO-2 a reduce-scatter per micro-batch, ZeRO-3 also an all-gather of the parameters
  before each forward and each backward. Without dp x cp > 1 only ZeRO-0 applies.
- Of the fitting layouts the smallest tp*pp wins, then the smallest pp (a pipeline adds a bubble, tensor
  parallelism inside a node does not), then the lowest ZeRO stage: ZeRO's collectives overlap the computation,
  where tp's sit between a layer's matmuls and pp idles in the bubble.
scripts/plan.py ranks the same layouts by predicted speed instead (search.py, cost.py).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from nanoexp.config import batch_accumulation
from nanoexp.model.shape import model_shape
from nanoexp.observe.memory_estimate import held_parameters
from nanoexp.parallel.layout import Layout
from nanoexp.plan.memory import GIB, HEADROOM, estimate, limit_gib
from nanoexp.plan.search import divisors, problem_of
from nanoexp.plan.traffic import zero_passes

ZERO_STAGES = (0, 1, 2, 3)   # in the order of their communication per step


def dp_traffic_bytes(cfg) -> float:
    """Bytes a GPU sends over dp x cp per optimizer step for its ZeRO stage (ring collectives, float32, its
    busiest pipeline stage's parameters): a reduce-scatter or an all-gather of N parameters sends 4N(d - 1)/d.
    ZeRO-0 all-reduces once (two of those), ZeRO-1 reduce-scatters and all-gathers once; ZeRO-2 reduce-scatters
    every micro-batch and all-gathers the update; ZeRO-3 gathers every micro-batch before forward and again before
    backward (once with zero3_reshard_after_forward=false) and reduce-scatters. Under hybrid sharding
    (parallelism.dp_shard) d is the shard group's n ranks, and the R replicas add an all-reduce of the rank's
    shard, 2(R - 1)/R x 4N/n."""
    layout, shape = Layout.from_config(cfg), model_shape(cfg)
    held = max(held_parameters(shape, layout, r)[0] for r in range(layout.pp))
    n, replicas = layout.shard_size, layout.replicas   # hybrid sharding: ZeRO over n ranks, R replicas of each
    one = 4 * held * (n - 1) / n
    # the replicas all-reduce each rank's shard once a step (nanoexp/plan/traffic.py's hybrid_sent_bytes)
    across = 2 * (replicas - 1) / replicas * 4 * held / n
    return zero_passes(cfg, batch_accumulation(cfg)) * one + across


def with_stage(cfg, stage: int):
    staged = copy.deepcopy(cfg)
    staged.optimizer.zero_stage = stage
    return staged


def candidates(base, gpus: int, gpus_per_node: int):
    """(cfg, problem) for every dp*cp*tp*pp == gpus layout (cp as given, parallelism.cp), without ZeRO; problem
    is None for a valid one."""
    cp = base.parallelism.cp
    for tp in divisors(gpus // cp if gpus % cp == 0 else 0):
        for pp in divisors(gpus // (cp * tp)):
            cfg = with_stage(base, 0)
            cfg.parallelism.dp, cfg.parallelism.tp, cfg.parallelism.pp = gpus // (cp * tp * pp), tp, pp
            too_wide = f"tp={tp} > {gpus_per_node} GPUs per node" if tp > gpus_per_node else None
            yield cfg, too_wide or problem_of(cfg, gpus)


@dataclass
class Option:
    """A valid layout: each ZeRO stage it may use, with its estimate; `stage` the lowest that fits, or None."""
    by_stage: dict[int, tuple[Any, dict[str, float]]]   # stage -> (its config, its estimate)
    stage: int | None

    @property
    def cfg(self):
        return self.by_stage[self.stage][0]

    def total(self, stage: int) -> float:
        return sum(self.by_stage[stage][1].values())


def stages_of(cfg, gpus: int, budget: float) -> Option:
    """The layout `cfg` under each ZeRO stage that applies (0 only without dp x cp > 1; a stage `validate`
    refuses is left out), and the lowest one that fits in `budget` bytes."""
    applicable = ZERO_STAGES if Layout.from_config(cfg).dp_cp > 1 else (0,)
    staged = [with_stage(cfg, stage) for stage in applicable]
    by_stage = {c.optimizer.zero_stage: (c, estimate(c)) for c in staged if problem_of(c, gpus) is None}
    fitting = [stage for stage, (_, parts) in by_stage.items() if sum(parts.values()) <= budget]
    return Option(by_stage, min(fitting, default=None))


def layout(cfg) -> str:
    return Layout.from_config(cfg).name


def print_option(option: Option) -> None:
    """One row: the lowest fitting stage's estimate (the highest stage's when none fits), every stage's total."""
    shown = option.stage if option.stage is not None else max(option.by_stage)
    cfg, parts = option.by_stage[shown]
    totals = "  ".join(f"{s}: {option.total(s) / GIB:.1f}" for s in option.by_stage)
    print(f"{layout(cfg):<12}{shown:>5}" + "".join(f"{v / GIB:9.1f}" for v in parts.values())
          + f"{option.total(shown) / GIB:9.1f}  {'fits' if option.stage is not None else 'too big':<8} {totals}")


def choose(base, gpus: int, gpus_per_node: int, memory_gb: float) -> Option | None:
    """Print the estimate of every layout at its lowest fitting ZeRO stage; return the chosen one (None when
    nothing fits)."""
    budget = limit_gib(memory_gb) * GIB
    print(f"{'layout':<12}{'ZeRO':>5}{'params':>9}{'grads':>9}{'optim':>9}{'bf16 w':>9}{'transient':>10}{'context':>8}"
          f"{'total':>9}  {'':<8} total by ZeRO stage  (GiB per GPU; budget {budget / GIB:.1f})")
    fitting = []
    for cfg, problem in candidates(base, gpus, gpus_per_node):
        if problem:
            print(f"{layout(cfg):<12}invalid: {problem}")
            continue
        option = stages_of(cfg, gpus, budget)
        if not option.by_stage:
            print(f"{layout(cfg):<12}invalid at every ZeRO stage")
            continue
        print_option(option)
        if option.stage is not None:
            fitting.append(option)
    if not fitting:
        return None
    return min(fitting, key=lambda o: (o.cfg.parallelism.tp * o.cfg.parallelism.pp, o.cfg.parallelism.pp,
                                       o.cfg.parallelism.tp, o.stage))


def explain(option: Option, memory_gb: float) -> str:
    """Why this layout and stage: the stages below it that did not fit, and what each stage sends per step."""
    cfg, budget = option.cfg, limit_gib(memory_gb) * GIB
    lines = [f"chosen: {layout(cfg)} with ZeRO-{option.stage}: the fitting layout with the least model parallelism "
             f"(tp x pp = {cfg.parallelism.tp * cfg.parallelism.pp}), {batch_accumulation(cfg)} micro-batches per step "
             f"and replica"]
    too_big = [f"ZeRO-{s} {option.total(s) / GIB:.1f} GiB" for s in option.by_stage if s < option.stage]
    room = f"{budget / GIB:.1f} GiB, {HEADROOM:.0%} of {memory_gb:g} GB"
    lowest = f"the stages below are too big ({', '.join(too_big)} > {room})" if too_big else f"it fits in {room}"
    lines.append(f"  ZeRO-{option.stage} ({option.total(option.stage) / GIB:.1f} GiB) is its lowest stage that fits: "
                 f"{lowest}")
    if option.stage == 0 and 1 in option.by_stage:
        lines.append(f"  (ZeRO-1 sends the same bytes and would hold {option.total(1) / GIB:.1f} GiB: "
                     "optimizer.zero_stage=1 for more headroom)")
    if len(option.by_stage) > 1:
        traffic = ", ".join(f"ZeRO-{s} {dp_traffic_bytes(c) / GIB:.1f}" for s, (c, _) in option.by_stage.items())
        lines.append(f"  sent over dp x cp per step and GPU (GiB): {traffic}")
        lines.append("  (ZeRO-0/1 all-reduce the gradients once a step, ZeRO-2 reduce-scatters them every micro-batch, "
                     "ZeRO-3 also gathers the parameters for each forward and backward)")
    return "\n".join(lines)
