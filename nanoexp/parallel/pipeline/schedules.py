"""The pipeline schedules (`parallelism.pp_engine`) of one optimizer step, as data: the steps one pp rank executes in
order, ("F" | "B" | "W", chunk, micro_batch) for compute (W: the weight gradients of a backward split in two, which
send nothing) and ("P2P", messages) for one batch_isend_irecv waited on as a whole, each message ("send" | "recv",
"F" | "B", chunk, micro_batch) with the rank of the next or previous virtual stage as peer (stages.py), or
("LOCAL", message) for a message whose two ends are on this rank (zbv's V tip), handed over in memory.
Data, because NCCL runs a pair of ranks' point-to-point operations in order, ignores tags and completes a large
send only once its receive is posted: nanoexp.verify.p2p_plan replays every schedule under those rules and the
engine posts exactly what was checked. A `Schedule` in `SCHEDULES` states its own rules (`problems`), which
validation asks. The shapes of the schedules: docs/parallelism.md."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from nanoexp.parallel.pipeline.stages import StageMap

Step = tuple   # ("F" | "B", chunk, micro_batch) or ("P2P", messages)


def phases(warmup: int, pp: int, v: int, m: int) -> tuple[list, list, list]:
    """One rank's compute for one step with `warmup` warm-up forwards: (warm-up forwards, steady
    (forward, backward) pairs, cool-down backwards)."""
    def forward_id(k):   # the k-th forward on this rank: (chunk, micro-batch)
        rounds, within = divmod(k, pp * v)
        return within // pp, rounds * pp + within % pp

    forwards = [("F", *forward_id(k)) for k in range(m * v)]
    backwards = [("B", v - 1 - chunk, mb) for _, chunk, mb in forwards]
    steady = m * v - warmup
    return forwards[:warmup], list(zip(forwards[warmup:], backwards[:steady])), backwards[steady:]


def all_forward_all_backward(pp: int, v: int, m: int, pp_rank: int) -> tuple[list, list]:
    """afab (GPipe): every micro-batch forward, then every backward in the same order, one message per
    batch: each receive right before its op, each send right after it. A stage holds every micro-batch's
    activations at the peak. With one stage it is plain gradient accumulation (forward, backward, ...)."""
    warmup, pairs, cooldown = phases(m if pp > 1 else 0, pp, v, m)
    ops = warmup + [op for pair in pairs for op in pair] + cooldown
    return [[op] for op in ops], [False] * len(ops)


def one_forward_one_backward(pp: int, v: int, m: int, pp_rank: int) -> tuple[list, list]:
    """1f1b: stage r runs pp - r - 1 warm-up forwards, then alternates one forward and one backward, then
    drains the warm-up backwards: the bubble of afab, but stage r holds at most pp - r micro-batches. In the
    steady state the send after an op and the receive before the next share one batch (Megatron-LM's
    send_forward_recv_backward and send_backward_recv_forward), so neighbours never wait on each other's
    sends. With fewer micro-batches than stages the warm-up is capped at m: still correct, more bubble."""
    warmup, pairs, cooldown = phases(min(pp - pp_rank - 1, m), pp, v, m)
    steady = [op for pair in pairs for op in pair]
    groups = [[op] for op in warmup + steady + cooldown]
    merged = [len(warmup) <= g < len(warmup) + len(steady) - 1 for g in range(len(groups))]
    return groups, merged


def interleaved_one_forward_one_backward(pp: int, v: int, m: int, pp_rank: int) -> tuple[list, list]:
    """interleaved_1f1b: each rank holds v chunks of layers, chunk c of rank r being virtual stage c·pp + r,
    so a micro-batch travels the ring of ranks v times. Each chunk is 1/v of a stage's work, so the pipeline
    fills and drains v times faster: the bubble falls from (p-1)/(m+p-1) to (p-1)/(v·m+p-1), for v times more
    messages (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
    Megatron-LM", section 2.2.2, whose schedule this is). Rank r runs 2·(pp-r-1) + (v-1)·pp warm-up forwards;
    each steady (forward, backward) pair is one compute group, and between two groups one batch carries the
    sends of the group before and the receives of the group after, as Megatron-LM's interleaved schedule
    does. Needs m to be a multiple of pp. Posting one message at a time deadlocks under NCCL
    (tests/test_p2p_plan.py shows it)."""
    warmup, pairs, cooldown = phases(min(2 * (pp - pp_rank - 1) + (v - 1) * pp, m * v), pp, v, m)
    groups = [[op] for op in warmup] + [list(pair) for pair in pairs] + [[op] for op in cooldown]
    return groups, [True] * len(groups)


def zero_bubble_h1(pp: int, v: int, m: int, pp_rank: int) -> tuple[list, list]:
    """zb_h1: 1f1b whose backwards are split (weight_grad.py) into B, the input's gradient the previous stage
    waits for, and W, the weight gradients nobody waits for. Rank r runs 1f1b's pp - r - 1 warm-up forwards and
    (F, B) pairs, and from its r-th backward on follows each B with the W of its oldest backward still owing
    one; the r Ws left run at the end, where 1f1b's rank r idles. The Ws fill 1f1b's cool-down bubble, which
    falls to about a third at 1f1b's activation memory (Qi et al. 2024, "Zero Bubble Pipeline Parallelism",
    ZB-H1; torch.distributed.pipelining's ScheduleInterleavedZeroBubble with one stage per rank computes the
    same order: tests/test_zero_bubble.py)."""
    warmup = min(pp - pp_rank - 1, m)
    groups = [[("F", 0, mb)] for mb in range(min(warmup + 1, m))]   # the warm-up and the first steady forward
    for j in range(m):
        weight = [("W", 0, j - pp_rank)] if j >= pp_rank else []
        forward = [("F", 0, warmup + j + 1)] if warmup + j + 1 < m else []
        # a W shares the group of the next F: the exchange between B and F (one batch, as 1f1b's) comes first
        groups += [[("B", 0, j)]] + ([weight + forward] if weight or forward else [])
    groups += [[("W", 0, mb)] for mb in range(max(m - pp_rank, 0), m)]
    last_forward = max(g for g, group in enumerate(groups) if group[-1][0] == "F")
    return groups, [warmup <= g <= last_forward for g in range(len(groups))]


def zero_bubble_v(pp: int, v: int, m: int, pp_rank: int) -> tuple[list, list]:
    """zbv: two chunks per rank in V placement (stages.py: rank 0 holds the first and the last stage, the last rank
    the two middle ones), backwards split into B and W as zb_h1's. Rank r runs 2·(pp − r) − 1 forwards of chunk 0,
    r pairs (F chunk 1, F chunk 0), pp − r triples (F, B, W) of chunk 1, then (F, B, W) of chunk 0 and of chunk 1
    in turn until every forward ran, r pairs (B chunk 0, B chunk 1), pp − r pairs (B, W) of chunk 0, and the Ws
    left, chunk 1's first (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6, ZB-V: about 1f1b's
    activation memory; by its data dependencies it idles (p − 1)(T_F + T_B − T_W)/2 when T_F <= T_B, half of
    zb_h1's: nanoexp/verify/pipeline_bubble.py). The order is built for at least 2·pp − 1 micro-batches and those
    beyond m dropped, as torch.distributed.pipelining's ScheduleZBVZeroBubble does (the same order:
    tests/test_zero_bubble_v.py). Its messages are placed from every rank's order at once (`_placed_by_senders`),
    not by groups."""
    r, padded = pp_rank, max(2 * pp - 1, m)
    done = {}   # (kind, chunk) -> how many ran

    def take(*ops):
        for kind, chunk in ops:
            mb = done.get((kind, chunk), 0)
            done[kind, chunk] = mb + 1
            order.append((kind, chunk, mb))

    def count(kind, chunk):
        return done.get((kind, chunk), 0)

    order = []
    take(*[("F", 0)] * (2 * (pp - r) - 1))
    take(*[("F", 1), ("F", 0)] * r)
    take(*[("F", 1), ("B", 1), ("W", 1)] * (pp - r))
    while count("F", 1) < count("F", 0) or count("F", 0) < padded:
        take(*([("F", 0)] if count("F", 0) < padded else []), ("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1))
    take(*[("B", 0), ("B", 1)] * r)
    take(*[("B", 0), ("W", 0)] * (pp - r))
    take(*[("W", 1)] * (count("B", 1) - count("W", 1)), *[("W", 0)] * (count("B", 0) - count("W", 0)))
    groups = [[op] for op in order if op[2] < m]
    return groups, [True] * len(groups)


def dualpipe_v(pp: int, v: int, m: int, pp_rank: int) -> tuple[list, list]:
    """dualpipev: DualPipe (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 3.2.1) folded onto half the
    ranks, zbv's V placement and B/W split. Its steady state pairs a forward of one chunk with a backward of the
    other (F chunk 0 with B chunk 1, F chunk 1 with B chunk 0), a pair DualPipe overlaps to hide expert-parallel
    all-to-alls behind compute; here the pair runs one op after the other. Rank r runs 2·(pp − r − 1) forwards of
    chunk 0, r + 1 pairs (F chunk 0, F chunk 1), pp − r − 1 triples (B, W, F) of chunk 1, m − 2·pp + r + 1 rounds
    (F 0, B 1, W 1, F 1, B 0, W 0), pp − r − 1 rounds (B 1, W 1, F 1, B 0, W 0), r + 1 pairs (B chunk 1, B chunk 0)
    whose W follows at once until the middle pair and is owed from then on (from the middle pair's chunk 1 on an
    odd rank, its chunk 0 on an even one), pp − r − 1 pairs (owed W, B chunk 0)
    and the r + 1 Ws still owed, oldest first. A backward whose W follows at once is one full backward of
    torch.distributed.pipelining's ScheduleDualPipeV, whose table this is, overlapped pairs expanded F then B
    (tests/test_dualpipev.py). Needs a micro-batch per virtual stage (m >= 2·pp), as torch's."""
    r, ops = pp_rank, _RankOps()
    for _ in range(2 * (pp - r - 1)):
        ops.forward(0)
    for _ in range(r + 1):
        ops.forward(0)
        ops.forward(1)
    for _ in range(pp - r - 1):
        ops.backward(1)
        ops.forward(1)
    for _ in range(m - 2 * pp + r + 1):
        ops.paired(0)
        ops.paired(1)
    for _ in range(pp - r - 1):
        ops.backward(1)
        ops.paired(1)
    middle = (r + 1) // 2   # from the middle pair on, Ws are owed: they fill the cool-down's gaps
    for i in range(r + 1):
        ops.backward(1, defer_weights=i > middle or (i == middle and r % 2 == 1))
        ops.backward(0, defer_weights=i >= middle)
    for _ in range(pp - r - 1):
        ops.owed_weights()
        ops.backward(0, defer_weights=True)
    while ops.owed:
        ops.owed_weights()
    return [[op] for op in ops.order], [True] * len(ops.order)


