"""ZeRO: AdamW whose optimizer state is sharded across the ranks that hold the same weights (dp x cp).

The parameters and gradients live in the flat buffers of GradientSync (gradient_sync.py): after backward a
reduce-scatter has left on each rank the averaged gradient of its 1/(dp·cp) of every bucket (ZeRO-1) or unit
(ZeRO-2/3, sharded_buffers.py). This optimizer is torch's AdamW over those shard pieces (views of the buffers,
so Adam's elementwise math is exactly AdamW's on the whole model), keeping exp_avg / exp_avg_sq for 1/(dp·cp)
of the parameters: 8N/(dp·cp) bytes instead of 8N. After the update GradientSync all-gathers the parameters
(ZeRO-1/2; ZeRO-3 gathers each layer when it next runs). Per step at stage 1 and 2: one reduce-scatter and one
all-gather, the bytes of one all-reduce.
"""
from __future__ import annotations

import torch

from nanoexp.parallel.gradient_sync import GradientSync


class ZeroAdamW:
    """torch.optim.AdamW over this rank's shard of `grad_sync`'s buffers.

    `param_groups(params)` gives torch-style groups of model parameters (with their lr, weight
    decay, ...); each shard piece joins the group of its parameter, so `param_groups` here are
    torch's (set `g["lr"]` before `step()`). `pieces` are the ShardPieces in state order: what
    checkpoints save and load, with `state[piece.value]` holding that piece's AdamW moments."""

    def __init__(self, grad_sync: GradientSync, groups: list[dict], **adamw):
        self.grad_sync = grad_sync
        self.pieces = grad_sync.shard_pieces()
        piece_groups = [{**g, "params": []} for g in groups]
        group_of = {id(p): piece_groups[i] for i, g in enumerate(groups) for p in g["params"]}
        for piece in self.pieces:
            piece.value.grad = piece.grad   # the optimizer reads the averaged shard from here
            group_of[id(piece.param)]["params"].append(piece.value)
        self.inner = torch.optim.AdamW([g for g in piece_groups if g["params"]], **adamw)
        self.param_groups, self.state, self.defaults = self.inner.param_groups, self.inner.state, self.inner.defaults

    @property
    def num_steps(self) -> int:
        """Updates applied so far (AdamW's bias-correction step)."""
        steps = [int(s["step"].item()) for s in self.state.values() if "step" in s]
        return max(steps, default=0)   # the largest: a parameter loaded without state counts from 0

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        self.grad_sync.gather_parameters()

    def zero_grad(self, set_to_none: bool = False) -> None:
        self.grad_sync.zero_grad()
