"""The gathered path of a ZeRO engine (ZeRO-3): parameters held as this rank's shard, each module's whole weights
all-gathered only while it runs, with the next ones prefetched. The rules and why: docs/zero.md."""
from __future__ import annotations

import torch

from nanoexp.parallel.collectives import all_gather_into
from nanoexp.parallel.zero.scattered import ScatteredGradients
from nanoexp.parallel.zero.units import Unit


class GatheredParameters:
    """ZeRO-3's parameters of one engine: the scattered units (one per module), whole only while their module runs.

    A unit's flat buffer is freed (storage resized to zero; the parameters stay views of it) except while it runs:
    a forward pre-hook gathers it, a hook on its output's gradient gathers it again as its backward starts (and
    reduce-scatters the units after it: their backward is done), and the `prefetch` units that run next are
    gathered meanwhile. After the forward (with `reshard_after_forward`, else after its last pending backward) and
    after the backward it is freed. Gathers are tied to the modules' order, never to when a gradient arrives. A
    backward split into B and W (zb_h1): B gathers each unit's weights as its backward starts, frees them after."""

    def __init__(self, scattered: ScatteredGradients, group, prefetch: int, reshard_after_forward: bool, trace):
        self.scattered, self.units, self.group, self.trace = scattered, scattered.units, group, trace
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        self.in_input_backward, self._whole_for_b = False, []   # a B step, the units it gathered
        scattered.gathered = self
        for unit in self.units:
            self._free(unit)
            unit.module.register_forward_pre_hook(lambda module, args, unit=unit: self._before_forward(unit))
            unit.module.register_forward_hook(lambda module, args, out, unit=unit: self._after_forward(unit, out))

    # -- gathering and freeing -----------------------------------------------------------------------
    def _gather(self, unit: Unit) -> None:
        """Post the all-gather of `unit` (nothing if it is whole or on its way)."""
        if unit.gathered or unit.gather_work is not None:
            return
        whole, shard = (unit.values, unit.shard) if unit.wire is None else (unit.wire_values,
                                                                          unit.wire.encode(unit, self.group))
        whole.untyped_storage().resize_(unit.padded * whole.element_size())
        unit.gather_work = all_gather_into(whole, shard, self.group, async_op=True)
        unit.wire_shard = shard   # kept until the gather lands
        self.trace.mark("gather_launch", unit=unit.index)

    def _wait_gathered(self, unit: Unit) -> None:
        self._gather(unit)
        if unit.gather_work is not None:
            with self.trace.span("gather_wait", unit=unit.index):
                unit.gather_work.wait()
            unit.gather_work, unit.gathered, unit.wire_shard = None, True, None
            if unit.wire is not None:
                unit.wire.decode(unit)

    def _free(self, unit: Unit) -> None:
        if unit.gather_work is not None:   # a prefetch nobody used: let it land first
            self._wait_gathered(unit)
        if unit.wire is not None:
            unit.wire.release(unit)
            unit.wire_values.untyped_storage().resize_(0)
        unit.values.untyped_storage().resize_(0)
        unit.gathered = False

    def _use(self, unit: Unit, step: int) -> None:
        """Make `unit` whole now, and post the gathers of the `prefetch` units that run next (`step`: +1 in
        forward, -1 in backward)."""
        self._wait_gathered(unit)
        for k in range(1, self.prefetch + 1):
            if 0 <= unit.index + step * k < len(self.units):
                self._gather(self.units[unit.index + step * k])

    # -- the hooks around each module ----------------------------------------------------------------
    def _before_forward(self, unit: Unit) -> None:
        if self.scattered.in_backward or self.in_input_backward:   # a recomputed forward: already whole
            self._wait_gathered(unit)
        else:
            self._use(unit, +1)

    def _after_forward(self, unit: Unit, out) -> None:
        if self.scattered.in_backward or self.in_input_backward:
            return
        if isinstance(out, torch.Tensor) and out.requires_grad:
            unit.pending_backwards += 1
            out.register_hook(lambda grad, unit=unit: self._before_backward_of(unit))
        if self.reshard_after_forward or unit.pending_backwards == 0:
            self._free(unit)

    def _before_backward_of(self, unit: Unit) -> None:
        """As `unit`'s backward starts (its output's gradient is complete, so the units after it are done):
        reduce-scatter those, then make `unit` whole and prefetch. In a B step: free those instead (their
        gradients go in W)."""
        if self.in_input_backward:
            while self._whole_for_b and self._whole_for_b[-1].index > unit.index:
                self.after_backward_of(self._whole_for_b.pop())
            self._whole_for_b.append(unit)
        else:
            self.scattered.reduce(flush=True, stop=unit.index + 1)
        self._use(unit, -1)

    def after_backward_of(self, unit: Unit) -> None:
        unit.pending_backwards = max(unit.pending_backwards - 1, 0)
        if self.reshard_after_forward or unit.pending_backwards == 0:
            self._free(unit)

    # -- a backward split into B and W (split_backward) ----------------------------------------------
    def before_input_backward(self) -> None:
        """A B step: each unit's weights are gathered as its backward starts and freed after; the gradients wait
        in .grad for the reduce-scatters of the next W (which needs the weights of no unit)."""
        self.in_input_backward = True

    def after_input_backward(self) -> None:
        while self._whole_for_b:
            self.after_backward_of(self._whole_for_b.pop())
        self.in_input_backward = False
