"""Each pipeline engine's point-to-point communication as data, and a checker with NCCL's rules.

The tests run on gloo, whose sends are buffered. NCCL is stricter: between two ranks the
point-to-point operations of each direction run in order on one stream, tags are ignored (the
k-th send from a to b meets the k-th receive at b from a), and a large send completes only once
the peer has posted the matching receive. An order that gloo forgives can hang there. So the
engines do not choose what to post as they go: `schedule` gives one pp rank's steps for one
optimizer step (or one evaluation pass) as plain data, and pipeline.py executes that list:

* ("F" | "B", chunk, micro_batch): a forward or backward of one chunk of layers;
* ("P2P", messages): post the messages as ONE batch_isend_irecv and wait for all of them. A
  message ("send" | "recv", "F" | "B", chunk, micro_batch) is the activation leaving or entering
  that forward, or the gradient leaving or entering that backward; its peer is the next or the
  previous pp rank round the ring (`peer`).

`plan` reduces every rank's schedule to what NCCL sees, (verb, peer pp rank, nbytes) per op per
batch, and `check` replays a plan under NCCL's rules. Every engine has the same shape: warm-up
forwards, steady (forward, backward) pairs, cool-down backwards (`_phases`). They batch
differently:

* afab: one message per batch, each receive right before its op, each send right after it;
* 1f1b: as afab in warm-up and cool-down; in the steady state the send after an op and the
  receive before the next share one batch (Megatron's send_forward_recv_backward and
  send_backward_recv_forward);
* interleaved_1f1b: a steady pair is one group of compute, and between two groups one batch
  carries the sends of the group before and the receives of the group after (the batched
  exchanges of Megatron-LM's interleaved schedule).

tests/test_p2p_plan.py checks every engine's plan for pp 2..8, v 1..4, m 1..16, shows that the
interleaved engine's former order (one message at a time) deadlocks, and compares what the
engines actually post on gloo with `plan`, op for op.
"""
from __future__ import annotations

from collections import Counter

ENGINES = ("afab", "1f1b", "interleaved_1f1b")


class PlanError(RuntimeError):
    """A plan that cannot run under NCCL's rules: a deadlock, or an op without its partner."""


def _phases(engine: str, pp: int, v: int, m: int, pp_rank: int) -> tuple[list, list, list]:
    """This rank's compute for one step: (warm-up forwards, steady (forward, backward) pairs,
    cool-down backwards). Forwards walk the micro-batches in groups of pp, chunk 0 then chunk 1 ...
    for each group; backwards walk the same way with the chunks reversed. With v = 1 both are
    simply micro-batch order."""
    def forward_id(k):   # the k-th forward on this rank
        rounds, within = divmod(k, pp * v)
        return within // pp, rounds * pp + within % pp

    total = m * v
    forwards = [("F", *forward_id(k)) for k in range(total)]
    backwards = [("B", v - 1 - chunk, mb) for _, chunk, mb in forwards]
    warmup = {"afab": m if pp > 1 else 0,   # one stage: plain gradient accumulation
              "1f1b": min(pp - pp_rank - 1, m),
              "interleaved_1f1b": min(2 * (pp - pp_rank - 1) + (v - 1) * pp, total)}[engine]
    steady = total - warmup
    return forwards[:warmup], list(zip(forwards[warmup:], backwards[:steady])), backwards[steady:]


def interleaved_order(pp: int, num_chunks: int, num_micro: int, pp_rank: int) -> list[tuple[str, int, int]]:
    """This rank's compute in interleaved 1F1B: ("F" | "B", chunk, micro_batch) in execution order.
    Each (chunk, micro-batch) appears once as "F" and later once as "B"; every chunk's backwards
    come in micro-batch order. Needs num_micro % pp == 0 (ValueError otherwise)."""
    _validate("interleaved_1f1b", pp, num_chunks, num_micro, forward_only=False)
    warmup, pairs, cooldown = _phases("interleaved_1f1b", pp, num_chunks, num_micro, pp_rank)
    return warmup + [op for pair in pairs for op in pair] + cooldown


