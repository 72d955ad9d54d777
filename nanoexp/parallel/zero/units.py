"""What the parts of a ZeRO engine (engine.py) share: the unit, the parameters one collective moves, in a flat
float32 buffer of which each rank owns an equal shard (`Unit`); the parts of parameters a shard holds (`ShardPiece`);
what each ZeRO stage shards (`ZeroStage`); how a number format's weights travel in ZeRO-3's gathers (`GatherFormat`);
and how a path's summed gradients become the step's average (`average`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from nanoexp.parallel.collectives import all_reduce_each


@dataclass
class ShardPiece:
    """The part [start, end) of a parameter's flattened elements in this rank's shard, with the views of the
    buffers holding its values and its averaged gradient."""
    param: nn.Parameter
    start: int
    end: int
    value: torch.Tensor
    grad: torch.Tensor


class Unit:
    """Parameters moved by one collective. `values` is the padded flat buffer the parameters view; `shard` this
    rank's part of it (its own tensor when the whole is freed outside use); `grads` the whole gradients
    (accumulated units only); `shard_grad` this rank's averaged gradient. An accumulated unit may be
    `reduced_in_finish` (never by the backward's hooks) or `all_reduced_whole` (all-reduced even when sharded).
    A stage-3 unit whose parameters all have a `wire` format (GatherFormat) is gathered in it, into `wire_values`,
    and `values` is never made whole."""

    def __init__(self, index: int, module: nn.Module | None, params: list[nn.Parameter], size: int, rank: int,
                 sharded: bool, accumulate: bool, reduced_in_finish: bool = False, all_reduced_whole: bool = False,
                 wire=None):
        self.index, self.module, self.params, self.wire = index, module, params, wire
        self.sharded, self.accumulate = sharded, accumulate
        self.reduced_in_finish, self.all_reduced_whole = reduced_in_finish, all_reduced_whole
        numel = sum(p.numel() for p in params)
        self.padded = -(-numel // size) * size if sharded else numel
        self.shard_lo, self.shard_size = (rank * (self.padded // size), self.padded // size) if sharded else (0, numel)
        self.offsets, offset = {}, 0
        for p in params:
            self.offsets[id(p)] = offset
            offset += p.numel()
        self.values = self.shard = self.grads = self.shard_grad = self._pieces = None
        self.wire_values = self.wire_shard = None
        self.num_ready, self.handle = 0, None
        self.gather_work, self.gathered, self.pending_backwards = None, True, 0   # stage 3

    def build(self, device, own_shard: bool) -> None:
        """Move the parameters into `values` (their .data becomes a view of it); an accumulated unit's gradients
        into `grads`."""
        self.values = torch.zeros(self.padded, dtype=torch.float32, device=device)
        for p in self.params:
            self.values[self.offsets[id(p)]:self.offsets[id(p)] + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.view(self.values, p)
        self.shard = self.values[self.shard_lo:self.shard_lo + self.shard_size]
        if own_shard:
            self.shard = self.shard.clone()
        if self.wire is not None:
            self.wire_values = torch.zeros(self.padded, dtype=self.wire.dtype, device=device)
        if self.accumulate:
            self.grads = torch.zeros_like(self.values)
            self.shard_grad = self.grads[self.shard_lo:self.shard_lo + self.shard_size]

    def view(self, flat: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
        return flat[self.offsets[id(p)]:self.offsets[id(p)] + p.numel()].view_as(p)

    def pieces(self) -> list[ShardPiece]:
        """The parts of its parameters in this rank's shard, in buffer order (made once: their views of
        `shard_grad` stay valid while its storage is freed between steps)."""
        if self._pieces is None:
            self._pieces = self._make_pieces()
        return self._pieces

    def _make_pieces(self) -> list[ShardPiece]:
        out, lo, hi = [], self.shard_lo, self.shard_lo + self.shard_size
        for p in self.params:
            offset = self.offsets[id(p)]
            a, b = max(lo, offset), min(hi, offset + p.numel())
            if a < b:
                out.append(ShardPiece(p, a - offset, b - offset, self.shard[a - lo:b - lo],
                                      self.shard_grad[a - lo:b - lo]))
        return out


@dataclass(frozen=True)
class ZeroStage:
    """optimizer.zero_stage: what each rank keeps of the optimizer state, the gradients and the parameters."""
    number: int

    @property
    def shards_state(self) -> bool:
        return self.number >= 1

    @property
    def shards_gradients(self) -> bool:
        return self.number >= 2

    @property
    def shards_parameters(self) -> bool:
        return self.number == 3

    def collectives(self, micro_batches: int, reshard_after_forward: bool = True) -> dict[str, int]:
        """The passes of the parameters' bytes a step moves over the group, by collective (each pass sends
        (n-1)/n of them): stage 0 one all-reduce (two passes); stage 1 a reduce-scatter and an all-gather; stage 2 a
        reduce-scatter per micro-batch and one all-gather; stage 3 per micro-batch a reduce-scatter and an
        all-gather before backward, and one before each forward unless units stay gathered."""
        m = micro_batches
        return [{"all_reduce": 2}, {"reduce_scatter": 1, "all_gather": 1}, {"reduce_scatter": m, "all_gather": 1},
                {"reduce_scatter": m, "all_gather": m * (1 + reshard_after_forward)}][self.number]


class GatherFormat(Protocol):
    """How ZeRO-3 gathers the parameters a number format `takes` (model.fp8.gather_in_fp8: numerics/fp8_gather.py):
    each rank `encode`s its shard of a unit into `dtype` elements, the engine all-gathers them into the unit's
    `wire_values`, `decode` hands them to the layers, and `release` takes them back before the buffer is freed."""
    dtype: torch.dtype

    def takes(self, param: nn.Parameter) -> bool: ...

    def encode(self, unit: Unit, group) -> torch.Tensor: ...

    def decode(self, unit: Unit) -> None: ...

    def release(self, unit: Unit) -> None: ...


def average(grads: list[torch.Tensor], replicas, average_over: int, trace) -> None:
    """End a step's reduction of `grads` (each summed over its shard group) in place: under hybrid sharding summed
    over the `replicas` holding the same shards (an Axis, None without: once a step, every all-reduce posted before
    any is waited for, in unit order on every rank), then divided by `average_over` (dp x cp)."""
    if replicas is not None:
        with trace.span("replica_all_reduce_wait"):
            all_reduce_each(grads, replicas.group)
    for grad in grads:
        grad.div_(average_over)
