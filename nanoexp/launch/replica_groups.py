"""Replica groups on this machine (fault_tolerance=torchft, fault_tolerance.group null): a lighthouse (unless
fault_tolerance.lighthouse names a running one), then the R groups as child processes, each a world of its own with
its own run folder (<run>/group_<g>; the checkpoints shared in <run>/checkpoints), and a group that dies started
again, up to fault_tolerance.max_restarts times, while no group has finished. When all have ended, the run folder's
summary.json and metrics.jsonl are the groups' put together. On other hosts each world is started with
fault_tolerance.group=g and the lighthouse's address; under hydra/launcher=slurm the groups are SLURM jobs
(nanoexp/launch/slurm_groups.py), watched and restarted by the same rule (GroupProcesses.watch).
"""
from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Callable

from omegaconf import OmegaConf

from nanoexp.launch.workers import WorkerFailed, die_with_parent, free_port, start_method
from nanoexp.observe.summary import read_summary, write_summary

log = logging.getLogger("nanoexp")
# How long a group's heartbeat may be late before the lighthouse leaves it out of the next quorum: a dead group
# stops the others about this long. torchft's default is 5 s.
HEARTBEAT_TIMEOUT_MS = 2000


def group_folder(run_dir: str, group: int) -> str:
    return os.path.join(run_dir, f"group_{group}")


def checkpoints_folder(cfg, run_dir: str) -> str:
    """Where every group reads and the lowest live one writes the checkpoints."""
    return os.path.abspath(cfg.checkpoint.checkpoints_path or os.path.join(run_dir, "checkpoints"))


