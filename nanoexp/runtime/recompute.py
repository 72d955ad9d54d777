"""What each decoder layer keeps for backward: activation recomputation and offload (parallelism.recompute,
recompute_every, selective_ops, offload_activations; docs/memory.md#activation-recomputation).

`apply_recompute(model, policy, device)` replaces the forward of each layer the policy names by one that runs under
torch.utils.checkpoint (non-reentrant): `full` keeps the layer's input and runs its forward again in backward;
`selective` keeps besides the outputs of the ops `selective_ops` names (torch's selective checkpoint policy) and runs
the others again; `every_k` recomputes layers k-1, 2k-1, ... in full and leaves the others alone. The module stays
where it was (parameter names, hooks, ZeRO units), and model.compile, applied after, compiles the checkpoint with
the layer, so the compiled backward follows the same policy. Recomputation repeats the same ops on the same inputs:
the gradients are `none`'s, bit for bit. With offload, a layer that keeps its activations (none, every_k's others)
moves them to pinned host memory as the forward saves them and back ahead of its backward (ActivationOffload).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from nanoexp.config import recompute_mode
from nanoexp.model.saved_ops import saved_ops
from nanoexp.runtime.offload import ActivationOffload


@dataclass(frozen=True)
class RecomputePolicy:
    """Which layers run their forward again in backward, and what the recomputed ones keep."""
    mode: str = "none"                          # none | full | selective | every_k
    every: int = 2                              # every_k: layers every-1, 2·every-1, ... are recomputed
    saved: tuple[str, ...] = ("matmul", "attention")   # selective: the op groups kept (model/saved_ops.py)
    offload: bool = False                       # the layers that keep their activations keep them on the host

    @classmethod
    def from_config(cls, cfg) -> "RecomputePolicy":
        p = cfg.parallelism
        return cls(recompute_mode(cfg), int(p.get("recompute_every", 2)),
                   tuple(p.get("selective_ops", cls.saved)), bool(p.get("offload_activations", False)))

    def recomputes(self, n: int) -> bool:
        """Whether layer n (its global index) runs its forward again in backward."""
        return self.mode in ("full", "selective") or (self.mode == "every_k" and n % self.every == self.every - 1)

    def share(self, layers) -> float:
        """The fraction of `layers` (global indices) that run their forward again in backward."""
        layers = list(layers)
        return sum(map(self.recomputes, layers)) / len(layers) if layers else 0.0

    def describe(self, layers: int) -> str | None:
        """The console's line for a model of `layers` layers (None: none without offload, the default)."""
        offload = "; the layers not recomputed keep their activations in pinned host memory" if self.offload else ""
        if self.mode == "none":
            return f"activations: every layer keeps its own{offload}" if offload else None
        if self.mode == "every_k":
            chosen = [n for n in range(layers) if self.recomputes(n)]
            return (f"activations: recomputed in backward for layers {', '.join(map(str, chosen))} (every "
                    f"{self.every}), each keeping its input; the others keep their own{offload}")
        kept = f" and the outputs of its {' and '.join(self.saved)} ops" if self.mode == "selective" else ""
        return f"activations: recomputed in backward ({self.mode}): each layer keeps its input{kept}"

    def layer_mode(self, n: int) -> str:
        """What layer n does: none, full or selective (every_k's chosen layers are full, the others none)."""
        if self.mode == "every_k":
            return "full" if self.recomputes(n) else "none"
        return self.mode

    def keeps(self, group: str) -> bool:
        """Whether a recomputed layer keeps the outputs of op group `group` (model/saved_ops.py)."""
        return self.mode == "selective" and group in self.saved

    def checkpoint(self):
        """torch.utils.checkpoint as this policy runs it: non-reentrant, with selective's caching of the kept ops
        (a partial, as model.compile's tracing of checkpoint takes it)."""
        if self.mode != "selective":
            return functools.partial(checkpoint, use_reentrant=False)
        kept = saved_ops(self.saved)

        def keep(ctx, op, *args, **kwargs) -> CheckpointPolicy:   # torch's selective policy: kept ops are stored
            return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

        def contexts():
            return create_selective_checkpoint_contexts(keep)
        return functools.partial(checkpoint, use_reentrant=False, context_fn=contexts)


class Checkpointed:
    """A layer's forward run under activation checkpointing while autograd records (plain in evaluation)."""

    def __init__(self, forward, checkpoint_fn):
        self.forward, self.checkpoint = forward, checkpoint_fn

    def __call__(self, *inputs):
        if not torch.is_grad_enabled():
            return self.forward(*inputs)
        return self.checkpoint(self.forward, *inputs)


class Offloaded:
    """A layer's forward whose saved tensors go to the host (ActivationOffload) while autograd records."""

    def __init__(self, forward, offload: ActivationOffload, n: int):
        self.forward, self.offload, self.n = forward, offload, n

    def __call__(self, *inputs):
        if not torch.is_grad_enabled():
            return self.forward(*inputs)
        with self.offload.saving(self.n):
            return self.forward(*inputs)


def apply_recompute(model, policy: RecomputePolicy, device: torch.device) -> None:
    """Give each decoder layer of `model` the forward `policy` asks for (before model.compile)."""
    offload = ActivationOffload(device) if policy.offload else None
    for n, layer in model.model.layers.items():
        if policy.recomputes(int(n)):
            layer.forward = Checkpointed(layer.forward, policy.checkpoint())
        elif offload is not None:
            layer.forward = Offloaded(layer.forward, offload, int(n))


def offload_problem(cfg, device_type: str) -> str | None:
    """Why parallelism.offload_activations cannot run on `device_type` (None: it can)."""
    if cfg.parallelism.get("offload_activations", False) and device_type != "cuda":
        return (f"parallelism.offload_activations=true: this run's device is the {device_type}, whose memory is the "
                "host's already (nothing to offload to): set it false, or run on a GPU")
    return None
