"""Count the bytes every process group moves, by wrapping torch.distributed's calls.

    with CommCounter({"dp": ctx.dp_group, "tp": ctx.tp_group, "pp": ctx.pp_group}) as comm:
        trainer.train_step(micro_batches, lr)
    comm.totals()   # {"dp": {"calls": 3, "payload_bytes": ..., "sent_bytes": ...}, ...}

Per call, for this rank: payload_bytes, its tensor argument; sent_bytes, what the bandwidth-optimal ring algorithm
puts on the wire for a group of n (all-reduce 2(n-1)/n x tensor, all-gather and reduce-scatter (n-1) x chunk,
broadcast (n-1)/n, send the tensor, recv 0, all-to-all its input but its own split): the yardstick the analytic
minimum of a layout is written in. Only the outermost wrapped call counts; calls are named by their group."""
from __future__ import annotations

import functools
import threading
from collections import defaultdict

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# Per wrapped call: where its tensor and group are (argument index and keyword) and what it sends.
RULES = {
    "all_reduce": ((0, "tensor"), (2, "group"), lambda b, n: 2 * (n - 1) * b // n),
    "broadcast": ((0, "tensor"), (2, "group"), lambda b, n: (n - 1) * b // n),
    "all_gather": ((1, "tensor"), (2, "group"), lambda b, n: (n - 1) * b),
    "all_gather_into_tensor": ((1, "input_tensor"), (2, "group"), lambda b, n: (n - 1) * b),
    "reduce_scatter": ((0, "output"), (3, "group"), lambda b, n: (n - 1) * b),
    "reduce_scatter_tensor": ((0, "output"), (3, "group"), lambda b, n: (n - 1) * b),
    "all_gather_single": ((1, "input_tensor"), (2, "group"), lambda b, n: (n - 1) * b),
    "reduce_scatter_single": ((0, "output"), (3, "group"), lambda b, n: (n - 1) * b),
    "send": ((0, "tensor"), (2, "group"), lambda b, n: b),
    "isend": ((0, "tensor"), (2, "group"), lambda b, n: b),
    "recv": ((0, "tensor"), (2, "group"), lambda b, n: 0),
    "irecv": ((0, "tensor"), (2, "group"), lambda b, n: 0),
}
WRAPPED = (*(name for name in RULES if hasattr(dist, name)), "all_to_all_single", "batch_isend_irecv")   # as this torch has them


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _call_bytes(name: str, args: tuple, kwargs: dict) -> list[tuple[object, int, int]]:
    """[(group, payload_bytes, sent_bytes)] of one call, from its arguments."""
    if name == "batch_isend_irecv":
        sends = [(op, getattr(op.op, "__name__", "") == "isend") for op in (args[0] if args else kwargs["p2p_op_list"])]
        return [(op.group, _nbytes(op.tensor), _nbytes(op.tensor) if sending else 0) for op, sending in sends]

    def arg(where):
        i, key = where
        return kwargs[key] if key in kwargs else (args[i] if len(args) > i else None)

    if name == "all_to_all_single":   # sends every row but those of its own split
        rows, splits, group = arg((1, "input")), arg((3, "input_split_sizes")), arg((4, "group"))
        n, me, total = dist.get_world_size(group), dist.get_rank(group), _nbytes(rows)
        own = total * splits[me] // max(sum(splits), 1) if splits else total // n
        return [(group, total, total - own)]
    tensor_at, group_at, sent = RULES[name]
    tensor, group = arg(tensor_at), arg(group_at)
    return [(group, _nbytes(tensor), sent(_nbytes(tensor), dist.get_world_size(group)))]


class CommCounter:
    """A context manager that records every wrapped torch.distributed call per named group.

    `records` holds (group name, op name, payload_bytes, sent_bytes) per call, in call order;
    `totals()` sums them per group name. `reset()` empties the records (e.g. after warm-up).
    Not reentrant: one CommCounter active per process at a time.
    """

    def __init__(self, groups: dict[str, object]):
        self.names = {id(group): name for name, group in groups.items() if group is not None}
        self.records: list[tuple[str, str, int, int]] = []
        self._originals: dict[str, object] = {}
        self._depth = threading.local()

    def _name(self, group) -> str:
        if group is None or group is c10d.GroupMember.WORLD:
            return self.names.get(id(group), "world")
        return self.names.get(id(group), "other")

    def _wrap(self, name: str, original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            depth = getattr(self._depth, "value", 0)
            if depth == 0:
                for group, payload, sent in _call_bytes(name, args, kwargs):
                    self.records.append((self._name(group), name, payload, sent))
            self._depth.value = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.value = depth
        return wrapper

    def __enter__(self) -> "CommCounter":
        for name in WRAPPED:
            original = getattr(c10d, name)
            self._originals[name] = original
            wrapper = self._wrap(name, original)
            # Both namespaces: P2POp checks (and batch_isend_irecv compares) `op` against
            # c10d's own isend/irecv, so those must be the same wrapper callers pass in.
            setattr(c10d, name, wrapper)
            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)
        self._originals.clear()

    def reset(self) -> None:
        self.records.clear()

    def totals(self) -> dict[str, dict[str, int]]:
        """{group name: {"calls", "payload_bytes", "sent_bytes"}} over the records."""
        out: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "payload_bytes": 0, "sent_bytes": 0})
        for group, _, payload, sent in self.records:
            out[group]["calls"] += 1
            out[group]["payload_bytes"] += payload
            out[group]["sent_bytes"] += sent
        return dict(out)

