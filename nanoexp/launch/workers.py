"""How workers come to exist.

- Under torchrun or a SLURM task (the environment says so), this process joins that world.
- With one process in all, the run happens in this process.
- Otherwise dp*cp*tp*pp local workers are started and watched: if one fails, the others are stopped
  and the command exits non-zero with that rank's error. `parallelism.start_method` says how:
  fork (the default on CPU: workers start in about a second, sharing the imported modules) or
  spawn (the default with CUDA, which a process that has used it cannot fork; each worker starts a
  fresh interpreter and imports torch again). Both behave alike: spawned workers rebuild the
  launcher's console and log-file handlers (forked ones inherit them) and both handle stop
  signals from their first line (nanoexp.launch.signals): a worker stopped before its first step
  exits with 128 + the signal's number, and the launcher ends the run as stopped at start-up.
"""
from __future__ import annotations

import ctypes
import json
import logging
import multiprocessing as mp
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Callable

import psutil
import torch
import torch.distributed as dist

from nanoexp.failures import KnownFailure, is_known
from nanoexp.launch.signals import (STOP_SIGNALS, StopBeforeTraining, handling_stop_signals, ignore_stop_signals,
                                    worker_handles_stop_signals, workers_starting)

log = logging.getLogger("nanoexp")


class WorkerFailed(KnownFailure):
    """A worker died or raised, or lost a peer; the message names the rank (and host) and carries its error."""


def lost_peer(error: BaseException, timeout_s: float) -> str | None:
    """What a collective's error says about the other ranks, in one line naming the peer's host when the
    error gives its address; None for an error that is not about a peer (a bug, a bad input, ...)."""
    text = str(error)
    peer = re.search(r"(?:closed by peer|reset by peer|refused)[^\[]*\[([0-9a-fA-F.:]+)\]:\d+", text)
    if peer:
        address = peer.group(1)
        try:
            host = socket.gethostbyaddr(address)[0]
        except OSError:
            host = address
        return f"lost contact with {host} ({address}): its process died or its link went down"
    if re.search(r"remote process exit|ncclRemoteError|communicator was aborted", text):   # NCCL names no host
        return ("lost contact with a peer (NCCL: a remote process exited, or a network error): its process died or "
                "its link went down")
    if re.search(r"timed out|timeout|timing out", text, re.IGNORECASE):
        return (f"a collective waited parallelism.collective_timeout_s={timeout_s:g} s for a peer that never came: "
                "a host is lost, partitioned or stuck")
    return None


