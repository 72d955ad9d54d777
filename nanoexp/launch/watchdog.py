"""The stall watchdog: when no rank has progressed for `debug.stall_s`, every rank dumps its flight recorder into
`<run>/debug/fr/`, rank 0 diagnoses the dumps (nanoexp/observe/stall_diagnosis.py) and the run ends with a few
lines naming who waits where and who is missing — in seconds, where the collective timeout would take
`parallelism.collective_timeout_s` (600 s) to say only that a peer never came, and gloo never ends a collective
whose ranks posted different shapes.

Each rank's watchdog thread publishes its heartbeat (nanoexp/observe/heartbeat.py) in the process group's store
every poll; rank 0 reads them all and times the progress by its own clock (hosts' clocks may differ). When rank
0's watchdog itself falls silent (its Python cannot run: a call holding the interpreter lock), rank 1 takes its
place. A rank in a long phase (start-up, first step, checkpoint save) holds the alarm back. A dead peer is not a
stall: the collective fails at once and the launcher reports the lost contact as before.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import torch.distributed as dist

from nanoexp.launch.workers import end_worker
from nanoexp.observe.flight_recorder import PREFIX, read_dumps, read_trace, write_trace
from nanoexp.observe.heartbeat import HEARTBEAT
from nanoexp.observe.stall_diagnosis import diagnose
from nanoexp.observe.summary import record_failure

log = logging.getLogger("nanoexp")

AUTO_FLOOR_S, AUTO_FACTOR = 60.0, 10   # debug.stall_s=null: ten times the slowest step, at least a minute
DUMP_WAIT_S = 10.0                     # how long the analyst waits for the others' dumps before going without them
ANALYSTS = 2                           # rank 0 diagnoses; rank 1 when rank 0's watchdog is silent
SILENT_POLLS = 5                       # polls without a word from rank 0's watchdog that make it silent
KEY = "nanoexp/watchdog/"


def stall_limit(stall_s: float | None, slowest_step_s: float | None) -> float:
    """Seconds without progress on any rank that make a stall."""
    if stall_s:
        return float(stall_s)
    return max(AUTO_FLOOR_S, AUTO_FACTOR * (slowest_step_s or 0.0))


class StallWatchdog:
    """A context for the training loop of one rank (world size > 1, `debug.stall_s` not 0)."""

    def __init__(self, cfg, ctx, run_dir: str):
        self.stall_s, self.rank, self.world, self.ctx = cfg.debug.stall_s, ctx.rank, ctx.world_size, ctx
        self.debug_folder = os.path.join(run_dir, "debug")
        self.folder = os.path.join(self.debug_folder, "fr")   # torch's format, for torchfrtrace
        self.run_dir = run_dir
        self.poll_s = min(1.0, self.stall_s / 5) if self.stall_s else 1.0
        self.enabled = ctx.world_size > 1 and self.stall_s != 0
        self._stop, self._thread, self.limit = threading.Event(), None, None

    def __enter__(self) -> "StallWatchdog":
        if self.enabled:
            self.store, self.polls = dist.distributed_c10d._get_default_store(), 0
            self.publish()
            HEARTBEAT.on_phase_change = self.publish   # a silent rank's last word then has its phase right
            self._thread = threading.Thread(target=self._watch, name="nanoexp-stall-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        HEARTBEAT.on_phase_change = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.poll_s)

    def publish(self) -> None:
        """This rank's heartbeat, and the count of its watchdog's polls (which shows the watchdog itself is alive)."""
        self.store.set(f"{KEY}beat/{self.rank}", json.dumps({**HEARTBEAT.snapshot(), "polls": self.polls}))

    def _watch(self) -> None:
        progress: dict[int, tuple[int, float]] = {}   # rank -> (beat count, the analyst's clock when it changed)
        polls_of_rank_0 = (None, 0)   # rank 0's last published poll count, and for how many polls it stood
        try:
            while not self._stop.wait(self.poll_s):
                self.polls += 1
                self.publish()
                if self.store.check([f"{KEY}stall"]):   # the analyst saw a stall: dump, and let it end the run
                    self.dump()
                    return
                if self.rank == 1:
                    polls = json.loads(self.store.get(f"{KEY}beat/0"))["polls"]
                    polls_of_rank_0 = (polls, polls_of_rank_0[1] + 1 if polls == polls_of_rank_0[0] else 0)
                if self.rank == 0 or (self.rank < ANALYSTS and polls_of_rank_0[1] >= SILENT_POLLS):
                    quiet = self.quiet_seconds(progress)
                    if quiet is not None:
                        self.end_run(quiet)
        except Exception as error:  # noqa: BLE001 - the store went away (rank 0 ended): nothing left to watch
            if not self._stop.is_set():
                log.info("stall watchdog stopped: %s", error)

    def quiet_seconds(self, progress: dict) -> float | None:
        """The analyst: how long no rank has progressed, when that makes a stall; None otherwise."""
        keys = [f"{KEY}beat/{r}" for r in range(self.world)]
        if not self.store.check(keys):
            return None
        beats, now = [json.loads(value) for value in self.store.multi_get(keys)], time.monotonic()
        for rank, beat in enumerate(beats):
            if progress.get(rank, (None,))[0] != beat["count"]:
                progress[rank] = (beat["count"], now)
        if any(beat["phase"] for beat in beats):
            return None
        quiet = now - max(changed for _, changed in progress.values())
        self.limit = stall_limit(self.stall_s, max((b["slowest_step_s"] or 0.0 for b in beats), default=None))
        return quiet if quiet > self.limit else None

    def dump(self) -> str:
        trace = read_trace(self.ctx.backend, self.ctx.group_table, HEARTBEAT, self.rank)
        path = write_trace(self.debug_folder, self.rank, trace)
        self.store.set(f"{KEY}dumped/{self.rank}", path)
        return path

    def end_run(self, quiet: float) -> None:
        """The analyst: have every rank dump, diagnose, and end the run with the diagnosis."""
        started = time.monotonic()
        self.store.set(f"{KEY}stall", "1")
        self.dump()
        dumped = [f"{KEY}dumped/{r}" for r in range(self.world)]
        while time.monotonic() - started < DUMP_WAIT_S and not self.store.check(dumped):
            time.sleep(0.1)
        positions = {r: self.ctx.layout.position(r)[0] for r in range(self.world)}
        lines = diagnose(read_dumps(self.debug_folder), self.world, positions)
        analysis = self.run_torchfrtrace()
        setting = f"debug.stall_s={self.stall_s:g}" if self.stall_s else "debug.stall_s=null: automatic"
        quiet += time.monotonic() - started
        message = (f"stall: no rank progressed for {quiet:.0f} s (limit {self.limit:.0f} s, {setting}); what the ranks' flight recorders say, the likeliest cause first:\n"
                   + "\n".join(f"  - {line}" for line in lines)
                   + f"\n  dumps: {self.folder} (torch's own analysis: {analysis})")
        with open(os.path.join(self.debug_folder, "stall.txt"), "w") as f:
            f.write(message + "\n")
        record_failure(self.run_dir, RuntimeError(message))
        end_worker(message)

    def run_torchfrtrace(self) -> str:
        """torch's analyzer over the dumps, into debug/torchfrtrace.txt (best effort: it wants every rank's dump)."""
        output = os.path.join(self.debug_folder, "torchfrtrace.txt")
        command = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", self.folder, "-p", PREFIX,
                   "--allow-incomplete-ranks"]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=60)
            text = result.stdout + result.stderr
        except (OSError, subprocess.TimeoutExpired) as error:
            text = f"{' '.join(command)}: {error}"
        with open(output, "w") as f:
            f.write(text)
        return output
