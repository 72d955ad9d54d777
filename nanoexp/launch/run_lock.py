"""One owner per run: a run holds a lock file in its run folder (and in its checkpoints folder when that lies
outside) for as long as it lives, and a second run that would write into either, or into a folder inside them,
is refused at start, naming the live run's host and PID.

The lock is an `fcntl.flock` on `.nanoexp.lock`: the kernel releases it when its holder dies, so a crashed or
killed run never blocks the next (forked workers share the launcher's lock and die with it). On a shared file
system where flock does not reach other hosts, the file's record is a lease: its holder rewrites the heartbeat
every HEARTBEAT_S seconds, and a record from another host fresher than LEASE_S counts as a live owner.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time

from nanoexp.config import ConfigError

LOCK_FILE = ".nanoexp.lock"
HEARTBEAT_S, LEASE_S = 5.0, 30.0
RECORD_BYTES = 4096   # the record is rewritten in place, padded to this size, so that readers never see a mix
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)   # flock not supported here


class RunFolderBusy(ConfigError):
    """Another live run owns this run folder or checkpoints folder."""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # alive, another user's
        return True
    return True


def try_flock(fd: int) -> bool:
    """Take the flock on `fd`: True when taken, False where the file system has no flock; BlockingIOError when
    another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        raise
    except OSError as error:
        if error.errno not in NO_LOCKS:
            raise
        return False


class FolderLock:
    """The lock of one folder: `acquire()` or raise RunFolderBusy; `release()` at the end of the run."""

    def __init__(self, folder: str):
        self.folder, self.path = folder, os.path.join(folder, LOCK_FILE)
        self.fd: int | None = None
        self.started: float | None = None
        self.stop = threading.Event()

    def acquire(self) -> None:
        os.makedirs(self.folder, exist_ok=True)
        owner = self.live_owner(os.O_RDWR | os.O_CREAT, keep=True)
        if owner is not None:
            raise RunFolderBusy(busy_message(self.folder, owner))
        self.write(heartbeat=time.time())
        self.beating = threading.Thread(target=self.beat, daemon=True, name="nanoexp-run-lock")
        self.beating.start()

    def owner(self) -> dict | None:
        """The live run that holds this folder, without taking it (None: free, or no lock file yet)."""
        return self.live_owner(os.O_RDWR) if os.path.isfile(self.path) else None

    def live_owner(self, flags: int, keep: bool = False) -> dict | None:
        """Open the lock file and try its flock; the live owner's record if another run holds the folder, else
        None, keeping the file open and locked when `keep`."""
        self.fd = os.open(self.path, flags, 0o644)
        try:
            flocked = try_flock(self.fd)
            owner = self.read()
            owner = owner if owner and self.owned_elsewhere(owner, flocked) else None
        except BlockingIOError:
            owner = self.read() or {}
        if owner is not None or not keep:
            os.close(self.fd)   # drops the flock, if taken
            self.fd = None
        return owner

    def owned_elsewhere(self, owner: dict, flocked: bool) -> bool:
        """Whether the record names a live run other than this one (the flock is ours, or not supported)."""
        if owner.get("released") or time.time() - owner.get("heartbeat", 0) > LEASE_S:
            return False
        if owner.get("host") != socket.gethostname():
            return True   # flock did not stop us, yet another host renews its lease: locks do not reach it
        return not flocked and owner.get("pid") != os.getpid() and pid_alive(owner.get("pid", 0))

    def read(self) -> dict:
        try:
            return json.loads(os.pread(self.fd, RECORD_BYTES, 0).decode().strip() or "{}")
        except (ValueError, UnicodeDecodeError):
            return {}   # a record cut short by a crash mid-write: nobody's

    def write(self, **fields) -> None:
        self.started = self.started or time.time()
        record = {"host": socket.gethostname(), "pid": os.getpid(), "command": " ".join(sys.argv)[:1000],
                  "started": self.started, **fields}
        os.pwrite(self.fd, json.dumps(record).encode()[:RECORD_BYTES - 1].ljust(RECORD_BYTES), 0)

    def beat(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            self.write(heartbeat=time.time())

    def release(self) -> None:
        if self.fd is None:
            return
        self.stop.set()
        self.beating.join()
        self.write(heartbeat=time.time(), released=True)
        os.close(self.fd)   # drops the flock
        self.fd = None


def busy_message(folder: str, owner: dict, owner_folder: str | None = None) -> str:
    started = datetime.datetime.fromtimestamp(owner.get("started", 0)).strftime("%Y-%m-%d %H:%M:%S")
    who = (f"PID {owner['pid']} on host {owner['host']}, started {started} ({owner.get('command', '?')})"
           if "pid" in owner else "a run that has not written its record yet")
    within = f", which owns {owner_folder}" if owner_folder and owner_folder != folder else ""
    return (f"{folder} is in use by another nanoexp run{within}: {who}; wait for it to end, or give this run its "
            "own folder (hydra.run.dir=..., checkpoint.checkpoints_path=...)")


def owner_of(folder: str) -> tuple[str, dict] | None:
    """(the folder it holds, the live run's record) for the run that holds `folder` or a folder above it."""
    path = os.path.realpath(folder)
    while True:
        owner = FolderLock(path).owner()
        if owner is not None:
            return path, owner
        if os.path.dirname(path) == path:
            return None
        path = os.path.dirname(path)


def inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


@contextlib.contextmanager
def own_folders(folders: list[str]):
    """Hold `folders` for the block: a lock in each that no other of them contains; RunFolderBusy naming the live
    run when one holds any of them or a folder above."""
    real = list(dict.fromkeys(os.path.realpath(f) for f in folders))
    outermost = [f for f in real if not any(other != f and inside(f, other) for other in real)]
    for folder in real:
        held = owner_of(folder)
        if held is not None:
            raise RunFolderBusy(busy_message(folder, held[1], held[0]))
    taken = []
    try:
        for folder in outermost:
            lock = FolderLock(folder)
            lock.acquire()
            taken.append(lock)
        yield
    finally:
        for lock in taken:
            lock.release()