def export_slurm_rendezvous() -> None:
    """Under SLURM tasks (not torchrun), point torch's env:// rendezvous at the allocation: MASTER_ADDR is
    the first node of SLURM_JOB_NODELIST, MASTER_PORT derives from the job id (every task computes the
    same, concurrent jobs differ), LOCAL_WORLD_SIZE is the tasks per node. Values already set win."""
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" not in env:
        return
    from submitit.slurm.slurm import SlurmJobEnvironment   # parses compressed node lists like gpu[01-04]
    job = SlurmJobEnvironment()
    env.setdefault("MASTER_ADDR", job.hostnames[0])
    env.setdefault("MASTER_PORT", str(20000 + int(job.raw_job_id) % 40000))
    env.setdefault("LOCAL_WORLD_SIZE", str(job.num_tasks // job.num_nodes))


PR_SET_PDEATHSIG = 1   # linux/prctl.h


def die_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
    """End this process at once when `parent_pid` (its launcher, or torchrun's agent) is gone: a worker
    whose launcher was killed must not train on and write checkpoints into a folder that the next run
    of the same command will own. Linux delivers SIGKILL on the parent's death (prctl); elsewhere a
    thread watches the parent. A parent that died before this call is caught by the pid check."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    else:
        threading.Thread(target=_exit_when_orphaned, args=(parent_pid, poll_s), daemon=True).start()
    if os.getppid() != parent_pid:
        os._exit(1)


def _exit_when_orphaned(parent_pid: int, poll_s: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(poll_s)
    os._exit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_index(local_rank: int, local_world: int, visible: int, env=os.environ) -> int:
    """The GPU of local rank `local_rank` among `visible` GPUs: its own when there are enough; the one GPU a
    launcher bound to each task (SLURM's --gpus-per-task=1: every task sees its own as device 0); else a one-line
    error naming the layout's ranks per node and CUDA_VISIBLE_DEVICES."""
    if local_rank < visible:
        return local_rank
    if visible == 1 and ("SLURM_STEP_GPUS" in env or "SLURM_JOB_GPUS" in env):
        return 0
    raise WorkerFailed(f"local rank {local_rank} of {local_world} ranks on this node has no GPU: {visible} visible "
                       f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')}); run at most {visible} "
                       "ranks per node (a smaller layout, or more nodes), or make more GPUs visible")


def setup_device(local_rank: int, local_world: int) -> torch.device:
    """One GPU per process when CUDA is present; on CPU, split the cores between processes."""
    if torch.cuda.is_available():
        index = gpu_index(local_rank, local_world, torch.cuda.device_count())
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return torch.device("cpu")


def init_distributed(rank: int, world_size: int, device: torch.device, timeout_s: float = 600.0) -> None:
    from nanoexp.launch import rendezvous
    backend = "nccl" if device.type == "cuda" else "gloo"
    # Under torchrun's agent store (its default), a store of this round's own: the agent's outlives restarts
    # and would hand a restarted world the dead workers' addresses. Elsewhere env:// as torch does it.
    store = rendezvous.round_store(rank, timeout_s) if rendezvous.uses_agent_store() else None
    dist.set_debug_level_from_env()   # torch read TORCH_DISTRIBUTED_DEBUG at import; debug.collectives sets it later
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), device_id=device if device.type == "cuda" else None)


def start_method(name: str = "auto") -> str:
    """parallelism.start_method resolved: auto is spawn with CUDA, fork without."""
    if name == "auto":
        return "spawn" if torch.cuda.is_available() else "fork"
    return name


def _log_handlers() -> list:
    """The root logger's console and file handlers, as what a spawned worker needs to rebuild them."""
    described = []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            target = handler.baseFilename
        elif isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr):
            target = "stdout" if handler.stream is sys.stdout else "stderr"
        else:
            continue
        # The format itself, not the formatter object: that is all a plain (or Hydra's) formatter holds,
        # and it always crosses to a spawned process. A subclass's extras (colours) are dropped.
        formatter = handler.formatter
        style = (getattr(formatter, "_fmt", None), getattr(formatter, "datefmt", None)) if formatter else None
        described.append((target, handler.level, style))
    return described


def _rebuild_log_handlers(described: list, level: int) -> None:
    root = logging.getLogger()
    for target, handler_level, style in described:
        if target in ("stdout", "stderr"):
            handler = logging.StreamHandler(getattr(sys, target))
        else:
            handler = logging.FileHandler(target)   # appends, as the launcher's handler does
        handler.setLevel(handler_level)
        handler.setFormatter(logging.Formatter(*style) if style else None)
        root.addHandler(handler)
    root.setLevel(level)


_failure_channel: dict = {}   # a local worker's rank and its launcher's error queue (end_worker reports there)


def end_worker(message: str) -> None:
    """End this worker now, from any thread, with `message` as its failure: the stall watchdog's way out, since a
    main thread stuck in a collective cannot raise. A local worker reports to its launcher; a rank of torchrun's
    or SLURM's world prints the message and writes it where torchrun's report looks."""
    if _failure_channel:
        _failure_channel["errors"].put((_failure_channel["rank"], message, ""))
        _leave(1, _failure_channel["errors"])
    print(f"nanoexp: {message}", file=sys.stderr)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                     "timestamp": str(int(time.time()))}}}, f)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(1)


def _local_worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, errors,
                  timeout_s: float, handle_signals: bool, log_handlers: list | None, launcher_pid: int,
                  processes_here: int) -> None:
    die_with_parent(launcher_pid)
    _failure_channel.update(rank=rank, errors=errors)
    code = 0
    try:
        worker_handles_stop_signals(handle_signals)   # first: held-back signals arrive here
        if log_handlers is not None:   # spawned: a bare interpreter
            _rebuild_log_handlers(*log_handlers)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        device = setup_device(rank, processes_here)
        init_distributed(rank, world_size, device, timeout_s)
        fn(rank, world_size, device, *args)
        dist.destroy_process_group()
    except StopBeforeTraining as stop:   # the launcher says it, once
        code = stop.exit_code
        _leave_the_store_last(rank, world_size)
    except BaseException as error:  # noqa: BLE001 - any failure must reach the parent
        # A failure that names its cause is one line; a bug brings its traceback.
        errors.put((rank, f"{type(error).__name__}: {error}", "" if is_known(error) else traceback.format_exc()))
        code = 1
    _leave(code, errors)


