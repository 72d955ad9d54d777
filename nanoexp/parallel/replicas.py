"""Replica groups (fault_tolerance=torchft): R worlds of one layout share the global batch, and the run goes on
when one of them dies. torchft's Manager (one per rank) asks the lighthouse which groups are live at the start of
each step (the quorum), averages each rank's final gradients with the ranks at the same place in the other live
groups, and says whether the step may be committed (every rank of the group, every collective, enough groups). A
group that comes back copies the rank-by-rank state of a live peer before its next step (`StateTransport`:
safetensors over HTTP, nothing unpickled). Only ParallelContext creates the Manager and its process group
(context.py); this module holds the rules and what the trainer and the gradient path call. docs/fault-tolerance.md
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import socket
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import torch
import torch.distributed as dist
from safetensors.torch import load as load_tensors, save as save_tensors

from nanoexp.config import optimizer_name

METHODS, SEMI_SYNC = ("none", "torchft"), ("none", "diloco")   # fault_tolerance.method, semi_sync
FT = "fault_tolerance."


def replica_rules(cfg: Any) -> list[tuple[bool, str]]:
    """The fault_tolerance group's cross-field rules, each (holds, the message naming the key)."""
    f = cfg.fault_tolerance
    if f.method == "none":
        return [(cfg.fault_injection.kill_group is None, f"fault_injection.kill_group="
                 f"{cfg.fault_injection.kill_group} kills a replica group: set fault_tolerance=torchft")]
    rules = [
        (importlib.util.find_spec("torchft") is not None, f"{FT}method=torchft needs torchft, which is not installed:"
         " pip install -e '.[ft]'"),
        (f.min_replicas <= f.replica_groups, f"{FT}min_replicas={f.min_replicas} is more than {FT}replica_groups="
         f"{f.replica_groups}: no step could ever be committed"),
        (f.group is None or f.group < f.replica_groups, f"{FT}group={f.group}: must be below {FT}replica_groups="
         f"{f.replica_groups} (groups are numbered from 0)"),
        (f.group is None or f.lighthouse is not None, f"{FT}group={f.group} joins a running lighthouse: set "
         f"{FT}lighthouse=http://host:port (or leave {FT}group null to start every group here)"),
        (f.lighthouse is None or address_parts(f.lighthouse) is not None, f"{FT}lighthouse={f.lighthouse}: "
         "must be http://host:port"),
        (optimizer_name(cfg) != "muon", f"optimizer.optimizer_factory.name={cfg.optimizer.optimizer_factory.name} "
         f"with {FT}method=torchft: Muon's state is not copied between groups yet; use adamW"),
        (cfg.model.moe.num_experts == 0 or cfg.model.moe.balance != "bias", f"model.moe.balance=bias with {FT}"
         "method=torchft: each group would move its routing bias by its own loads; use aux_loss or none"),
        (cfg.fault_injection.kill_group is None or cfg.fault_injection.kill_group < f.replica_groups,
         f"fault_injection.kill_group={cfg.fault_injection.kill_group}: must be below {FT}replica_groups="
         f"{f.replica_groups}"),
        (cfg.health.spike.action != "rollback", f"health.spike.action=rollback with {FT}method=torchft: each group "
         "would go back to a checkpoint on its own; use skip (every group drops the same step) or warn"),
        (cfg.health.replay_every == 0, f"health.replay_every={cfg.health.replay_every} with {FT}method=torchft: a "
         "replayed step's gradients would be averaged across groups again; not built yet"),
        (cfg.logging.wandb.mode == "disabled", f"logging.wandb.mode={cfg.logging.wandb.mode} with {FT}method=torchft:"
         " each group writes its own metrics.jsonl and TensorBoard folder; one W&B run for all is not there yet"),
    ]
    if f.semi_sync == "diloco":
        interval = cfg.checkpoint.checkpoint_interval
        rules += [
            (cfg.optimizer.zero_stage == 0, f"{FT}semi_sync=diloco wraps a torch optimizer's step: needs "
             f"optimizer.zero_stage=0 (got {cfg.optimizer.zero_stage})"),
            (cfg.tokens.train_steps % f.sync_every == 0, f"tokens.train_steps={cfg.tokens.train_steps} with {FT}"
             f"sync_every={f.sync_every}: the run must end on a sync (a multiple of it), or the groups end apart"),
            (interval % f.sync_every == 0, f"checkpoint.checkpoint_interval={interval} with {FT}sync_every="
             f"{f.sync_every}: checkpoints must fall on syncs (a multiple of it), where the groups agree"),
        ]
    return rules