class _RankOps:
    """One rank's ops of two chunks in the order written (dualpipe_v): each F and B of a chunk takes its next
    micro-batch; a B's W follows at once or is owed (`owed`: (chunk, micro-batch), oldest first)."""

    def __init__(self):
        self.order, self.owed, self.ran = [], [], {}   # ran: (kind, chunk) -> how many ran

    def forward(self, chunk: int) -> None:
        self.order.append(("F", chunk, self.ran.get(("F", chunk), 0)))
        self.ran["F", chunk] = self.order[-1][2] + 1

    def backward(self, chunk: int, defer_weights: bool = False) -> None:
        mb = self.ran.get(("B", chunk), 0)
        self.ran["B", chunk] = mb + 1
        self.order.append(("B", chunk, mb))
        if defer_weights:
            self.owed.append((chunk, mb))
        else:
            self.order.append(("W", chunk, mb))

    def owed_weights(self) -> None:
        self.order.append(("W", *self.owed.pop(0)))

    def paired(self, forward_chunk: int) -> None:   # a forward and the other chunk's backward: DualPipe's pair
        self.forward(forward_chunk)
        self.backward(1 - forward_chunk)


@dataclass(frozen=True)
class Schedule:
    """One parallelism.pp_engine: its plan, (pp, v, m, pp_rank) -> (compute groups, merged[g]: one batch between
    groups g and g + 1), and the shapes it runs (its rules, stated here only)."""
    plan: Callable
    chunks: str = "one"            # chunks of layers per rank: "one" (v = 1), "two" (v = 2) or "several" (v >= 2)
    micro_batches_per_pp: bool = False   # the micro-batches of a step must be a multiple of pp
    micro_batch_per_stage: bool = False  # a step needs at least one micro-batch per virtual stage (m >= pp·v)
    splits_backward: bool = False  # runs B and W apart ("W" steps: weight_grad.py)
    placement: str = "loop"        # where each rank's chunks sit among the virtual stages (stages.py)
    plan_chunks: tuple = (1,)      # the chunks a rank scripts/plan.py tries it with (nanoexp/plan/search.py), which
    #                                prices it by simulating `plan` (splits_backward: W apart); () never tried

    def stages(self, pp: int, v: int) -> StageMap:
        return StageMap(pp, v, self.placement)

    def problems(self, name: str, pp: int, v: int, m: int | None = None, layers: int | None = None) -> list[str]:
        """Why this schedule cannot run pp ranks with v chunks each, m micro-batches a step (None: not checked) and
        `layers` layers (None: not checked: a config is checked with them, and then one chunk per rank is refused
        where another schedule runs it), in the keys that set them; [] when it can."""
        if self.chunks == "one":
            return [] if v == 1 else [(f"parallelism.pp_virtual_stages={v} needs parallelism.pp_engine="
                                       f"interleaved_1f1b (or zbv or dualpipev with 2; got {name})")]
        problems = []
        if pp < 2:
            problems.append(f"parallelism.pp_engine={name} needs parallelism.pp >= 2 (got {pp}): at least 2 "
                            "pipeline ranks interleave their chunks")
        if self.chunks == "two" and v != 2:
            problems.append(f"parallelism.pp_virtual_stages={v}: {name} runs exactly 2 chunks per rank (set "
                            "parallelism.pp_virtual_stages=2)")
        if self.chunks == "several" and v < 2 and layers is not None:
            problems.append(f"parallelism.pp_virtual_stages={v}: {name} needs at least 2 chunks per rank (with 1 "
                            "use parallelism.pp_engine=1f1b)")
        if layers is not None and layers < pp * v:
            problems.append(f"model.model_config.num_hidden_layers={layers} is smaller than parallelism.pp * "
                            f"pp_virtual_stages = {pp * v}: every virtual stage needs at least one layer")
        if self.micro_batches_per_pp and m is not None and pp >= 2 and m % pp:
            problems.append(f"micro-batches per step (tokens.batch_accumulation_per_replica = {m}) is not a "
                            f"multiple of parallelism.pp={pp}: {name} sends micro-batches in groups of pp; change "
                            "tokens.global_batch_size or tokens.micro_batch_size")
        if self.micro_batch_per_stage and m is not None and m < pp * v:
            problems.append(f"micro-batches per step (tokens.batch_accumulation_per_replica = {m}) are fewer than "
                            f"parallelism.pp * pp_virtual_stages = {pp * v}: {name} needs one per virtual stage; "
                            "raise tokens.global_batch_size or lower tokens.micro_batch_size")
        return problems


