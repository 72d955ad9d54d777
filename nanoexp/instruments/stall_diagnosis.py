"""From the ranks' flight-recorder dumps (flight_recorder.py) to a few lines: who waits where, who is missing or
posted something else, at which step and action — the most likely cause first.

Each rank is in one of three states: waiting in a collective (a recorded, unfinished collective), waiting for a
pipeline message (its heartbeat says from whom: gloo's recorder does not record point-to-point messages), or in
its own work (neither). Per group with an unfinished collective, the lowest unfinished sequence number is where
the group stopped: ranks that posted it wait, ranks whose last number on that group is lower are missing, and
ranks that posted it with another op, shape or dtype disagree. Causes are ranked:
1. ranks that disagree on a collective;
2. a missing rank in its own work (it is stuck in compute, or took another branch with no collective after), or
   one that wrote no dump (its Python cannot run);
3. a pipeline sender that moved on to a collective its receiver has not reached (it sent too few messages);
4. two ranks of one pipeline stage each waiting where the other has not arrived (the one ahead skipped it);
5. any other wait.
"""
from __future__ import annotations

import ast
import os
from dataclasses import dataclass


@dataclass
class Finding:
    priority: int   # 1..5, as in the module's list
    text: str


def _signature(entry: dict) -> tuple:
    return entry["profiling_name"], str(entry["input_sizes"]), str(entry["input_dtypes"])


def _op(entry: dict) -> str:
    return entry["profiling_name"].split(":")[-1]


class Ranks:
    """The dumps read as per-rank states (`dumps`: rank -> trace with nanoexp's additions)."""

    def __init__(self, dumps: dict[int, dict], pp_rank_of: dict[int, int], unasked: frozenset[int] = frozenset()):
        self.dumps, self.pp_rank_of, self.unasked = dumps, pp_rank_of, unasked   # unasked: no dump, nothing known
        self.groups: dict[str, tuple[str, list[int]]] = {}
        for trace in dumps.values():
            for name, config in trace.get("pg_config", {}).items():
                ranks = ast.literal_eval(config.get("ranks") or "[]")
                if ranks:
                    self.groups[name] = (config.get("desc") or name, list(ranks))
        self.collectives = {r: [e for e in t.get("entries", []) if not e.get("is_p2p")] for r, t in dumps.items()}

    def heartbeat(self, rank: int) -> dict:
        return self.dumps[rank]["nanoexp"]["heartbeat"]

    def place(self, rank: int, entry: dict) -> str:
        """The step and action that posted `entry`, and the first line of the call outside torch."""
        step_where = self.dumps[rank]["nanoexp"]["places"].get(str(entry["record_id"]))   # JSON keys are text
        place = f"step {step_where[0]}, {step_where[1]}" if step_where else "before the kept history"
        caller = next((f for f in entry.get("frames", []) if f"{os.sep}torch{os.sep}" not in f["filename"]), None)
        return place + (f", {os.path.basename(caller['filename'])}:{caller['line']} {caller['name']}" if caller else "")

    def pending(self, rank: int) -> list[dict]:
        return [e for e in self.collectives[rank] if not e.get("retired") and e.get("state") != "completed"]

    def group_of(self, entry: dict) -> str:
        return entry["process_group"][0]

    def describe_group(self, name: str) -> str:
        description, ranks = self.groups.get(name, (name, []))
        return f"the {description} (ranks {', '.join(map(str, ranks))})" if ranks else f"group {name!r}"

    def last_seq(self, rank: int, group: str) -> int:
        return max((e["collective_seq_id"] for e in self.collectives[rank] if self.group_of(e) == group), default=0)

    def position(self, rank: int) -> tuple[int, int]:
        """How far rank is: its step, and its beats (within one stage's program: comparable across its ranks)."""
        beat = self.heartbeat(rank)
        return beat["step"], beat["count"]

    def state(self, rank: int) -> str:
        """What `rank` is doing, as the end of a sentence."""
        if rank in self.unasked:
            return "was not asked for a dump"
        if rank not in self.dumps:
            return "wrote no dump (it died, or is stuck where Python cannot run)"
        beat, pending = self.heartbeat(rank), self.pending(rank)
        if beat.get("waiting_on") is not None:
            return f"waits for the {beat['where']} from rank {beat['waiting_on']} (step {beat['step']})"
        if pending:
            first = min(pending, key=lambda e: e["time_created_ns"])
            group = self.describe_group(self.group_of(first))
            return f"waits in {_op(first)} #{first['collective_seq_id']} of {group} ({self.place(rank, first)})"
        return (f"is in its own work, no collective pending: step {beat['step']}, {beat['where']}, "
                f"for {beat['since_s']:.0f} s")

    def in_own_work(self, rank: int) -> bool:
        return rank in self.dumps and self.heartbeat(rank).get("waiting_on") is None and not self.pending(rank)