def _validate(engine, pp, v, m, forward_only):
    if engine not in ENGINES:
        raise ValueError(f"unknown pipeline engine {engine!r}; expected one of {ENGINES}")
    if pp < 1 or v < 1 or m < 1 or (v != 1 and engine != "interleaved_1f1b"):
        raise ValueError(f"invalid pipeline shape for {engine}: pp={pp}, v={v}, m={m}")
    if engine == "interleaved_1f1b" and not forward_only and m % pp:
        raise ValueError(f"interleaved 1F1B needs the micro-batches per step ({m}) to be a multiple "
                         f"of the pipeline size ({pp})")


def schedule(engine: str, pp: int, v: int, m: int, pp_rank: int, forward_only: bool = False) -> list[tuple]:
    """Every step pp rank `pp_rank` runs, in order (see the module docstring for the step kinds).
    Each received tensor comes in a batch before the op that needs it, each sent tensor leaves in
    a batch after the op that made it, sends come before receives within a batch, and a message
    exists only where its neighbouring virtual stage does. forward_only: evaluation, every
    micro-batch through every chunk, one message per batch. Raises ValueError on a bad shape."""
    _validate(engine, pp, v, m, forward_only)
    if forward_only:
        groups = [[("F", chunk, mb)] for mb in range(m) for chunk in range(v)]
        return _with_batches(groups, [False] * len(groups), pp, v, pp_rank)
    warmup, pairs, cooldown = _phases(engine, pp, v, m, pp_rank)
    if engine == "interleaved_1f1b":
        groups = [[op] for op in warmup] + [list(pair) for pair in pairs] + [[op] for op in cooldown]
        merged = [True] * len(groups)
    else:
        steady = [op for pair in pairs for op in pair]
        groups = [[op] for op in warmup + steady + cooldown]
        # merged[g]: one batch between groups g and g + 1, for 1F1B only inside its steady state
        merged = [len(warmup) <= g < len(warmup) + len(steady) - 1 for g in range(len(groups))]
    return _with_batches(groups, merged, pp, v, pp_rank)


def _with_batches(groups, merged, pp, v, pp_rank) -> list[tuple]:
    """The compute groups with their messages: the receives of a group's ops in a batch right
    before it, their sends right after it; where merged[g], the sends after group g and the
    receives before group g + 1 are one batch."""
    steps, sends = [], []
    for g, group in enumerate(groups):
        recvs = [msg for op in group if _exists(msg := ("recv", *op), pp, v, pp_rank)]
        batches = [sends + recvs] if g > 0 and merged[g - 1] else [sends, recvs]
        steps += [("P2P", tuple(batch)) for batch in batches if batch] + group
        sends = [msg for op in group if _exists(msg := ("send", *op), pp, v, pp_rank)]
    return steps + ([("P2P", tuple(sends))] if sends else [])


def _towards_next(msg) -> bool:
    """Activations go to the next virtual stage, gradients to the previous one."""
    verb, kind = msg[0], msg[1]
    return (verb == "send") == (kind == "F")


def _exists(msg, pp: int, v: int, pp_rank: int) -> bool:
    stage = msg[2] * pp + pp_rank   # chunk c of pp rank r is virtual stage c·pp + r
    return stage < pp * v - 1 if _towards_next(msg) else stage > 0


def peer(msg, pp: int, pp_rank: int) -> int:
    """The pp rank a message goes to or comes from: the next or the previous one round the ring
    (rank pp-1's chunk c talks to rank 0's chunk c+1)."""
    return (pp_rank + (1 if _towards_next(msg) else -1)) % pp


def _name(msg, pp: int, pp_rank: int) -> tuple[str, int, int]:
    """What a message carries, the same on both ends: (kind, receiving virtual stage, micro-batch)."""
    verb, kind, chunk, mb = msg
    stage = chunk * pp + pp_rank
    return kind, stage if verb == "recv" else stage + (1 if kind == "F" else -1), mb