# afab is not planned: 1f1b's bubble, holding every micro-batch's activations at once
SCHEDULES = {"afab": Schedule(all_forward_all_backward, plan_chunks=()),
             "1f1b": Schedule(one_forward_one_backward),
             "interleaved_1f1b": Schedule(interleaved_one_forward_one_backward, chunks="several",
                                          micro_batches_per_pp=True, plan_chunks=(2, 4)),
             "zb_h1": Schedule(zero_bubble_h1, splits_backward=True),
             "zbv": Schedule(zero_bubble_v, chunks="two", splits_backward=True, placement="v", plan_chunks=(2,)),
             "dualpipev": Schedule(dualpipe_v, chunks="two", micro_batch_per_stage=True, splits_backward=True,
                                   placement="v", plan_chunks=(2,))}


def stage_map(name: str, pp: int, v: int) -> StageMap:
    """Where schedule `name` places the chunks of pp ranks with v chunks each."""
    return SCHEDULES[name].stages(pp, v)


def check_shape(name: str, pp: int, v: int, m: int | None = None, forward_only: bool = False) -> None:
    """Raise ValueError when schedule `name` cannot run pp ranks with v chunks each (and m micro-batches, unless
    None)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline engine {name!r}; expected one of {tuple(SCHEDULES)}")
    if pp < 1 or v < 1 or (m is not None and m < 1):
        raise ValueError(f"invalid pipeline shape for {name}: pp={pp}, v={v}, m={m}")
    problems = SCHEDULES[name].problems(name, pp, v, None if forward_only else m)
    if problems:
        raise ValueError(problems[0])


def schedule(name: str, pp: int, v: int, m: int, pp_rank: int, forward_only: bool = False) -> tuple[Step, ...]:
    """Every step pp rank `pp_rank` runs in one optimizer step of schedule `name` with v chunks per rank and m
    micro-batches. Each received tensor comes in a batch before the op that needs it (under V placement as early
    as its sender sends it: `_placed_by_senders`), each sent tensor leaves in a batch after the op that made it,
    and a message exists only where its neighbouring virtual stage does; one whose two ends are on this
    rank is a ("LOCAL", message) step right after the op that made it. forward_only: evaluation, every
    micro-batch through every chunk in the order of their stages, one message per batch. Raises ValueError on
    a shape the schedule cannot run."""
    check_shape(name, pp, v, m, forward_only)
    return _every_rank(name, pp, v, m, forward_only)[pp_rank]


@lru_cache(maxsize=64)
def _every_rank(name: str, pp: int, v: int, m: int, forward_only: bool) -> tuple[tuple[Step, ...], ...]:
    stages = stage_map(name, pp, v)
    if forward_only:
        plans = [[[("F", chunk, mb)] for mb in range(m) for chunk in sorted(range(v), key=lambda c: stages.stage(c, r))]
                 for r in range(pp)]
        plans = [(groups, [False] * len(groups)) for groups in plans]
    else:
        plans = [SCHEDULES[name].plan(pp, v, m, r) for r in range(pp)]
    if stages.placement == "v":
        every_rank = _placed_by_senders([[op for group in groups for op in group] for groups, _ in plans], stages)
    else:
        every_rank = [_with_batches(groups, merged, stages, r) for r, (groups, merged) in enumerate(plans)]
    return tuple(tuple(steps) for steps in every_rank)


def compute_order(name: str, pp: int, v: int, m: int, pp_rank: int, forward_only: bool = False) -> list[Step]:
    """The compute steps of `schedule`, without its messages: its plan's groups in order (`schedule` only adds
    the messages between them), built without the messages."""
    if forward_only:
        return [step for step in schedule(name, pp, v, m, pp_rank, forward_only) if step[0] in ("F", "B", "W")]
    check_shape(name, pp, v, m)
    return [op for group in SCHEDULES[name].plan(pp, v, m, pp_rank)[0] for op in group]


def _with_batches(groups, merged, stages: StageMap, pp_rank: int) -> list[Step]:
    """The compute groups with their messages: the receives of a group's ops in a batch right before it,
    their sends right after it; where merged[g], the sends after group g and the receives before g + 1 are
    one batch. Messages within this rank become LOCAL steps after their group."""
    def messages(verb, group):
        found = [msg for op in group if op[0] != "W" and stages.other_end(msg := (verb, *op), pp_rank)]
        return ([msg for msg in found if not stages.is_local(msg, pp_rank)],
                [("LOCAL", msg) for msg in found if stages.is_local(msg, pp_rank)])

    steps, sends = [], []
    for g, group in enumerate(groups):
        recvs, _ = messages("recv", group)
        batches = [sends + recvs] if g > 0 and merged[g - 1] else [sends, recvs]
        steps += [("P2P", tuple(batch)) for batch in batches if batch] + group
        sends, local = messages("send", group)
        steps += local
    return steps + ([("P2P", tuple(sends))] if sends else [])


def _placed_by_senders(orders: list[list], stages: StageMap) -> list[list[Step]]:
    """Messages for compute orders that share channels both ways (zbv), placed as torch.distributed.pipelining
    places them (its `_add_send_recv`): the ranks run their orders in lock-step rounds, each op once its input
    has come, and when an op sends, its receive is put on the receiver at the same moment. Between two of a
    rank's compute ops its sends and the receives put there are one batch, so each channel's receives come in
    the order of its sends, and every receive is posted as soon as its sender can send it."""
    steps, batch = [[] for _ in orders], [[] for _ in orders]
    arrived = [set() for _ in orders]   # the ops of each rank whose input is there
    position = [0] * len(orders)
    while any(position[r] < len(order) for r, order in enumerate(orders)):
        progressed = False
        for rank, order in enumerate(orders):
            if position[rank] == len(order):
                continue
            op = order[position[rank]]
            if op[0] != "W" and stages.other_end(("recv", *op), rank) and op not in arrived[rank]:
                continue
            if batch[rank]:
                steps[rank].append(("P2P", tuple(batch[rank])))
            batch[rank] = []
            steps[rank].append(op)
            if op[0] != "W" and (end := stages.other_end(msg := ("send", *op), rank)):
                if end[0] == rank:
                    steps[rank].append(("LOCAL", msg))
                else:
                    batch[rank].append(msg)
                    batch[end[0]].append(("recv", op[0], end[1], op[2]))
                arrived[end[0]].add((op[0], end[1], op[2]))
            position[rank], progressed = position[rank] + 1, True
        if not progressed:
            raise ValueError("the compute orders cannot run: every rank waits for an input")
    return [rank_steps + ([("P2P", tuple(last))] if last else []) for rank_steps, last in zip(steps, batch)]