def _leave_the_store_last(rank: int, world_size: int, wait_s: float = 2.0) -> None:
    """Stopped together: rank 0, the store's host (env://), leaves after its peers say they go, so that no peer's
    stall watchdog finds the store gone and prints c10d's warning under the run's one line."""
    if world_size == 1 or not dist.is_initialized():
        return
    store = dist.distributed_c10d._get_default_store()
    try:
        if rank != 0:
            store.add("nanoexp/stopped", 1)
            return
        deadline = time.monotonic() + wait_s
        while store.add("nanoexp/stopped", 0) < world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # noqa: BLE001 - a peer or the store already gone: leave all the same
        pass


def _leave(code: int, errors) -> None:
    """End a worker as multiprocessing ends a forked one: without the interpreter's teardown. A spawned
    worker that tore down would destroy torch's C++ state while its threads still run, and abort
    ("terminate called without an active exception", signal 6) after its work was done."""
    ignore_stop_signals()
    errors.close()
    errors.join_thread()   # the report, if any, has reached the parent
    logging.shutdown()     # flushes the log files
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn_local(world_size: int, fn: Callable, args: tuple, timeout_s: float = 600.0, poll_s: float = 0.2,
                method: str = "auto", processes_here: int | None = None) -> None:
    """Run fn(rank, world_size, device, *args) in world_size local processes and watch them.
    method: auto | fork | spawn (see start_method); under spawn, fn and args must be picklable. `processes_here`:
    the processes of this machine that share its cores (default: these)."""
    method = start_method(method)
    context = mp.get_context(method)
    errors = context.Queue()
    port = free_port()
    log_handlers = (_log_handlers(), logging.getLogger().level) if method == "spawn" else None
    procs = [context.Process(target=_local_worker, daemon=False,
                             args=(r, world_size, port, fn, args, errors, timeout_s, handling_stop_signals(),
                                   log_handlers, os.getpid(), processes_here or world_size))
             for r in range(world_size)]
    with workers_starting():   # a stop signal now waits until every worker handles it
        for p in procs:
            p.start()
    failure, killed, stopped = None, [], None
    try:
        while any(p.is_alive() for p in procs) and failure is None:
            time.sleep(poll_s)
            for rank, p in enumerate(procs):
                if p.exitcode not in (None, 0):
                    failure = (rank, p.exitcode)
                    break
        if failure is not None:
            time.sleep(0.5)   # let the peers of a dead rank notice, and the reports arrive
            stopped = _stopped_at_start_up(procs)
            killed = [(r, -p.exitcode) for r, p in enumerate(procs) if p.exitcode is not None and p.exitcode < 0]
    finally:
        if failure is not None or any(p.is_alive() for p in procs):
            # a worker stopped at start-up was signalled with its peers: one still there is inside a C call
            _stop(procs, grace_s=5.0 if stopped is None else 1.0)
    if stopped is not None:
        raise StopBeforeTraining(stopped)
    if failure is not None:
        raise _worker_failed(failure, killed, errors)


def _worker_failed(failure: tuple[int, int], killed: list, errors) -> WorkerFailed:
    """The failure of a local run, named by its root cause: a rank killed by a signal (it could not report; its
    peers then fail with connection errors), else the first report, else the first rank's exit code."""
    reports = []
    while not errors.empty():
        reports.append(errors.get())
    if killed:
        rank, message, trace = killed[0][0], f"killed by signal {killed[0][1]}", ""
        if killed[0][1] == signal.SIGABRT and torch.cuda.is_available():   # NCCL's watchdog tears down
            message += (" (aborted: NCCL's watchdog ends a process whose collective timed out or whose peer was"
                        " lost; its log says which)")
    elif reports:
        rank, message, trace = reports[0]
    else:
        rank, message, trace = failure[0], f"exited with code {failure[1]}", ""
    if trace:   # a failure that names its cause is said once, by the command's last line
        log.error("rank %d failed: %s\n%s", rank, message, trace)
    return WorkerFailed(f"rank {rank} failed: {message}")


def _stopped_at_start_up(procs) -> int | None:
    """The stop signal with which a worker ended its start-up (its exit code: 128 + the signal's number), or None."""
    codes = {128 + s: s for s in STOP_SIGNALS}
    return next((codes[p.exitcode] for p in procs if p.exitcode in codes), None)


def _stop(procs, grace_s: float = 5.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
            if _stopped(p.pid):   # SIGSTOP, a debugger: SIGTERM waits until it runs again, SIGKILL does not
                p.kill()
    deadline = time.time() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.time()))
        if p.is_alive():
            p.kill()
            p.join()


def _stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False
