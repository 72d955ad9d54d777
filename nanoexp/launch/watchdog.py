"""The stall watchdog: when no rank has progressed for `debug.stall_s`, every rank dumps its flight recorder into
`<run>/debug/fr/`, rank 0 diagnoses the dumps (nanoexp/instruments/stall_diagnosis.py) and the run ends with a few
lines naming who waits where and who is missing — in seconds, where the collective timeout would take
`parallelism.collective_timeout_s` (600 s) to say only that a peer never came, and gloo never ends a collective
whose ranks posted different shapes.

Each rank's watchdog thread publishes its heartbeat (nanoexp/instruments/heartbeat.py) in the process group's store
every poll; rank 0 reads them all and times the progress by its own clock (hosts' clocks may differ). When rank
0's watchdog itself falls silent (its Python cannot run: a call holding the interpreter lock), rank 1 takes its
place. A rank in a long phase (start-up, first step, checkpoint save) holds the alarm back. A dead peer is not a
stall: the collective fails at once and the launcher reports the lost contact as before. The store lives in rank
0's process, so each poll's store calls are bounded (`bounded`): a poll unanswered for STORE_SILENT_S is itself the
sign that rank 0 is stopped, and rank 1 then diagnoses from its own dump once it has made no progress for the
limit.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Callable

import torch.distributed as dist

from nanoexp.launch.workers import end_worker
from nanoexp.runtime.seams import mark_phases
from nanoexp.instruments.flight_recorder import read_dumps, read_trace, torch_analysis, write_trace
from nanoexp.instruments.heartbeat import HEARTBEAT
from nanoexp.instruments.stall_diagnosis import diagnose
from nanoexp.observe.summary import record_failure

log = logging.getLogger("nanoexp")

AUTO_FLOOR_S, AUTO_FACTOR = 60.0, 10   # debug.stall_s=null: ten times the slowest step, at least a minute
DUMP_WAIT_S = 10.0                     # how long the analyst waits for the others' dumps before going without them
ANALYSTS = 2                           # rank 0 diagnoses; rank 1 when rank 0's watchdog is silent
SILENT_POLLS = 5                       # polls without a word from rank 0's watchdog that make it silent
STORE_SILENT_S = 10.0                  # a store call unanswered this long: rank 0 is stopped (a live one answers in ms)
KEY = "nanoexp/watchdog/"


class StoreSilent(Exception):
    """A store call did not return within its bound."""


def bounded(call: Callable, timeout_s: float):
    """call()'s result, or StoreSilent when it has not returned within timeout_s. It runs in a thread of its own,
    left behind when it never returns; a second, short wait gives it a chance should this process itself have
    been stopped meanwhile. Why bounded: the store lives in rank 0's process under every launcher (env:// makes
    rank 0 its server; under torchrun it is the round's own store, which rank 0 starts), so a stopped rank 0
    (SIGSTOP, a debugger, a frozen host) silences it, and a TCPStore call to a stopped server never returns (torch
    2.13: after its own timeout it waits, unbounded, for the server to acknowledge). Moving the store out of rank 0
    would need a process of its own under every launcher (plain SLURM tasks have none to spare) and lose
    torchrun's fresh store per round."""
    outcome = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            outcome["error"] = error

    thread = threading.Thread(target=run, name="nanoexp-store-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        thread.join(1.0)
    if thread.is_alive():
        raise StoreSilent(f"the store did not answer for {timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


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
        HEARTBEAT.reset()   # a new run (tests run several in one process): in start-up, a long phase until step 1
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

    def watch(self, trainer) -> None:
        """Mark the trainer's phases in the heartbeat when the watchdog is on (nothing is wrapped when it is off)."""
        if self.enabled:
            mark_phases(trainer)

    def publish(self) -> None:
        """This rank's heartbeat, and the count of its watchdog's polls (which shows the watchdog itself is alive)."""
        self.store.set(f"{KEY}beat/{self.rank}", json.dumps({**HEARTBEAT.snapshot(), "polls": self.polls}))

    def _watch(self) -> None:
        self.progress: dict[int, tuple[int, float]] = {}   # rank -> (beat count, the analyst's clock when it changed)
        self.rank_0_polls = (None, 0)   # rank 0's last published poll count, and for how many polls it stood
        try:
            while not self._stop.wait(self.poll_s):
                self.polls += 1
                try:
                    seen = bounded(self.poll, STORE_SILENT_S)
                except StoreSilent:
                    return self.without_store()
                if seen == "stall":   # the analyst saw a stall: dump, and let it end the run
                    return self.dump()
                if seen is not None:
                    self.end_run(seen)
        except Exception as error:  # noqa: BLE001 - the store went away (rank 0 ended): nothing left to watch
            if not self._stop.is_set():
                log.info("stall watchdog stopped: %s", error)

    def poll(self) -> str | float | None:
        """One poll's store calls: "stall" when the analyst declared one; the analyst's quiet seconds when they make a
        stall; None otherwise."""
        self.publish()
        if self.store.check([f"{KEY}stall"]):
            return "stall"
        if self.rank == 1 and self.store.check([f"{KEY}beat/0"]):   # a get would wait for rank 0's first word
            polls = json.loads(self.store.get(f"{KEY}beat/0"))["polls"]
            self.rank_0_polls = (polls, self.rank_0_polls[1] + 1 if polls == self.rank_0_polls[0] else 0)
        if self.rank == 0 or (self.rank < ANALYSTS and self.rank_0_polls[1] >= SILENT_POLLS):
            return self.quiet_seconds(self.progress)
        return None

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

    def setting(self) -> str:
        return f"debug.stall_s={self.stall_s:g}" if self.stall_s else "debug.stall_s=null: automatic"

    def dump(self) -> None:
        trace = read_trace(self.ctx.backend, self.ctx.group_table, HEARTBEAT, self.rank)
        self.store.set(f"{KEY}dumped/{self.rank}", write_trace(self.debug_folder, self.rank, trace))

    def end_run(self, quiet: float) -> None:
        """The analyst: have every rank dump, diagnose, and end the run with the diagnosis."""
        started = time.monotonic()
        self.store.set(f"{KEY}stall", "1")
        self.dump()
        dumped = [f"{KEY}dumped/{r}" for r in range(self.world)]
        while time.monotonic() - started < DUMP_WAIT_S and not self.store.check(dumped):
            time.sleep(0.1)
        fresh = [r for r in range(self.world) if self.store.check([dumped[r]])]   # this stall's dumps, no others
        quiet += time.monotonic() - started
        self.report(f"stall: no rank progressed for {quiet:.0f} s (limit {self.limit:.0f} s, {self.setting()}); what "
                    "the ranks' flight recorders say, the likeliest cause first:", fresh)

    def without_store(self) -> None:
        """The store did not answer: rank 0 is frozen (stopped, or its host cut off). Rank 1 ends the run once it has
        itself made no progress for the limit, from its own dump (the others cannot be asked: the store is how they
        are asked); the other ranks' watchdogs stop (their store calls would never return)."""
        silent_since = time.monotonic() - STORE_SILENT_S
        if self.rank != 1:
            log.warning("stall watchdog: the store (rank 0's) has not answered for %g s; rank 1 diagnoses",
                        STORE_SILENT_S)
            return
        while not self._stop.wait(self.poll_s):
            quiet = HEARTBEAT.snapshot()["since_s"]
            self.limit = stall_limit(self.stall_s, HEARTBEAT.slowest_step_s)
            if quiet > self.limit:
                trace = read_trace(self.ctx.backend, self.ctx.group_table, HEARTBEAT, self.rank)
                write_trace(self.debug_folder, self.rank, trace)
                silent = time.monotonic() - silent_since
                return self.report(
                    f"stall: rank 0 is frozen: the store it hosts has not answered rank 1 for {silent:.0f} s, and "
                    f"rank 1 has not progressed for {quiet:.0f} s (limit {self.limit:.0f} s, {self.setting()}); what "
                    "rank 1's flight recorder says:", [self.rank], unasked=frozenset(range(2, self.world)))

    def report(self, headline: str, dumped: list[int], unasked: frozenset[int] = frozenset()) -> None:
        """Diagnose this stall's dumps (of the ranks in `dumped`), and end the run with the diagnosis."""
        dumps = read_dumps(self.debug_folder, dumped)
        positions = {r: self.ctx.layout.position(r)[0] for r in range(self.world)}
        lines = diagnose(dumps, self.world, positions, unasked)
        if unasked:
            plural = "s" if len(unasked) > 1 else ""
            lines.append(f"not asked for a dump (the store is how they are asked): rank{plural} "
                         + ", ".join(map(str, sorted(unasked))))
        analysis = torch_analysis(dumps, os.path.join(self.debug_folder, "torchfrtrace.txt"))
        message = (headline + "\n" + "\n".join(f"  - {line}" for line in lines)
                   + f"\n  dumps: {self.folder} (torch's own analysis: {analysis})")
        with open(os.path.join(self.debug_folder, "stall.txt"), "w") as f:
            f.write(message + "\n")
        record_failure(self.run_dir, RuntimeError(message))
        end_worker(message)
