"""A schedule's idle time, simulated from compute times alone (communication free): what the measured bubble of
a run (trace_analysis.measured_bubble) is compared with. Times are those of a whole stage's F, B and W for one
micro-batch (a chunk of v takes 1/v of them); a schedule without W steps runs B + W as its backward.

- `idle_by_dependencies`: each op starts once its rank is free and its input is made, as if messages never
  waited: the schedule's order alone.
- `idle_under_nccl`: as the engine runs it (pipeline/mailbox.py) under NCCL's rules: a rank posts each batch
  without waiting; its batches run in order on one stream, each starting once posted and the one before it done,
  and done once the partner of each of its messages has started (a send waits for its receive); an op waits
  for the batch that brought its input.
"""
from __future__ import annotations

from nanoexp.parallel.pipeline.schedules import SCHEDULES, compute_order, schedule, stage_map
from nanoexp.verify.p2p_plan import named_plan


def _op_times(engine: str, t_forward: float, t_backward: float, t_weight: float) -> dict:
    split = SCHEDULES[engine].splits_backward
    return {"F": t_forward, "B": t_backward if split else t_backward + t_weight, "W": t_weight}


def idle_by_dependencies(engine: str, pp: int, v: int, m: int, t_forward: float, t_backward: float,
                         t_weight: float = 0.0) -> float:
    """A step's makespan minus one rank's work when only data dependencies make an op wait."""
    times, stages, last = _op_times(engine, t_forward, t_backward, t_weight), stage_map(engine, pp, v), pp * v - 1
    orders = [compute_order(engine, pp, v, m, r) for r in range(pp)]
    done, position, clock = {}, [0] * pp, [0.0] * pp
    while position != [len(order) for order in orders]:
        moved = False
        for r in range(pp):
            while position[r] < len(orders[r]):
                kind, chunk, mb = orders[r][position[r]]
                s = stages.stage(chunk, r)
                needs = {"F": ("F", s - 1, mb) if s else None, "W": ("B", s, mb),
                         "B": ("B", s + 1, mb) if s < last else ("F", s, mb)}[kind]
                if needs is not None and needs not in done:
                    break
                clock[r] = max(clock[r], done.get(needs, 0.0)) + times[kind] / v
                done[kind, s, mb], position[r], moved = clock[r], position[r] + 1, True
        if not moved:
            raise ValueError(f"{engine}'s order deadlocks on its own dependencies (pp={pp}, v={v}, m={m})")
    return max(clock) - m * (t_forward + t_backward + t_weight)


def idle_under_nccl(engine: str, pp: int, v: int, m: int, t_forward: float, t_backward: float,
                    t_weight: float = 0.0) -> float:
    """A step's makespan minus one rank's work as the engine posts and waits under NCCL's rules."""
    times = _op_times(engine, t_forward, t_backward, t_weight)
    steps = [schedule(engine, pp, v, m, r) for r in range(pp)]
    batches = named_plan(engine, pp, v, m)   # the same batches, each op carrying its message's name
    position, batch, host, stream, started = [0] * pp, [0] * pp, [0.0] * pp, [0.0] * pp, {}
    arrival = [{} for _ in range(pp)]   # per rank: op -> when the batch bringing its input was done
    progressed = True
    while progressed:
        progressed = False
        for r in range(pp):
            while position[r] < len(steps[r]):
                step = steps[r][position[r]]
                if step[0] == "P2P":
                    ops, start = batches[r][batch[r]], max(host[r], stream[r])
                    for op in ops:
                        started.setdefault((op[0], op[3]), start)
                    partners = [("recv" if op[0] == "send" else "send", op[3]) for op in ops]
                    if not all(p in started for p in partners):
                        break
                    stream[r] = max([start] + [started[p] for p in partners])
                    arrival[r].update({msg[1:]: stream[r] for msg in step[1] if msg[0] == "recv"})
                    batch[r] += 1
                elif step[0] != "LOCAL":   # a LOCAL hand-over (zbv) takes no time
                    host[r] = max(host[r], arrival[r].get(step, 0.0)) + times[step[0]] / v
                position[r] += 1
                progressed = True
    if position != [len(s) for s in steps]:
        raise ValueError(f"{engine} deadlocks under NCCL's rules (pp={pp}, v={v}, m={m})")
    return max(host + stream) - m * (t_forward + t_backward + t_weight)
