"""Reading a run's pipeline timeline (`logging.pipeline_trace=true`, recorded by nanoexp.instruments.trace):
the measured and the theoretical pipeline bubble, and when each gradient bucket's reduction started and was
waited for. scripts/plot_pipeline.py draws them; tests/test_pipeline_trace.py checks them."""
from __future__ import annotations

import json
import os

from nanoexp.instruments.trace import TRACE_DIR

COMPUTE = ("forward", "backward", "weight")   # the event kinds that are work (weight: W); the rest is waiting

def read_trace(run_dir: str) -> tuple[list[dict], list[dict]]:
    """All ranks' (metas, events) from a run folder; events get their rank's meta fields."""
    folder = os.path.join(run_dir, TRACE_DIR)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no {TRACE_DIR}/ in {run_dir}: train with logging.pipeline_trace=true")
    metas, events = [], []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".jsonl"):
            continue
        with open(os.path.join(folder, name)) as f:
            meta = json.loads(f.readline())["meta"]
            metas.append(meta)
            for line in f:
                events.append({**json.loads(line), "rank": meta["rank"], "pp_rank": meta["pp_rank"],
                               "dp_rank": meta["dp_rank"], "tp_rank": meta["tp_rank"]})
    return metas, events


def theoretical_bubble(pp: int, num_micro: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a flushed pipeline with equal stages and free communication:
    (p-1)/(m+p-1) for GPipe/1F1B and (p-1)/(v·m+p-1) for interleaved 1F1B with v chunks per
    rank (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", section 2.2: bubble time / ideal time = (p-1)/(v·m))."""
    return (pp - 1) / (virtual_stages * num_micro + pp - 1)


def measured_bubble(events: list[dict]) -> float:
    """Idle fraction of one step of one pipeline: 1 - (mean over its ranks of the time spent
    in forward/backward) / (first compute start to last compute end over all of them).
    Time spent communicating counts as idle, as in the theoretical figure."""
    compute = [e for e in events if e["kind"] in COMPUTE]
    span = max(e["end"] for e in compute) - min(e["start"] for e in compute)
    busy: dict[int, float] = {}
    for e in compute:
        busy[e["rank"]] = busy.get(e["rank"], 0.0) + e["end"] - e["start"]
    return 1.0 - sum(busy.values()) / len(busy) / span


def stage_times(events: list[dict], virtual_stages: int = 1) -> tuple[float, float, float]:
    """(T_F, T_B, T_W): the mean time of a whole stage's forward, backward (B alone where W is split off) and W for
    one micro-batch in these events (a chunk's time x virtual_stages)."""
    def mean(kind):
        spans = [e["end"] - e["start"] for e in events if e["kind"] == kind]
        return virtual_stages * sum(spans) / len(spans) if spans else 0.0
    return mean("forward"), mean("backward"), mean("weight")


def predicted_bubble(events: list[dict], engine: str, pp: int, virtual_stages: int, num_micro: int) -> dict:
    """The idle fraction that schedule `engine` predicts with the stage times measured in these events (one step
    of one pipeline): by its order alone ("dependencies") and as the engine runs it under NCCL's rules ("nccl"),
    communication free (nanoexp.verify.pipeline_bubble)."""
    from nanoexp.verify.pipeline_bubble import idle_by_dependencies, idle_under_nccl
    times = stage_times(events, virtual_stages)
    work = num_micro * sum(times)
    fraction = lambda idle: idle / (idle + work)  # noqa: E731
    return {"dependencies": fraction(idle_by_dependencies(engine, pp, virtual_stages, num_micro, *times)),
            "nccl": fraction(idle_under_nccl(engine, pp, virtual_stages, num_micro, *times))}


def bucket_overlap(events: list[dict]) -> list[dict]:
    """For one step of one rank: each gradient bucket all-reduce's launch time and wait, in
    seconds relative to the end of the rank's last backward (negative: launched while
    backward was still running, i.e. overlapped)."""
    last_backward_end = max(e["end"] for e in events if e["kind"] == "backward")
    waits = {(e.get("chunk"), e["bucket"]): e for e in events if e["kind"] == "allreduce_wait"}
    rows = []
    for e in events:
        if e["kind"] == "allreduce_launch":
            wait = waits.get((e.get("chunk"), e["bucket"]))
            rows.append({"chunk": e.get("chunk"), "bucket": e["bucket"], "in_backward": e["in_backward"],
                         "launch": e["start"] - last_backward_end,
                         "wait_start": None if wait is None else wait["start"] - last_backward_end,
                         "wait": None if wait is None else wait["end"] - wait["start"]})
    return rows
