"""Replay checks for silent data corruption (a bit flipped in a processor's arithmetic: a wrong gradient and no
error). Every `health.replay_every` steps each rank runs the step's forward and backward twice on the same batch
and compares, bit for bit, every gradient the two backwards hand to each of its parameters (every micro-batch's,
before any reduction mixes in other ranks': so the rank is named) and the losses. The first pass runs as a whole
step's would, its gradient reductions included; its gradients are then dropped (GradientSync.zero_grad) and the
second pass is the step's. Each gradient is compared through a digest of its bits, two 64-bit sums (of its
elements read as integers, and of their squares): a single flipped bit always changes the first. A mismatch is
agreed in the step's one all-reduce and names the rank and the parameter; `health.replay_action` stops the run or
drops the step's update. Exact on CPU; on CUDA only with deterministic kernels, which this turns on
(torch.use_deterministic_algorithms: a kernel without a deterministic version then raises).
"""
from __future__ import annotations

import functools
import socket

import torch
import torch.distributed as dist

from nanoexp.health import Finding
from nanoexp.runtime.seams import wrap_method

AS_INTEGERS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}   # by element size


def digest(tensor: torch.Tensor) -> torch.Tensor:
    """[2] int64 on the tensor's device: the sums of its elements' bits read as integers and of their squares."""
    bits = tensor.detach().contiguous().view(AS_INTEGERS[tensor.element_size()]).reshape(-1).to(torch.int64)
    return torch.stack([bits.sum(), (bits * bits).sum()])


class ReplayCheck:
    """The replay check of `trainer` (health.replay_every and replay_action in `h`)."""

    def __init__(self, h, trainer):
        self.trainer, self.every, self.action = trainer, h.replay_every, h.replay_action
        self.params = [(name, p) for name, p in trainer.model.named_parameters() if p.requires_grad]
        self.names: list[str] = []          # what the last replay compared, in order
        self.differs = None                 # [len(names)] bool on the device: which of them differed
        if trainer.ctx.device.type == "cuda":
            torch.use_deterministic_algorithms(True)

    def install(self, monitor) -> None:
        self.monitor = monitor
        wrap_method(self.trainer, "forward_backward", self.forward_backward)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def forward_backward(self, original, micro_batches: list[dict]) -> list[torch.Tensor]:
        """Both passes; the second's losses and gradients are the step's."""
        if not self.due(self.trainer.step):
            return original(micro_batches)
        first = self.digests(original, micro_batches)
        self.trainer.grad_sync.finish()       # the first pass's reductions land ...
        self.trainer.grad_sync.zero_grad()    # ... and its gradients are dropped
        moe = self.trainer.model.moe_losses
        if moe:
            moe.records.clear()               # its MoE loads would count twice
        second = self.digests(original, micro_batches)
        self.compare(first, second)
        return second["loss"]

    def digests(self, original, micro_batches: list[dict]) -> dict:
        """One pass: {parameter name: digest of each gradient it received, in order}, and "loss": its losses."""
        seen: dict[str, list] = {}

        def keep(name: str, grad: torch.Tensor) -> None:
            seen.setdefault(name, []).append(digest(grad))

        hooks = [p.register_hook(functools.partial(keep, name)) for name, p in self.params]
        try:
            losses = original(micro_batches)
        finally:
            for hook in hooks:
                hook.remove()
        seen["loss"] = losses
        return seen

    def compare(self, first: dict, second: dict) -> None:
        """Which parameters (and the losses) differ between the passes, on the device (no host read)."""
        first["loss"] = [digest(loss) for loss in first["loss"]]
        second = {**second, "loss": [digest(loss) for loss in second["loss"]]}
        self.names = sorted(set(first) | set(second), key=lambda name: (name != "loss", name))
        device = self.trainer.ctx.device
        flags = []
        for name in self.names:
            a, b = first.get(name, []), second.get(name, [])
            flags.append((torch.stack(a) != torch.stack(b)).any() if len(a) == len(b) and a
                         else torch.tensor(len(a) != len(b), device=device))
        self.differs = torch.stack(flags)

    def maxima(self, step: int) -> torch.Tensor:
        """At a replay step, [world]: 1 in this rank's slot when a gradient differed."""
        ctx = self.trainer.ctx
        if not self.due(step):
            return torch.zeros(0, device=ctx.device)
        values = torch.zeros(ctx.world_size, device=ctx.device)
        values[ctx.rank] = self.differs.any().float()
        return values

    def read(self, step: int, values: list[float], loss: float) -> None:
        if not any(values):
            return
        ctx = self.trainer.ctx
        differs = self.differs.tolist() if values[ctx.rank] else []   # a host read only where something differed
        names = [name for name, differed in zip(self.names, differs) if differed]
        everyone = [(names, socket.gethostname())] * ctx.world_size
        if ctx.world_size > 1:   # rare: only after a mismatch, on every rank
            dist.all_gather_object(everyone, everyone[0])
        findings = [self.finding(step, rank, names, host) for rank, (names, host) in enumerate(everyone) if names]
        for finding in findings:
            self.monitor.report(finding)
        if self.action == "stop":
            self.monitor.stop(f"step {step}: {findings[0].line.split(': ', 1)[1]} (health.replay_action=skip drops "
                              "such a step instead)")
        self.monitor.drop("a replay mismatch")

    def finding(self, step: int, rank: int, names: list[str], host: str) -> Finding:
        then = "the run stops" if self.action == "stop" else "update skipped"
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        what = "loss" if names[0] == "loss" else "gradient"
        line = (f"replay mismatch: rank {rank} on {host} computed another {what} for {names[0]}{more} on the same "
                f"batch, a silent data corruption: {then}")
        return Finding("replay", step, line, {"rank": rank, "host": host, "parameter": names[0],
                                               "parameters": len(names)})