def address_parts(address: str) -> tuple[str, int] | None:
    """(host, port) of an http://host:port address, or None."""
    rest = address.removeprefix("http://")
    host, _, port = rest.rpartition(":")
    return (host.strip("[]"), int(port)) if address.startswith("http://") and host and port.isdigit() else None


def check_lighthouse(address: str, timeout_s: float) -> None:
    """A TCP connection to the lighthouse at `address`, tried until `timeout_s` (a lighthouse just started binds
    its port a moment later); a ConfigError naming it otherwise. Plain sockets: torchft's client would start threads
    in a process that then forks the groups."""
    from nanoexp.config import ConfigError
    host, port = address_parts(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic())).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise ConfigError(f"{FT}lighthouse={address}: cannot be reached within {FT}quorum_timeout_s="
                                  f"{timeout_s:g} s: start it (torchft_lighthouse --min_replicas 1) or fix the "
                                  "address") from None
            time.sleep(0.1)


def import_torchft():
    """torchft, its logs quieted: its lighthouse client and Manager log every quorum and commit at info (and warn,
    on a CPU, of a flight recorder there is none of); their errors are kept."""
    os.environ.setdefault("RUST_LOG", "warn")   # read when torchft's native part is first loaded
    import torchft

    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return torchft


# -- a rank's state, as safetensors ----------------------------------------------------------------------
def to_safetensors(state: dict) -> bytes:
    """A nested dict of tensors and JSON values as one safetensors blob (the JSON values in its metadata)."""
    tensors, values = {}, {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():   # an int key (a torch optimizer's state) as "#<int>"
                name = f"#{key}" if isinstance(key, int) else str(key)
                walk(f"{prefix}/{name}" if prefix else name, item)
        elif torch.is_tensor(value):
            tensors[prefix] = value.detach().to("cpu").contiguous()
        else:
            values[prefix] = value
    walk("", state)
    return save_tensors(tensors, metadata={"values": json.dumps(values)})


def from_safetensors(blob: bytes) -> dict:
    """The nested dict `to_safetensors` wrote (safetensors and JSON only: nothing is unpickled); its keys are
    strings, or ints where they were."""
    size = int.from_bytes(blob[:8], "little")
    values = json.loads(json.loads(blob[8:8 + size])["__metadata__"]["values"])
    state: dict = {}
    for path, value in [*load_tensors(blob).items(), *values.items()]:
        node, *parts = state, *path.split("/")
        parts = [int(part[1:]) if part.startswith("#") else part for part in parts]
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return state


class StateTransport:
    """torchft's CheckpointTransport for a healing group: the live rank serves its state of the step as one
    safetensors blob over HTTP; the healing rank at the same place fetches it."""

    def __init__(self, timeout_s: float):
        self.timeout_s, self.blob, self.step, self.ready = timeout_s, b"", -1, threading.Event()
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                transport.ready.wait(transport.timeout_s)
                if self.path != f"/{transport.step}":
                    self.send_error(404, f"serving step {transport.step}, not {self.path[1:]}")
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(transport.blob)))
                self.end_headers()
                self.wfile.write(transport.blob)

            def log_message(self, *args):   # a healing peer's request is not worth a line
                pass

        self.server = ThreadingHTTPServer(("", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def metadata(self) -> str:
        return f"http://{socket.gethostname()}:{self.server.server_address[1]}"

    def send_checkpoint(self, dst_ranks, step: int, state_dict: dict, timeout) -> None:
        self.blob, self.step = to_safetensors(state_dict), step
        self.ready.set()

    def disallow_checkpoint(self) -> None:
        self.ready.clear()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout) -> dict:
        with urllib.request.urlopen(f"{metadata}/{step}", timeout=timeout.total_seconds()) as response:
            return from_safetensors(response.read())

    def shutdown(self, wait: bool = True) -> None:
        self.server.shutdown()
        self.server.server_close()


class ReplicaGroups:
    """This rank's view of the replica groups: group `index` of `count`, through its torchft `manager`.

        groups.on_heal(state, load)      # this rank's state, for a peer that heals, and how to take it
        healed = groups.start_step()     # the quorum (and the copy from a live peer when behind)
        ... backward; groups.average(final gradients); groups.sum(loss denominator) ...
        if groups.commit(): optimizer step

    A run waits for every group before its first step (while the quorum is at the step this process started from,
    at most quorum_timeout_s), so that no group starts behind; afterwards a step goes on with the live groups (at
    least min_replicas)."""

    def __init__(self, manager, index: int, count: int, quorum_timeout_s: float, process_group=None):
        self.manager, self.index, self.count = manager, index, count
        self.quorum_timeout_s = quorum_timeout_s
        self.last_step = manager.current_step()
        self.first_step = self.last_step
        self.every_step = True   # gradients and loss averaged each step (False: DiLoCo syncs every H steps)
        self.bytes_reduced = 0   # payload this rank has all-reduced across the groups
        if process_group is not None:
            allreduce = process_group.allreduce

            def counted(tensors, options):
                self.bytes_reduced += sum(t.numel() * t.element_size() for t in tensors)
                return allreduce(tensors, options)
            process_group.allreduce = counted

    @property
    def live(self) -> int:
        """The groups of the last quorum (before any, all of them)."""
        return self.manager.num_participants() or self.count

    @property
    def lowest_live(self) -> bool:
        """Whether this group is the lowest of the last quorum (before any, group 0): the one that checkpoints."""
        rank = self.manager.participating_rank()   # None before the first quorum
        return self.index == 0 if rank is None else rank == 0

    def semi_synchronous(self, model, optimizer, ft):
        """torchft's DiLoCo around `optimizer` (a torch optimizer: ZeRO-0): each group trains apart and every
        ft.sync_every steps the groups average their pseudo-gradients (the change since the last sync) and take an
        outer Nesterov SGD step (Douillard et al. 2023). The Manager's step counts syncs; the trainer keeps the
        syncs on multiples of sync_every by setting torchft's counter of inner steps."""
        from torchft.local_sgd import DiLoCo

        params = [p for p in model.parameters() if p.requires_grad]
        outer = torch.optim.SGD(params, lr=ft.outer_lr, momentum=ft.outer_momentum, nesterov=True)
        diloco = DiLoCo(self.manager, [model], optimizer, outer, sync_every=ft.sync_every, pin_memory=False)
        diloco.__enter__()
        self.every_step = False
        return diloco

    @staticmethod
    def join_sync(diloco) -> None:
        """A group that took a live one's state at that one's sync takes part in it with the same pseudo-gradient,
        so that both leave it with the same weights (torchft's fragments: its DiLoCo has no public call for it)."""
        for fragment in diloco._fragments:
            fragment.prepare_sync()
            fragment.perform_sync()

    def on_heal(self, state: Callable[[], dict], load: Callable[[dict], None]) -> None:
        self.manager.register_state_dict_fn("nanoexp", load, state)

    def start_step(self) -> bool:
        """Join this step's quorum (at the first step, once every group is there); True when this rank took a live
        peer's state (its step jumped to the peer's)."""
        deadline = time.monotonic() + self.quorum_timeout_s
        while True:
            self.manager.start_quorum()
            if (self.manager.current_step() != self.first_step or self.live >= self.count
                    or time.monotonic() > deadline):
                break
            self.manager.report_error(RuntimeError("the first step waits for every replica group"))   # not committed
            self.manager.should_commit()
            time.sleep(0.05)
        healed, self.last_step = self.manager.current_step() != self.last_step, self.manager.current_step()
        return healed

    @property
    def step(self) -> int:
        """Steps committed: the trainer's step is this + 1."""
        return self.manager.current_step()

    @torch.no_grad()
    def average(self, tensors: list[torch.Tensor]) -> None:
        """Average `tensors` in place over the live groups (each rank with the ranks at its place), as one flat
        buffer per dtype. A failed collective leaves garbage here and makes `commit()` say no."""
        self._all_reduce(tensors, dist.ReduceOp.AVG)

    @torch.no_grad()
    def sum(self, tensors: list[torch.Tensor]) -> None:
        self._all_reduce(tensors, dist.ReduceOp.SUM)

    def _all_reduce(self, tensors: list[torch.Tensor], op) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        for same in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in same])
            self.manager.allreduce(flat, reduce_op=op).wait()
            offset = 0
            for t in same:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def commit(self) -> bool:
        """Whether this step is committed (every rank of every live group agrees, enough groups took part)."""
        committed = self.manager.should_commit()
        self.last_step = self.manager.current_step()
        return committed

    def close(self) -> None:
        self.manager.shutdown(wait=False)
