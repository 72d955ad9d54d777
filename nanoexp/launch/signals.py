"""Stop signals: SIGTERM, SIGUSR2 or SIGINT (Ctrl-C) ask the run to finish its step, checkpoint and exit cleanly.

`handle_stop_signals()` wraps a run in the process that starts it and only records the signal (forwarding it to
local workers, once they exist). Workers record signals themselves: the launcher blocks them while it starts
workers (`workers_starting()`; the mask survives fork and spawn), and each worker installs the recording handler
first thing (`worker_records_stop_signals()`) before letting held-back signals in, so a signal during a worker's
imports is recorded late, never fatal. Every rank asks `stop_flag(ctx)` in each step (one all-reduce), so all
stop after the same step. Once the checkpoint is written, the handler installed before ours gets the signal
(submitit's SIGUSR2 handler requeues the job); Python's KeyboardInterrupt is not chained. See docs/checkpoints.md."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)
_received: dict = {"signum": None, "owner_pid": None}


def _on_signal(signum, frame) -> None:
    _received["signum"] = signum
    if os.getpid() == _received["owner_pid"]:   # the launcher: pass it on to local workers
        _forward(signum)


def _forward(signum) -> None:
    for child in mp.active_children():
        os.kill(child.pid, signum)


def handling_stop_signals() -> bool:
    """Whether this process is inside `handle_stop_signals()` (its local workers should record them too)."""
    return _received["owner_pid"] == os.getpid()


@contextlib.contextmanager
def workers_starting():
    """Wrap the start of local workers: stop signals are held back (pending, never lost) in this thread
    and, through the inherited mask, in each new worker until it calls `worker_records_stop_signals()`.
    On leaving, held signals reach this process's handler (which forwards them), and a signal recorded
    before the workers existed is forwarded to them too."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        if handling_stop_signals() and _received["signum"] is not None:
            _forward(_received["signum"])


def worker_records_stop_signals(record: bool = True) -> None:
    """In a local worker, before anything slow: record stop signals (`record`, when the launcher handles
    them; otherwise the default actions stay), then let in those held back since the worker started."""
    if record:
        for s in STOP_SIGNALS:
            signal.signal(s, _on_signal)   # owner_pid is the launcher's (fork) or None (spawn): no forwarding
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def stop_requested() -> bool:
    """Whether this process has received a stop signal since the run started."""
    return _received["signum"] is not None


def received_signal_name() -> str | None:
    """The stop signal this process received ("SIGUSR2", ...), None if none did."""
    signum = _received["signum"]
    return None if signum is None else signal.Signals(signum).name


def stop_flag(ctx, *more: bool) -> torch.Tensor:
    """[1 on every rank if any rank has received a stop signal, else 0, then each of `more` likewise: 1 if it is
    true on any rank], on the device: one all-reduce (a collective: call it on all ranks; the trainer reads it with
    the step's other scalars, and agrees its checkpoint writes in the same call)."""
    flags = torch.zeros(1 + len(more), device=ctx.device)
    for i, raised in enumerate([stop_requested(), *more]):
        if raised:
            flags[i] = 1.0   # a fill on the device: no copy from the host, no wait for it
    if ctx.world_size > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return flags


@contextlib.contextmanager
def handle_stop_signals():
    """Record SIGTERM/SIGUSR2 during the block; afterwards restore and chain to the previous handlers."""
    if threading.current_thread() is not threading.main_thread():   # signal.signal would refuse
        yield
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    _received.update(signum=None, owner_pid=os.getpid())
    for s in STOP_SIGNALS:
        signal.signal(s, _on_signal)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        signum, _received["signum"] = _received["signum"], None
        if signum is not None and callable(previous[signum]) and previous[signum] is not signal.default_int_handler:
            previous[signum](signum, None)
