"""Every valid layout of a GPU count, ranked by predicted tokens/s per GPU (cost.py).

    from nanoexp.plan.search import rank
    ranking = rank(cfg, gpus=64, gpus_per_node=8, gpu="h100", top=5)
    for p in ranking.predictions:          # the fastest that fit, fastest first (cost.Prediction)
        print(p.name, p.tokens_per_s_per_gpu, p.memory_gib, p.overrides())   # overrides: Hydra's, for train.py
    ranking.reasons                         # {one line on why some are out: how many candidates}

A candidate is a choice of dp x cp x tp x pp = gpus (ep dividing dp x cp and the experts, MoE only), a pipeline
schedule of the registry (schedules.py SCHEDULES, with the chunks its entry's plan_chunks names; pp > 1 only), the
ZeRO stage (0-3; 0 alone without dp x cp > 1), hybrid sharding at ZeRO 1-3 (the `dp_shard` whose block dp_shard x cp
x tp fills a node: ZeRO's gathers stay in it), the micro-batch (1, 2, 4) and the recomputation mode (RECOMPUTE).
`validate` decides what is valid, tp stays inside a node, a layout fits when memory.py's estimate is at most HEADROOM
of the GPU's memory, and only candidates that can still be among the `top` are priced in full (`Search`).
"""
from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass, field
from typing import NamedTuple

from omegaconf import OmegaConf

from nanoexp.config import ConfigError, batch_accumulation
from nanoexp.model.shape import model_shape
from nanoexp.parallel.layout import Layout
from nanoexp.parallel.pipeline.schedules import SCHEDULES
from nanoexp.plan.cost import (
    NANOEXP,
    Framework,
    Prediction,
    StageTimes,
    bound_terms,
    bubble_seconds,
    predict,
    stage_times,
    with_memory_of,
)
from nanoexp.plan.hardware import Hardware, hardware, per_rank
from nanoexp.plan.memory import HEADROOM, first_rank_gib, limit_gib
from nanoexp.validation import key_rules, validate

MICRO_BATCHES = (1, 2, 4)
RECOMPUTE = ("none", "selective", "every_k", "full")   # parallelism.recompute's modes (every_k: every 2nd layer)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class Plain(dict):
    """A plain copy of a config read by attribute (cfg.tokens.sequence_length) and .get, as a DictConfig is: the
    search reads and sets a config ~10^5 times, which OmegaConf's checks make ~5x slower."""
    __getattr__ = dict.__getitem__
    __setattr__ = dict.__setitem__


def plain_copy(cfg) -> Plain:
    def plain(value):
        if isinstance(value, dict):
            return Plain({key: plain(item) for key, item in value.items()})
        return [plain(item) for item in value] if isinstance(value, list) else value
    return plain(OmegaConf.to_container(cfg, resolve=True))


def problem_of(cfg, gpus: int, each_key: bool = True) -> str | None:
    """The first problem nanoexp's `validate` finds, or None (one line, with or without a list of several);
    `each_key=False` for a Plain copy whose keys were checked (validate's)."""
    try:
        validate(cfg, world_size=gpus, unread_keys=False, each_key=each_key)   # tp_mode, cp_mode...: the user's
    except ConfigError as error:
        lines = [line.strip(" -") for line in str(error).splitlines() if line.strip(" -")]
        return (lines[1] if len(lines) > 1 else lines[0]).removeprefix("invalid config: ")
    return None


class Choice(NamedTuple):
    dp: int
    cp: int
    ep: int
    tp: int
    pp: int
    schedule: str
    virtual_stages: int
    micro_batch: int
    zero_stage: int
    recompute: str   # parallelism.recompute
    dp_shard: int | None = None   # hybrid sharding (None: ZeRO over all of dp x cp)


def apply(cfg, choice: Choice) -> None:
    """Set `choice` on `cfg` in place (the accumulation derived again from the global batch)."""
    p = cfg.parallelism
    p.dp, p.cp, p.ep, p.tp, p.pp = choice.dp, choice.cp, choice.ep, choice.tp, choice.pp
    p.pp_engine, p.pp_virtual_stages = choice.schedule, choice.virtual_stages
    p.recompute, p.recompute_layer = choice.recompute, False   # every_k with recompute_every's default, 2
    cfg.tokens.micro_batch_size, cfg.optimizer.zero_stage = choice.micro_batch, choice.zero_stage
    p.dp_shard = choice.dp_shard
    cfg.tokens.batch_accumulation_per_replica = None