def collective_findings(ranks: Ranks) -> list[Finding]:
    """Per group with an unfinished collective: who disagrees on it, or who has not posted it."""
    findings = []
    for group in sorted({ranks.group_of(e) for r in ranks.dumps for e in ranks.pending(r)}):
        members = ranks.groups.get(group, ("", sorted(ranks.dumps)))[1]
        seq = min(e["collective_seq_id"] for r in ranks.dumps for e in ranks.pending(r) if ranks.group_of(e) == group)
        posted = {r: e for r in members if r in ranks.dumps for e in ranks.collectives[r]
                  if ranks.group_of(e) == group and e["collective_seq_id"] == seq}
        if posted:
            findings += disagreement(ranks, group, seq, posted) or missing_ranks(ranks, group, seq, posted, members)
    return findings


def disagreement(ranks: Ranks, group: str, seq: int, posted: dict) -> list[Finding]:
    signatures = {}
    for rank, entry in posted.items():
        signatures.setdefault(_signature(entry), []).append(rank)
    if len(signatures) == 1:
        return []
    told = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} posted {_op(posted[rs[0]])} "
                     f"of sizes {sig[1]} ({sig[2]})" for sig, rs in signatures.items())
    when = ranks.place(*next(iter(posted.items())))
    return [Finding(1, f"ranks disagree on collective #{seq} of {ranks.describe_group(group)} ({when}): {told}")]


def missing_ranks(ranks: Ranks, group: str, seq: int, posted: dict, members: list[int]) -> list[Finding]:
    findings, waiting = [], sorted(posted)
    op, when = _op(next(iter(posted.values()))), ranks.place(*next(iter(posted.items())))
    plural = len(waiting) > 1
    waiters = f"rank{'s' if plural else ''} {', '.join(map(str, waiting))} wait{'' if plural else 's'}"
    behind = [r for r in members if r not in posted and r not in ranks.unasked
              and (r not in ranks.dumps or ranks.last_seq(r, group) < seq)]
    for missing in behind:
        priority = 2 if ranks.in_own_work(missing) or missing not in ranks.dumps else 5
        same_program = missing in ranks.dumps and {ranks.pp_rank_of[w] for w in waiting} == {ranks.pp_rank_of[missing]}
        if priority == 5 and same_program and all(ranks.position(missing) > ranks.position(w) for w in waiting):
            priority = 4   # the same program, further along: it skipped this one
        went_on = " went on without it: it" if priority == 4 else ""
        where = ranks.describe_group(group)
        findings.append(Finding(priority, f"rank {missing} has not posted {op} #{seq} of {where}, in which {waiters} "
                                          f"({when}); rank {missing}{went_on} {ranks.state(missing)}"))
    return findings


def pipeline_findings(ranks: Ranks) -> list[Finding]:
    findings = []
    for rank in sorted(ranks.dumps):
        beat = ranks.heartbeat(rank)
        sender = beat.get("waiting_on")
        if sender is None:
            continue
        order = 2 if ranks.in_own_work(sender) or sender not in ranks.dumps else 5
        if sender in ranks.dumps and any(rank in ranks.groups.get(ranks.group_of(e), ("", []))[1]
                                         and ranks.last_seq(rank, ranks.group_of(e)) < e["collective_seq_id"]
                                         for e in ranks.pending(sender)):
            order = 3   # the sender went on to a collective the receiver has not reached: it sent too few
        went_on = " went on without sending it: it" if order == 3 else ""
        findings.append(Finding(order, f"rank {rank} waits for the {beat['where']} from rank {sender} at step "
                                       f"{beat['step']}; rank {sender}{went_on} {ranks.state(sender)}"))
    return findings


def diagnose(dumps: dict[int, dict], world_size: int, pp_rank_of: dict[int, int],
             unasked: frozenset[int] = frozenset()) -> list[str]:
    """The findings, most likely cause first; ranks without a dump are named. `unasked`: ranks that could not be
    asked to dump (the store was silent): nothing is said of them."""
    ranks = Ranks(dumps, pp_rank_of, unasked)
    findings = sorted(collective_findings(ranks) + pipeline_findings(ranks), key=lambda f: f.priority)
    lines = [f.text for f in findings]
    if not lines:
        lines = ["no rank waits in a collective or for a message: every rank is in its own work (" + "; ".join(
            f"rank {r} {ranks.state(r)}" for r in sorted(dumps)) + "); if the run is just slow, raise debug.stall_s"]
    silent = [r for r in range(world_size) if r not in dumps and r not in unasked]
    if silent:
        lines.append(f"no dump from rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))}: "
                     "dead, or stuck where Python cannot run")
    return lines
