"""The pipeline schedules' point-to-point communication, checked under NCCL's rules.

The tests run on gloo, whose sends are buffered. NCCL is stricter: between two ranks the point-to-point
operations of each direction run in order on one stream, tags are ignored (the k-th send from a to b meets the
k-th receive at b from a), and a large send completes only once the peer has posted the matching receive. An
order that gloo forgives can hang there.

`plan` reduces every rank's schedule (nanoexp.parallel.pipeline.schedules, which the engine executes as it is)
to what NCCL sees: per rank, per batch, ops (verb, peer rank, nbytes). `check` replays any such plan under
NCCL's rules and names the first stuck rank of a deadlock; it also checks plans written by hand, such as the
ring attention's (nanoexp.verify.context_parallel.ring_plan) or a user's own schedule. tests/test_p2p_plan.py
checks every engine for pp 2..8, v 1..4, m 1..16, shows that the interleaved engine's former order (one
message at a time) deadlocks, and compares what the engines actually post on gloo with `plan`, op for op.
"""
from __future__ import annotations

from collections import Counter

from nanoexp.parallel.pipeline.schedules import schedule, stage_map


class PlanError(RuntimeError):
    """A plan that cannot run under NCCL's rules: a deadlock, or an op without its partner."""


def _name(msg, stages, pp_rank: int) -> tuple[str, int, int]:
    """What a message carries, the same on both ends: (kind, receiving virtual stage, micro-batch)."""
    verb, kind, chunk, mb = msg
    receiver = (pp_rank, chunk) if verb == "recv" else stages.other_end(msg, pp_rank)
    return kind, stages.stage(receiver[1], receiver[0]), mb


def named_plan(engine: str, pp: int, v: int, m: int, forward_only: bool = False) -> list:
    """`plan` with a fourth item on each op naming its message, so that `check` also proves that
    every receive gets the tensor meant for it."""
    out = []
    for r in range(pp):
        batches = [step[1] for step in schedule(engine, pp, v, m, r, forward_only) if step[0] == "P2P"]
        stages = stage_map(engine, pp, v)
        out.append([[(msg[0], stages.peer(msg, r), 0, _name(msg, stages, r)) for msg in batch] for batch in batches])
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