def group_config(cfg, run_dir: str, group: int, lighthouse: str):
    """The config group `group` runs: its number, the lighthouse, the shared checkpoints folder."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    cfg.fault_tolerance.group, cfg.fault_tolerance.lighthouse = group, lighthouse
    cfg.checkpoint.checkpoints_path = checkpoints_folder(cfg, run_dir)
    return cfg


class Lighthouse:
    """torchft's lighthouse as a child process (its log in <run>/lighthouse.log), for as long as the block."""

    def __init__(self, run_dir: str, min_replicas: int, join_timeout_s: float):
        self.port = free_port()
        self.address = f"http://{socket.gethostname()}:{self.port}"
        binary = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
        command = [binary if os.path.exists(binary) else shutil.which("torchft_lighthouse") or binary,
                   "--bind", f"[::]:{self.port}", "--min_replicas", str(min_replicas),
                   "--join_timeout_ms", str(int(join_timeout_s * 1000)), "--quorum_tick_ms", "50",
                   "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS)]
        self.log = open(os.path.join(run_dir, "lighthouse.log"), "ab")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info")})

    def __enter__(self) -> "Lighthouse":
        return self

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def _group_main(train_group: Callable, cfg, run_dir: str, launcher_pid: int) -> None:
    die_with_parent(launcher_pid)
    try:
        train_group(cfg, run_dir)
    except BaseException as error:   # noqa: BLE001 - the launcher reads the exit code; the log has the reason
        log.error("replica group %s failed: %s: %s", cfg.fault_tolerance.group, type(error).__name__, error)
        logging.shutdown()
        os._exit(1)
    logging.shutdown()
    os._exit(0)


def launch_replica_groups(cfg, run_dir: str, train_group: Callable, groups: Callable | None = None) -> None:
    """Train `cfg`'s R replica groups: `train_group(group_cfg, group_run_dir)` in one child process each (or what
    `groups`, a GroupProcesses class, starts them as: SLURM jobs), started again when it fails
    (fault_tolerance.max_restarts) while no group has finished. Raises WorkerFailed when none finished."""
    from nanoexp.parallel.replicas import check_lighthouse

    ft = cfg.fault_tolerance
    with contextlib.ExitStack() as stack:
        if ft.lighthouse is None:
            address = stack.enter_context(Lighthouse(run_dir, ft.min_replicas, join_timeout_s=1.0)).address
        else:
            address = ft.lighthouse
        check_lighthouse(address, ft.quorum_timeout_s)
        log.info("replica groups: %d, lighthouse %s%s", ft.replica_groups, address,
                 "" if ft.lighthouse else " (started here)")
        groups = (groups or GroupProcesses)(cfg, run_dir, address, train_group)
        stack.callback(groups.stop)
        ended = groups.watch()
    merge_groups(run_dir, ft.replica_groups, groups.restarts, ended)
    if 0 not in ended.values():
        raise WorkerFailed(f"every replica group failed (exit codes {ended}); their logs: "
                           f"{os.path.join(run_dir, 'group_*', 'logs')}")


class GroupProcesses:
    """The R group processes of a run, started and, when one fails, started again. A subclass starts them as
    something else (start_all, start), says when one ended (exit_code) and stops them (stop)."""
    poll_s = 0.2   # how often watch() looks

    def __init__(self, cfg, run_dir: str, lighthouse: str, train_group: Callable):
        self.cfg, self.run_dir, self.lighthouse, self.train_group = cfg, run_dir, lighthouse, train_group
        self.context = mp.get_context(start_method(cfg.parallelism.start_method))
        count = cfg.fault_tolerance.replica_groups
        self.restarts = {g: 0 for g in range(count)}
        self.running = dict(zip(range(count), self.start_all(list(range(count)))))

    def start_all(self, groups: list[int]) -> list:
        return [self.start(g) for g in groups]

    def start(self, group: int):
        process = self.context.Process(target=_group_main, args=(
            self.train_group, group_config(self.cfg, self.run_dir, group, self.lighthouse),
            group_folder(self.run_dir, group), os.getpid()))
        process.start()
        return process

    def look(self) -> None:
        """Before each look at the groups (a subclass asks their state here)."""

    def exit_code(self, process) -> int | None:
        """None while the group runs."""
        return process.exitcode

    def watch(self) -> dict[int, int]:
        """Until every group has ended: each group's exit code. The one restart rule of replica groups: a group
        that failed is started again while it has restarts left and no group has finished."""
        ended: dict[int, int] = {}
        while self.running:
            time.sleep(self.poll_s)
            self.look()
            for group, process in list(self.running.items()):
                code = self.exit_code(process)
                if code is None:
                    continue
                del self.running[group]
                if code and self.restarts[group] < self.cfg.fault_tolerance.max_restarts and 0 not in ended.values():
                    self.restarts[group] += 1
                    log.warning("replica group %d exited with code %s: starting it again (restart %d of %d)", group,
                                code, self.restarts[group], self.cfg.fault_tolerance.max_restarts)
                    self.running[group] = self.start(group)
                else:
                    ended[group] = code
        return ended

    def stop(self) -> None:
        for process in self.running.values():
            process.terminate()
        for process in self.running.values():
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()


def merge_groups(run_dir: str, count: int, restarts: dict[int, int], ended: dict[int, int]) -> None:
    """The run folder's summary.json (the lowest finished group's, with every group's end) and metrics.jsonl (each
    record as the lowest group that wrote it did)."""
    summaries = {g: read_summary(group_folder(run_dir, g)) or {} for g in range(count)}
    finished = [g for g in range(count) if ended.get(g) == 0 and summaries[g]] or [0]
    summary = dict(summaries[finished[0]])
    summary["groups"] = [{"group": g, "exit_code": ended.get(g), "restarts": restarts[g],
                                  **summaries[g].get("fault_tolerance", {})} for g in range(count)]
    write_summary(run_dir, summary)
    records: dict[tuple, dict] = {}
    for g in range(count):
        path = os.path.join(group_folder(run_dir, g), "metrics.jsonl")
        for line in open(path) if os.path.exists(path) else ():
            record = json.loads(line)
            records.setdefault((record["step"], tuple(sorted(record))), record)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for key in sorted(records, key=lambda k: k[0]):
            f.write(json.dumps(records[key]) + "\n")
