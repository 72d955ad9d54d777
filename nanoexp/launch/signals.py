"""Stop signals: SIGTERM, SIGUSR2 or SIGINT (Ctrl-C). Before the first step a run ends at once (nothing trained,
nothing to save: exit 128 + the signal's number, one line); once training, every rank finishes its step, checkpoints
and exits cleanly.
Each process is in one phase: "starting" (a stop signal raises `StopBeforeTraining` where the process is, so a run's
start-up must leave the interpreter often: no long C call), "delegated" (a launcher whose local workers run: it
forwards the signal to them and waits), "training" (the signal is recorded; the trainer's read_scalars agrees on it
in each step, one all-reduce, so all stop after the same step) and "stopping" (a second signal changes nothing).
`handle_stop_signals()` wraps a run in the process that starts it; train.py installs the same handler first thing
(`stop_during_start_up()`), so a signal during its imports ends it too. The launcher blocks the signals while it
starts workers (`workers_starting()`; the mask survives fork and spawn), and each worker installs the handler first
thing (`worker_handles_stop_signals()`) before letting held-back signals in. A worker stopped before training exits
with 128 + the signal's number, which its launcher reports as the run's stop. Once a checkpoint is written, the
handler installed before ours gets the signal (submitit's SIGUSR2 handler requeues the job); Python's
KeyboardInterrupt is not chained. See docs/robustness.md. Only the standard library is imported at the top: train.py
imports this module before anything slow."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)
_state: dict = {"signum": None, "owner_pid": None, "phase": "starting"}


class StopBeforeTraining(BaseException):
    """A stop signal before the run trained a step: the run ends now (a BaseException, like KeyboardInterrupt, so
    that no `except Exception` on the way keeps it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        return (f"stopped by {signal.Signals(self.signum).name} before the first step: nothing was trained, no "
                "checkpoint written")


def _on_signal(signum, frame) -> None:
    _state["signum"] = signum
    if os.getpid() == _state["owner_pid"]:   # the launcher: pass it on to local workers
        _forward(signum)
    if _state["phase"] == "starting":
        _state["phase"] = "stopping"
        raise StopBeforeTraining(signum)


def _forward(signum) -> None:
    for child in mp.active_children():
        os.kill(child.pid, signum)


def stop_during_start_up() -> None:
    """From now on a stop signal ends this process's start-up at once (train.py calls it before its imports):
    where nothing catches the StopBeforeTraining (an import, Hydra's composition), it is said in one line and the
    process exits with its code (nanoexp.run.main does the same for the run)."""
    if threading.current_thread() is threading.main_thread():
        _state["phase"] = "starting"
        for s in STOP_SIGNALS:
            signal.signal(s, _on_signal)
        sys.excepthook = _exit_on_stop(sys.excepthook)


def _exit_on_stop(previous):
    def hook(kind, error, trace):
        if not issubclass(kind, StopBeforeTraining):
            return previous(kind, error, trace)
        print(f"nanoexp: {error}", file=sys.stderr, flush=True)
        os._exit(error.exit_code)   # the interpreter's own exit code for an uncaught exception would be 1
    return hook


def training_started() -> None:
    """This rank is about to train its first step: from now on a stop signal is recorded, and the run stops
    after the step in which every rank has seen it."""
    _state["phase"] = "training"


def handling_stop_signals() -> bool:
    """Whether this process is inside `handle_stop_signals()` (its local workers should handle them too)."""
    return _state["owner_pid"] == os.getpid()


@contextlib.contextmanager
def workers_starting():
    """Wrap the start of local workers: stop signals are held back (pending, never lost) in this thread
    and, through the inherited mask, in each new worker until it calls `worker_handles_stop_signals()`.
    From here on this process forwards signals to its workers and waits for them."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    if _state["phase"] == "starting":
        _state["phase"] = "delegated"
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def worker_handles_stop_signals(handle: bool = True) -> None:
    """In a local worker, before anything slow: handle stop signals (`handle`, when the launcher does;
    otherwise the default actions stay) as a process starting, then let in those held back since the
    worker started."""
    if handle:
        _state["phase"] = "starting"
        for s in STOP_SIGNALS:
            signal.signal(s, _on_signal)   # owner_pid is the launcher's (fork) or None (spawn): no forwarding
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def ignore_stop_signals() -> None:
    """A process on its way out: hold further stop signals back (they would interrupt its last writes)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def stop_requested() -> bool:
    """Whether this process has received a stop signal since the run started."""
    return _state["signum"] is not None


def received_signal_name() -> str | None:
    """The stop signal this process received ("SIGUSR2", ...), None if none did."""
    signum = _state["signum"]
    return None if signum is None else signal.Signals(signum).name


@contextlib.contextmanager
def handle_stop_signals():
    """Handle SIGTERM/SIGUSR2/SIGINT during the block (a start-up first: see the module docstring); afterwards
    restore and chain to the previous handlers."""
    if threading.current_thread() is not threading.main_thread():   # signal.signal would refuse
        yield
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    _state.update(signum=None, owner_pid=os.getpid(), phase="starting")
    for s in STOP_SIGNALS:
        signal.signal(s, _on_signal)
    try:
        yield
    finally:
        _state["phase"] = "stopping"   # what is left is the way out
        for s, handler in previous.items():
            signal.signal(s, handler)
        signum, _state["signum"] = _state["signum"], None
        chained = previous.get(signum)
        if callable(chained) and chained not in (signal.default_int_handler, _on_signal):
            chained(signum, None)
