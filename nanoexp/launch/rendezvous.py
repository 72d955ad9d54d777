"""A store of its own for every torchrun round, so that `torchrun --max-restarts=N` can restart a world.

By default torchrun's rank-0 agent hosts one TCPStore for the workers and keeps it across restarts: every worker is
a client of it at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True in their environment). The process
groups' keys are named alike in every round ("0", "1", ...), so a restarted world would read the dead workers'
addresses there and fail to connect (gloo: connectFullMesh ... Connection refused) or wait for them. A round id to prefix the keys with is not to be had: TORCHELASTIC_RESTART_COUNT differs between nodes (an agent
whose workers were healthy restarts them for another node without counting a restart), and torchrun gives the
workers nothing else that names the round. So worker rank 0 starts a fresh TCPStore server (any free port) and
announces it under one fixed key of the agent's store as "host:port:nonce", the nonce also kept in the new store.
The other ranks may read the previous round's announcement before rank 0 has replaced it; its server died with the
old rank 0, so the connection is refused (or, should the port be taken again, the nonce differs), and they read
again until the announcement is fresh. Liveness tells the rounds apart without the ranks agreeing on any number, and
the new store holds nothing of an earlier round. NCCL exchanges its ids through this store as gloo its addresses.
"""
from __future__ import annotations

import os
import secrets
import socket
import time
from datetime import timedelta

import torch.distributed as dist

ANNOUNCEMENT = "nanoexp/round_store"   # in the agent's store: "host:port:nonce" of the current round's store
NONCE = "nanoexp/nonce"                # in the round's store: the nonce that rank 0 announced
PROBE_S = 5.0     # a live server answers a connection within this long, even across a busy network
RETRY_S = 0.2     # between readings of a stale announcement
NEVER_ANNOUNCED = "rank 0 never announced this round's store (nanoexp.launch.rendezvous): it died or is stuck"


def uses_agent_store(environ=os.environ) -> bool:
    """Whether torchrun's agent hosts the workers' store (its default; torch reads the same variable)."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def round_store(rank: int, timeout_s: float, environ=os.environ) -> dist.Store:
    """This round's own store, for init_process_group(store=...): rank 0 starts and announces it, the other
    ranks find it. Every rank gives up after timeout_s (parallelism.collective_timeout_s)."""
    deadline = time.monotonic() + timeout_s
    host, port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
    agent = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    if rank == 0:
        # Worker rank 0 runs on the rank-0 agent's host, MASTER_ADDR, which every rank already reaches.
        return _start_and_announce(agent, host, timeout_s)
    return _find(agent, deadline, timeout_s)


def _start_and_announce(agent: dist.Store, host: str, timeout_s: float) -> dist.Store:
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    nonce = secrets.token_hex(8)
    store.set(NONCE, nonce)   # before the announcement: whoever reads it finds the nonce in place
    agent.set(ANNOUNCEMENT, f"{host}:{store.port}:{nonce}")
    return store


def _find(agent: dist.Store, deadline: float, timeout_s: float) -> dist.Store:
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(NEVER_ANNOUNCED)
        host, port, nonce = _announcement(agent, remaining)
        store = _connect(host, int(port), nonce)
        if store is not None:
            store.set_timeout(timedelta(seconds=timeout_s))   # as env:// sets it, for every later wait
            return store
        time.sleep(RETRY_S)   # a previous round's announcement: rank 0 has not replaced it yet


def _announcement(agent: dist.Store, timeout_s: float) -> tuple[str, str, str]:
    """The latest announcement; in round 0 it waits for rank 0's first (a missing key blocks until set)."""
    agent.set_timeout(timedelta(seconds=timeout_s))
    try:
        return agent.get(ANNOUNCEMENT).decode().rsplit(":", 2)
    except dist.DistStoreError as error:
        raise TimeoutError(NEVER_ANNOUNCED) from error


def _connect(host: str, port: int, nonce: str) -> dist.Store | None:
    """A client of the announced store, or None when it is a dead round's (refused, silent, another nonce)."""
    try:
        # A plain socket first: a dead server refuses at once, while TCPStore would retry until its timeout and
        # log a C++ trace for every try.
        socket.create_connection((host, port), timeout=PROBE_S).close()
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=PROBE_S))
        return store if store.get(NONCE).decode() == nonce else None
    except (OSError, dist.DistError):
        return None