def layouts(cfg, gpus: int):
    """(dp, cp, ep, tp, pp) of every factorisation of `gpus` (ep > 1 only for a mixture of experts)."""
    experts = cfg.model.moe.num_experts
    for cp in divisors(gpus):
        for tp in divisors(gpus // cp):
            for pp in divisors(gpus // (cp * tp)):
                dp = gpus // (cp * tp * pp)
                for ep in divisors(dp * cp) if experts else (1,):
                    if ep == 1 or experts % ep == 0:
                        yield dp, cp, ep, tp, pp


def planned_schedules(pp: int) -> list[tuple[str, int]]:
    """(schedule, chunks a rank) the search tries: each of the schedule registry's with each of its entry's
    plan_chunks; with one stage only the first that runs one chunk (they are all the same)."""
    planned = [(name, v) for name, schedule in SCHEDULES.items() for v in schedule.plan_chunks]
    return planned if pp > 1 else [next((name, v) for name, v in planned if v == 1)]


def structures(cfg, gpus: int, gpus_per_node: int, micro_batches: tuple[int, ...] = MICRO_BATCHES):
    """Every layout, schedule and micro-batch as a Choice at ZeRO-0 without recomputation, valid or not."""
    for dp, cp, ep, tp, pp in layouts(cfg, gpus):
        for schedule, v in planned_schedules(pp):
            for mb in micro_batches:
                yield Choice(dp, cp, ep, tp, pp, schedule, v, mb, 0, "none")


def checked_structures(cfg, gpus: int, gpus_per_node: int, micro_batches: tuple[int, ...] = MICRO_BATCHES,
                       each_key: bool = True):
    """(structure, its problem or None) of every structure (tp wider than a node is one); `each_key`: problem_of's."""
    for choice in structures(cfg, gpus, gpus_per_node, micro_batches):
        if choice.tp > gpus_per_node:
            yield choice, f"tensor parallelism wider than a node (tp > {gpus_per_node})"
            continue
        apply(cfg, choice)
        yield choice, problem_of(cfg, gpus, each_key)


def shard_degrees(choice: Choice, gpus_per_node: int) -> list[int | None]:
    """Full sharding (None) and the dp_shard < dp whose shard block (dp_shard x cp x tp consecutive ranks) is one
    node, when that shards over more than one rank."""
    block = choice.cp * choice.tp
    fills = gpus_per_node // block if gpus_per_node % block == 0 else 0
    hybrid = [fills] if 0 < fills < choice.dp and choice.dp % fills == 0 and fills * choice.cp > 1 else []
    return [None, *hybrid]


def variants(choice: Choice, gpus_per_node: int | None = None, modes: tuple[str, ...] = RECOMPUTE):
    """The ZeRO stages (each sharded one fully, or also hybrid given `gpus_per_node`: `shard_degrees`) and
    recomputation modes of a valid structure."""
    stages = (0, 1, 2, 3) if choice.dp * choice.cp > 1 else (0,)
    for stage in stages:
        for dp_shard in shard_degrees(choice, gpus_per_node) if stage and gpus_per_node else (None,):
            for recompute in modes:
                yield choice._replace(zero_stage=stage, recompute=recompute, dp_shard=dp_shard)


@dataclass
class Ranking:
    """The `top` fastest candidates that fit (fastest first), why the others are out (one line a reason: how many
    candidates), and how many were priced in full (time and memory)."""
    predictions: list[Prediction]
    reasons: dict[str, int] = field(default_factory=dict)
    priced: int = 0
    examples: dict[str, str] = field(default_factory=dict)   # a reason (its numbers masked): one as it was said

    def reason_lines(self) -> list[str]:
        return [f"{count:>6} {reason}" for reason, count in sorted(self.reasons.items(), key=lambda kv: -kv[1])]

    def most_common(self) -> tuple[str, int]:
        """(the reason most candidates are out for, one instance of it with its numbers, how many), ("", 0) when
        none is out."""
        reason, count = max(self.reasons.items(), key=lambda kv: kv[1], default=("", 0))
        return self.examples.get(reason, reason), count


def rank(cfg, gpus: int, gpus_per_node: int, gpu: str | Hardware, top: int | None = 5,
         framework: Framework = NANOEXP, modes: tuple[str, ...] = RECOMPUTE) -> Ranking:
    """Rank every valid layout of `gpus` GPUs (`gpus_per_node` a node) of kind `gpu` (hardware.GPUS' names, "cpu",
    or a Hardware) for the model, sequence and global batch of `cfg` (a composed config; it is not changed).
    Returns the `top` fastest that fit (all that fit when top is None) as cost.Prediction, each with
    `overrides()` giving its Hydra overrides, and a count per reason of what is out. The order is that of pricing
    every candidate in full (ties: the order of enumeration); only those that can still win are (`Search`).
    `modes`: the recomputation modes tried (parallelism.recompute)."""
    hw = hardware(gpu) if isinstance(gpu, str) else gpu
    key_problem = next((message for ok, message in key_rules(cfg) if not ok), None)
    if key_problem:   # a key out of its domain: every layout has it
        return Ranking([], {f"invalid: {key_problem}": 1})
    return Search(cfg, gpus, gpus_per_node, hw, framework, modes).run(top)


class Search:
    """Branch and bound over the structures (layout, schedule, micro-batch) of a GPU count, each with each
    recomputation mode (a half). A half's bound (cost.step_bound) is a step none of its ZeRO and sharding
    variants undercuts, tightened as it comes to the front: first from its compute, the pipeline's fill and the
    collectives inside its layers, then with its simulated bubble (validated first), and then it is expanded
    (every variant timed). The timed variants are taken fastest first, each priced in full (hybrid sharding
    validated, its memory estimated), while no half left could hold a faster one: the order is that of pricing
    every candidate in full (ties: the order of enumeration). What never comes to the front is counted only."""

    def __init__(self, cfg, gpus: int, gpus_per_node: int, hw: Hardware, fw: Framework,
                 modes: tuple[str, ...] = RECOMPUTE):
        self.cfg, self.gpus, self.gpus_per_node, self.hw, self.fw = plain_copy(cfg), gpus, gpus_per_node, hw, fw
        self.shape, self.device = model_shape(self.cfg), per_rank(hw, gpus)   # every layout has `gpus` ranks
        self.modes = modes   # each structure's halves, in this order (ties)
        self.reasons: dict[str, int] = {}
        self.examples: dict[str, str] = {}   # an invalid reason as counted (masked): one instance of it
        self.priced = 0
        self.problems: dict[int, str | None] = {}   # a structure's problem by its index (both halves ask)
        self.cache: dict[tuple, tuple] = {}   # (index, mode[, "terms"]) -> cost.stage_times (bound_terms)

    def count(self, reason: str, n: int = 1) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + n

    def invalid(self, problem: str, n: int = 1) -> None:
        """Count `n` candidates `validate` refuses: one line a kind of problem (its numbers masked), one kept whole."""
        self.count("invalid: " + masked(problem), n)
        self.examples.setdefault("invalid: " + masked(problem), "invalid: " + problem)

    def run(self, top: int | None) -> Ranking:
        frontier, heap, fitting = self.frontier(), [], []
        while top is None or len(fitting) < top:
            while frontier and (not heap or frontier[0][0] <= heap[0][0]):
                refined, timed = self.refine(*heapq.heappop(frontier))
                for entry in refined:
                    heapq.heappush(frontier, entry)
                for entry in timed:
                    heapq.heappush(heap, entry)
            if not heap:
                break
            prediction = self.price(*heapq.heappop(heap)[-2:])
            if prediction is not None:
                fitting.append(prediction)
        left = len(heap) + sum(len(self.half(structure, k)) for _, _, k, structure, _ in frontier)
        if left:
            self.count(f"could not beat the top {top} (bounded: not validated or priced in full)", left)
        return Ranking(fitting, self.reasons, self.priced, self.examples)

    def half(self, structure: Choice, k: int) -> list[Choice]:
        """The variants of `structure` with the k-th recomputation mode."""
        return [c for c in variants(structure, self.gpus_per_node, self.modes) if c.recompute == self.modes[k]]

    def frontier(self) -> list[tuple]:
        """A heap of (-bound, enumeration index, mode's position, structure, level 0) of the halves of every structure
        whose tp stays inside a node: at first all bounded by the compute without recomputation (cost.stage_times)
        alone; a structure whose times cannot be computed first (validation then says why)."""
        out = []
        for index, structure in enumerate(structures(self.cfg, self.gpus, self.gpus_per_node)):
            if structure.tp > self.gpus_per_node:
                self.count(f"invalid: tensor parallelism wider than a node (tp > {self.gpus_per_node})",
                           len(list(variants(structure, self.gpus_per_node, self.modes))))
                continue
            apply(self.cfg, structure)
            try:
                times = self.times(index, "none")
                m = batch_accumulation(self.cfg)
                bound = -self.tokens(m * (times.forward + times.backward) * (1 - 1e-9)
                                     * min(1.0, self.hw.cores / self.gpus if self.hw.cores else 1.0))
            except (ValueError, ZeroDivisionError, KeyError):
                bound = -math.inf
            out += [(bound, index, k, structure, 0) for k in range(len(self.modes))]
        heapq.heapify(out)
        return out

    def tokens(self, step: float) -> float:
        """tokens/s per GPU of a step of `step` seconds (infinite for none: a layout that cannot run, which
        validation then names)."""
        tokens = self.cfg.tokens.global_batch_size * self.cfg.tokens.sequence_length
        return tokens / step / self.gpus if step > 0 else math.inf

    def refine(self, bound: float, index: int, k: int, structure: Choice, level: int) -> tuple[list, list]:
        """(frontier entries, timed entries) of the half at its next level: level 0 bounded with its own compute,
        fill and layer collectives (1); level 1 validated and bounded with its bubble (2); level 2 expanded (timed:
        `expand`). Neither for an invalid one (counted)."""
        mode = self.modes[k]
        apply(self.cfg, structure._replace(recompute=mode))
        if level == 1 and self.problem(index) is not None:
            self.invalid(self.problems[index], len(self.half(structure, k)))
            return [], []
        try:
            times = self.times(index, mode)
            compute, collectives, hop = self.terms(index, mode, times)
            if self.hw.cores or level == 2:   # a CPU's bound is its compute alone (cost.predict lends idle cores)
                bubble = 0.0
            elif level == 0:
                bubble = (structure.pp - 1) / structure.virtual_stages * times.forward   # the fill: bubble_seconds
            else:
                layout = Layout.from_config(self.cfg)
                bubble = bubble_seconds(layout, batch_accumulation(self.cfg), times.forward, times.backward, hop)
        except (ValueError, ZeroDivisionError, KeyError):
            if self.problem(index) is None:
                raise
            return self.refine(bound, index, k, structure, 1)   # counted as invalid
        if level < 2:
            shared = min(1.0, self.hw.cores / self.gpus) if self.hw.cores else 1.0
            step = (compute + bubble + collectives * (not self.hw.cores)) * shared * (1 - 1e-9)
            return [(-self.tokens(step), index, k, structure, level + 1)], []
        return [], self.expand(index, structure, mode, times)

    def terms(self, index: int, mode: str, times) -> tuple[float, float, float]:
        """cost.bound_terms of the half applied now, once a half."""
        if (index, mode, "terms") not in self.cache:
            self.cache[index, mode, "terms"] = bound_terms(self.cfg, self.hw, self.gpus_per_node, self.fw,
                                                           self.shape, times)
        return self.cache[index, mode, "terms"]

    def times(self, index: int, mode: str) -> StageTimes:
        """cost.stage_times of the structure applied now (with recomputation `mode`), once a half."""
        if (index, mode) not in self.cache:
            layout = Layout.from_config(self.cfg)
            self.cache[index, mode] = stage_times(self.cfg, layout, self.shape, self.device, self.fw)
        return self.cache[index, mode]

    def problem(self, index: int) -> str | None:
        """The problem of the structure applied now (validate's), once a structure."""
        if index not in self.problems:
            self.problems[index] = problem_of(self.cfg, self.gpus, each_key=False)
        return self.problems[index]

    def expand(self, index: int, structure: Choice, mode: str, times) -> list[tuple]:
        """Heap entries (-tokens/s per GPU, index, variant, Choice, Prediction without memory) of every ZeRO and
        sharding variant of a valid half."""
        entries = []
        for n, choice in enumerate(variants(structure, self.gpus_per_node, self.modes)):
            if choice.recompute != mode:
                continue
            apply(self.cfg, choice)
            prediction = predict(self.cfg, self.hw, self.gpus_per_node, self.fw, with_memory=False, shape=self.shape,
                                 times=times)
            entries.append((-prediction.tokens_per_s_per_gpu, index, n, choice, prediction))
        return entries

    def price(self, choice: Choice, timed: Prediction) -> Prediction | None:
        """The variant priced in full (its memory), or None when it is invalid (hybrid sharding's own rules) or
        does not fit (counted)."""
        apply(self.cfg, choice)
        problem = choice.dp_shard is not None and problem_of(self.cfg, self.gpus, each_key=False)
        if problem:
            self.invalid(problem)
            return None
        self.priced += 1
        limit = limit_gib(self.device.memory_gb)
        too_big = first_rank_gib(self.cfg, self.device.cuda_context_gb, self.shape) * (1 - 1e-9) > limit
        prediction = None if too_big else with_memory_of(timed, self.cfg, self.device, self.shape)
        if prediction is None or not prediction.fits:
            self.count(f"does not fit: estimate above {limit_gib(self.device.memory_gb):.1f} GiB "
                       f"({HEADROOM:.0%} of {self.device.memory_gb:g} GB)")
            return None
        return prediction

def masked(problem: str) -> str:
    """A problem with its numbers as # (one line a kind of problem); digits inside names stay (interleaved_1f1b)."""
    return re.sub(r"\b\d+\b", "#", problem)
