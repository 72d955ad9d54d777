"""What this process is doing, for the stall watchdog (nanoexp/launch/watchdog.py).

`HEARTBEAT.at(...)` is called where work begins: by the trainer's phases (a step, the loss all-reduce, the
optimizer; wrapped from outside while the watchdog is on: nanoexp/runtime/seams.py) and by the pipeline engine (each
schedule action). Each call counts one beat; the watchdog publishes the count, and a count that
stops moving on every rank is a stall. The last thousand beats are kept with their wall-clock times, so that
a collective in a flight-recorder dump (which carries its own creation time) can be attributed to the step and
action that posted it. Work that may legitimately run long without beats — start-up (building the model,
loading a checkpoint), the first step (warm-up, compile) and a checkpoint save (disk) — is a long phase: no
stall is declared while any rank is in one.

One per process, as logging is: the model and the engine report here without knowing a watchdog exists.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from contextlib import contextmanager


class Heartbeat:
    def __init__(self, history: int = 1024):
        self.count, self.step, self.where, self.phase = 0, 0, "start-up", "start-up"   # a long phase until step 1
        self.waiting_on = None   # the global rank whose message this process waits for (a pipeline receive)
        self.slowest_step_s = None   # of the steps after the first (which warms up)
        self.on_phase_change = None  # called as a long phase begins and ends (the watchdog publishes then)
        self.wall_ns = time.time_ns()
        self._beats: deque[tuple[int, int, str]] = deque(maxlen=history)   # (wall-clock ns, step, where)

    def at(self, where: str, step: int | None = None, waiting_on: int | None = None) -> None:
        """A beat: this process starts `where` (of optimizer step `step`, or of the current one); `waiting_on`:
        it waits there for a message from that global rank."""
        if step is not None:
            self.step = step
        self.where, self.waiting_on, self.wall_ns = where, waiting_on, time.time_ns()
        self._beats.append((self.wall_ns, self.step, where))
        self.count += 1

    @contextmanager
    def long_phase(self, name: str):
        """Work that may run long without beats; the watchdog waits for it (the collective timeout still holds)."""
        self.phase = name
        self.at(name)
        self._phase_changed()
        try:
            yield
        finally:
            self.phase = None
            self.at(f"after {name}")
            self._phase_changed()

    def _phase_changed(self) -> None:
        if self.on_phase_change is not None:
            self.on_phase_change()

    def step_took(self, seconds: float) -> None:
        self.slowest_step_s = max(seconds, self.slowest_step_s or 0.0)

    def place_at(self, wall_ns: int) -> tuple[int, str] | None:
        """(step, where) of the last beat at or before `wall_ns`; None if it is older than the kept beats."""
        beats = list(self._beats)   # a copy: the loop may beat meanwhile
        index = bisect.bisect_right([beat[0] for beat in beats], wall_ns) - 1
        return beats[index][1:] if index >= 0 else None

    def snapshot(self) -> dict:
        return {"count": self.count, "step": self.step, "where": self.where, "phase": self.phase,
                "waiting_on": self.waiting_on, "slowest_step_s": self.slowest_step_s,
                "since_s": (time.time_ns() - self.wall_ns) / 1e9}

    def reset(self) -> None:
        """A new run in this process (tests run several): forget the last one's beats (not who listens)."""
        listener = self.on_phase_change
        self.__init__(self._beats.maxlen)
        self.on_phase_change = listener


HEARTBEAT = Heartbeat()