def named_plan(engine: str, pp: int, v: int, m: int, forward_only: bool = False) -> list:
    """`plan` with a fourth item on each op naming its message, so that `check` also proves that
    every receive gets the tensor meant for it."""
    out = []
    for r in range(pp):
        batches = [step[1] for step in schedule(engine, pp, v, m, r, forward_only) if step[0] == "P2P"]
        out.append([[(msg[0], peer(msg, pp, r), 0, _name(msg, pp, r)) for msg in batch] for batch in batches])
    return out


def plan(engine: str, pp: int, v: int, m: int, forward_only: bool = False) -> list[list[list[tuple[str, int, int]]]]:
    """The batches each pp rank posts in one optimizer step of `engine` (afab, 1f1b with v = 1, or
    interleaved_1f1b) with m micro-batches, or in one evaluation pass (forward_only): per pp rank,
    per batch, ops ("send" | "recv", peer pp rank, nbytes), nbytes 0 (every message has the
    activation's shape, which the plan does not know). The engines post exactly this."""
    return [[[op[:3] for op in batch] for batch in batches] for batches in named_plan(engine, pp, v, m, forward_only)]


def _partners(plan) -> list:
    """For each op, (peer, the peer's batch holding the matching op). The k-th send from a to b
    matches the k-th receive at b from a; raises PlanError for an op without a valid partner."""
    channel = {}   # (sender, receiver, verb) -> [(batch index, message name)] in posting order
    for r, batches in enumerate(plan):
        for i, batch in enumerate(batches):
            for op in batch:
                if not 0 <= op[1] < len(plan) or op[1] == r:
                    raise PlanError(f"rank {r} batch {i}: {op[:2]} has no valid peer")
                ends = (r, op[1]) if op[0] == "send" else (op[1], r)
                channel.setdefault((*ends, op[0]), []).append((i, op[3:]))
    where, seen = [], Counter()
    for r, batches in enumerate(plan):
        where.append([])
        for i, batch in enumerate(batches):
            row = []
            for op in batch:
                verb, other = op[0], "recv" if op[0] == "send" else "send"
                ends = (r, op[1]) if verb == "send" else (op[1], r)
                k = seen[ends, verb]   # this op is the k-th of its kind on the channel
                seen[ends, verb] += 1
                partners = channel.get((*ends, other), [])
                if k >= len(partners):
                    raise PlanError(f"rank {r} batch {i}: {verb} #{k} on channel {ends[0]}->{ends[1]} has no "
                                    f"matching {other} (rank {op[1]} posts {len(partners)})")
                if partners[k][1] != op[3:]:
                    raise PlanError(f"rank {r} batch {i}: {verb} #{k} on channel {ends[0]}->{ends[1]} is "
                                    f"{op[3:]} but its partner is {partners[k][1]}")
                row.append((op[1], partners[k][0]))
            where[r].append(row)
    return where


def check(plan) -> int:
    """Replay `plan` (per rank, per batch, ops (verb, peer, nbytes[, message name])) under NCCL's
    rules: a rank posts its batches in order, the next only once the current one completed; a
    batch completes when every op's partner is posted (sends wait for the receive, receives for
    the send; a partner in an earlier, completed batch counts). Returns the number of batches.
    Raises PlanError on a deadlock, naming the first stuck rank, its batch and the op it waits on."""
    where = _partners(plan)
    done = [0] * len(plan)   # batches completed per rank; batch done[r] is the posted one
    progressed = True
    while progressed:
        progressed = False
        for r, batches in enumerate(plan):
            while done[r] < len(batches) and all(b <= done[p] for p, b in where[r][done[r]]):
                done[r] += 1
                progressed = True
    stuck = [r for r in range(len(plan)) if done[r] < len(plan[r])]
    if not stuck:
        return sum(len(batches) for batches in plan)
    r, i = stuck[0], done[stuck[0]]
    op, (p, b) = next((op, pb) for op, pb in zip(plan[r][i], where[r][i]) if pb[1] > done[pb[0]])
    raise PlanError(
        f"deadlock: rank {r} is stuck in batch {i} on {op[0]} {'to' if op[0] == 'send' else 'from'} rank {p}, "
        f"whose partner is in rank {p}'s batch {b}, but rank {p} is stuck in batch {done[p]} "
        f"(stuck: {', '.join(f'rank {s} in batch {done[s]}' for s in stuck)})")
