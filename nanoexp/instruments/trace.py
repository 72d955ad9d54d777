"""Pipeline timeline recorder: when each forward, backward, send, receive and gradient all-reduce of a training
step started and ended, on this rank. With `logging.pipeline_trace=true` every rank writes
`<run>/pipeline_trace/rank_<r>.jsonl`: a first line `{"meta": {...}}` (rank, pp/dp/cp/tp coordinates, pp, virtual
stages, engine), then one JSON object per event:

    {"step": 3, "kind": "forward", "mb": 5, "chunk": 1, "start": 1712.123, "end": 1712.130}

`kind` is forward | backward | weight (compute, per micro-batch and chunk), a communication label such as "post
send_forward recv_backward" (posting one batch of point-to-point messages), "wait recv_forward" (waiting for a
received tensor, with its mb and chunk) or "wait sends" (the step's last sends, at its end), "allreduce_launch" (an
instant: start == end, when a gradient bucket's dp x cp reduction was started, with "bucket" and "in_backward") or
"allreduce_wait" (the time spent waiting for that reduction). Times are wall-clock seconds (`time.time()`), so
ranks on one machine share a time axis. `scripts/plot_pipeline.py RUN` draws these files;
nanoexp.verify.trace_analysis reads them. When tracing is off the runtime uses `NO_TRACE`, whose methods do nothing.
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

    def __init__(self, path: str, meta: dict, fields: dict | None = None, _shared=None):
        self.path, self.fields = path, dict(fields or {})
        # State shared by bound views: the open file, the pending events, the step number.
        self._shared = _shared if _shared is not None else {"events": [], "step": 1, "file": None, "meta": meta}

    @classmethod
    def for_run(cls, run_dir: str, ctx) -> "PipelineTrace":
        layout = ctx.layout
        meta = {"rank": ctx.rank, "pp_rank": ctx.pp_rank, "dp_rank": ctx.dp_rank, "cp_rank": ctx.cp_rank,
                "tp_rank": ctx.tp_rank, "pp": layout.pp, "dp": layout.dp, "cp": layout.cp, "tp": layout.tp,
                "virtual_stages": layout.virtual_stages, "engine": layout.schedule}
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
