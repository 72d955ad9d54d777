"""Every valid layout of a GPU count, ranked by predicted tokens/s per GPU (cost.py).

    from nanoexp.plan.search import rank
    ranking = rank(cfg, gpus=64, gpus_per_node=8, gpu="h100", top=5)
    for p in ranking.predictions:          # the fastest that fit, fastest first (cost.Prediction)
        print(p.name, p.tokens_per_s_per_gpu, p.memory_gb, p.overrides())   # overrides: Hydra's, for train.py
    ranking.reasons                         # {one line on why some are out: how many}

A candidate is a choice of dp x cp x tp x pp = gpus (ep dividing dp x cp and the experts, MoE only), the pipeline
schedule (1f1b, interleaved_1f1b with 2 or 4 chunks, zb_h1, zbv, dualpipev; pp > 1 only), the ZeRO stage (0-3; 0 alone
without dp x cp > 1), hybrid sharding at ZeRO 1-3 (`dp_shard` beside full sharding: only the dp_shard whose shard
block dp_shard x cp x tp fills a node, so that ZeRO's gathers stay inside it and only the replicas' all-reduce
crosses nodes; a smaller block would add traffic and save no memory against it), the micro-batch (1, 2, 4) and
recomputation (off, on). nanoexp's own `validate` decides
what is valid (as nanoexp/launch/planner.py does), tensor parallelism stays inside a node, and a layout fits
when planner.estimate is at most HEADROOM of the GPU's memory. Memory is estimated for the fastest candidates
only, until `top` of them fit: the rest are counted as slower.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import NamedTuple

from nanoexp.config import ConfigError
from nanoexp.launch.planner import divisors
from nanoexp.plan.cost import NANOEXP, Framework, Prediction, predict
from nanoexp.plan.hardware import Hardware, hardware
from nanoexp.validation import validate

MICRO_BATCHES = (1, 2, 4)
SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4), ("zb_h1", 1), ("zbv", 2),
             ("dualpipev", 2))


def problem_of(cfg, gpus: int) -> str | None:
    """The first problem nanoexp's `validate` finds, or None (one line, with or without a list of several)."""
    try:
        validate(cfg, world_size=gpus, unread_keys=False)   # tp_mode, cp_mode...: the user's, for any layout
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
    recompute: bool
    dp_shard: int | None = None   # hybrid sharding (None: ZeRO over all of dp x cp)


def apply(cfg, choice: Choice) -> None:
    """Set `choice` on `cfg` in place (the accumulation derived again from the global batch)."""
    p = cfg.parallelism
    p.dp, p.cp, p.ep, p.tp, p.pp = choice.dp, choice.cp, choice.ep, choice.tp, choice.pp
    p.pp_engine, p.pp_virtual_stages, p.recompute_layer = choice.schedule, choice.virtual_stages, choice.recompute
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


def structures(cfg, gpus: int, gpus_per_node: int, micro_batches: tuple[int, ...] = MICRO_BATCHES):
    """(Choice at ZeRO-0 without recomputation, problem or None) for every layout, schedule and micro-batch."""
    for dp, cp, ep, tp, pp in layouts(cfg, gpus):
        for schedule, v in SCHEDULES if pp > 1 else (("1f1b", 1),):
            for mb in micro_batches:
                choice = Choice(dp, cp, ep, tp, pp, schedule, v, mb, 0, False)
                if tp > gpus_per_node:
                    yield choice, f"tensor parallelism wider than a node (tp > {gpus_per_node})"
                    continue
                apply(cfg, choice)
                yield choice, problem_of(cfg, gpus)


def shard_degrees(choice: Choice, gpus_per_node: int) -> list[int | None]:
    """Full sharding (None) and the dp_shard < dp whose shard block (dp_shard x cp x tp consecutive ranks) is one
    node, when that shards over more than one rank."""
    block = choice.cp * choice.tp
    fills = gpus_per_node // block if gpus_per_node % block == 0 else 0
    hybrid = [fills] if 0 < fills < choice.dp and choice.dp % fills == 0 and fills * choice.cp > 1 else []
    return [None, *hybrid]


def variants(choice: Choice, gpus_per_node: int | None = None):
    """The ZeRO stages (each sharded one fully, or also hybrid given `gpus_per_node`: `shard_degrees`) and
    recomputation settings of a valid structure."""
    stages = (0, 1, 2, 3) if choice.dp * choice.cp > 1 else (0,)
    for stage in stages:
        for dp_shard in shard_degrees(choice, gpus_per_node) if stage and gpus_per_node else (None,):
            for recompute in (False, True):
                yield choice._replace(zero_stage=stage, recompute=recompute, dp_shard=dp_shard)


@dataclass
class Ranking:
    """The `top` fastest candidates that fit (fastest first), why the others are out, and every valid
    candidate's prediction without memory (`timed`, fastest first) for callers that need the whole order."""
    predictions: list[Prediction]
    reasons: dict[str, int] = field(default_factory=dict)
    timed: list[tuple[Choice, Prediction]] = field(default_factory=list)

    def reason_lines(self) -> list[str]:
        return [f"{count:>6} {reason}" for reason, count in sorted(self.reasons.items(), key=lambda kv: -kv[1])]


def rank(cfg, gpus: int, gpus_per_node: int, gpu: str | Hardware, top: int | None = 5,
         framework: Framework = NANOEXP) -> Ranking:
    """Rank every valid layout of `gpus` GPUs (`gpus_per_node` a node) of kind `gpu` (hardware.GPUS' names, "cpu",
    or a Hardware) for the model, sequence and global batch of `cfg` (a composed config; it is not changed).
    Returns the `top` fastest that fit (all that fit when top is None) as cost.Prediction, each with
    `overrides()` giving its Hydra overrides, and a count per reason of what is out."""
    hw = hardware(gpu) if isinstance(gpu, str) else gpu
    work = copy.deepcopy(cfg)
    reasons: dict[str, int] = {}
    timed = []
    for structure, problem in structures(work, gpus, gpus_per_node):
        if problem:   # one line per kind of problem: its numbers masked
            key = "invalid: " + re.sub(r"\d+", "#", problem)
            reasons[key] = reasons.get(key, 0) + 1
            continue
        for choice in variants(structure, gpus_per_node):
            apply(work, choice)
            hybrid_problem = choice.dp_shard is not None and problem_of(work, gpus)   # ep, Muon (validation)
            if hybrid_problem:
                key = "invalid: " + re.sub(r"\d+", "#", hybrid_problem)
                reasons[key] = reasons.get(key, 0) + 1
                continue
            timed.append((choice, predict(work, hw, gpus_per_node, framework, with_memory=False)))
    timed.sort(key=lambda item: -item[1].tokens_per_s_per_gpu)
    fitting = []
    for index, (choice, _) in enumerate(timed):
        if top is not None and len(fitting) == top:
            reasons[f"slower than the top {top} (memory not estimated)"] = len(timed) - index
            break
        apply(work, choice)
        prediction = predict(work, hw, gpus_per_node, framework)
        if prediction.fits:
            fitting.append(prediction)
        else:
            key = f"does not fit: estimate above {hw.memory_gb:g} GB x headroom"
            reasons[key] = reasons.get(key, 0) + 1
    return Ranking(fitting, reasons, timed)
