"""Pipeline timeline recorder: when each forward, backward, send, receive and gradient
all-reduce of a training step started and ended, on this rank.

With `logging.pipeline_trace=true` every rank writes `<run>/pipeline_trace/rank_<r>.jsonl`:
a first line `{"meta": {...}}` (rank, pp/dp/cp/tp coordinates, pp, virtual stages, engine),
then one JSON object per event:

    {"step": 3, "kind": "forward", "mb": 5, "chunk": 1, "start": 1712.123, "end": 1712.130}

`kind` is forward | backward (compute, per micro-batch and chunk), a communication label
such as "recv_forward" or "send_forward recv_backward" (blocking point-to-point, "wait_sends"
for the interleaved engine's pending sends), "allreduce_launch" (an instant: start == end,
when a data-parallel gradient bucket's all-reduce was started, with "bucket" and
"in_backward") or "allreduce_wait" (the time spent waiting for that all-reduce). Times are
wall-clock seconds (`time.time()`), so ranks on one machine share a time axis.
`scripts/plot_pipeline.py RUN` draws these files.

When tracing is off the trainer uses `NO_TRACE`, whose methods do nothing.
"""
from __future__ import annotations

import contextlib
import json
import os
import time

TRACE_DIR = "pipeline_trace"


class PipelineTrace:
    """Collects one rank's events of the current step; `end_step()` appends them to the file.

    Promises: every event carries the step number (1 for the first `end_step()` period) and
    any fields given to `bind()`; events are written in the order they ended; nothing is
    written before `end_step()` or `close()`.
    """

    enabled = True

    def __init__(self, path: str, meta: dict, fields: dict | None = None, _shared=None):
        self.path, self.fields = path, dict(fields or {})
        # State shared by bound views: the open file, the pending events, the step number.
        self._shared = _shared if _shared is not None else {"events": [], "step": 1, "file": None, "meta": meta}

    @classmethod
    def for_run(cls, run_dir: str, ctx, engine: str, virtual_stages: int) -> "PipelineTrace":
        meta = {"rank": ctx.rank, "pp_rank": ctx.pp_rank, "dp_rank": ctx.dp_rank, "cp_rank": ctx.cp_rank,
                "tp_rank": ctx.tp_rank, "pp": ctx.pp, "dp": ctx.dp, "cp": ctx.cp, "tp": ctx.tp,
                "virtual_stages": virtual_stages, "engine": engine}
        return cls(os.path.join(run_dir, TRACE_DIR, f"rank_{ctx.rank}.jsonl"), meta)

    def bind(self, **fields) -> "PipelineTrace":
        """A view of the same trace that adds `fields` (e.g. chunk=1) to each of its events."""
        return PipelineTrace(self.path, self._shared["meta"], {**self.fields, **fields}, self._shared)

    @contextlib.contextmanager
    def span(self, kind: str, **fields):
        """Record the wall-clock interval of the `with` body as one event."""
        start = time.time()
        try:
            yield
        finally:
            self._add(kind, start, time.time(), fields)

    def mark(self, kind: str, **fields) -> None:
        """Record an instant (start == end)."""
        now = time.time()
        self._add(kind, now, now, fields)

    def _add(self, kind, start, end, fields):
        self._shared["events"].append({"step": self._shared["step"], "kind": kind, **self.fields, **fields,
                                       "start": start, "end": end})

    def end_step(self) -> None:
        """Write this step's events and start numbering the next step."""
        shared = self._shared
        if shared["file"] is None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            shared["file"] = open(self.path, "w")
            shared["file"].write(json.dumps({"meta": shared["meta"]}) + "\n")
        for event in shared["events"]:
            shared["file"].write(json.dumps(event) + "\n")
        shared["file"].flush()
        shared["events"].clear()
        shared["step"] += 1

    def close(self) -> None:
        if self._shared["events"]:
            self.end_step()
        if self._shared["file"] is not None:
            self._shared["file"].close()
            self._shared["file"] = None


class _NoTrace:
    """The recorder used when tracing is off: every method is a no-op."""

    enabled = False
    _null = contextlib.nullcontext()

    def bind(self, **fields):
        return self

    def span(self, kind, **fields):
        return self._null

    def mark(self, kind, **fields):
        return None

    def end_step(self):
        return None

    def close(self):
        return None


NO_TRACE = _NoTrace()


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


# -- reading the timeline ----------------------------------------------------------------------
COMPUTE = ("forward", "backward")


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
