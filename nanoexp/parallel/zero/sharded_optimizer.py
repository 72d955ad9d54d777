"""ZeRO's optimizer: any torch optimizer whose update is element-wise (AdamW, Adam, SGD, ...) over this rank's
shard of the ZeRO engines' buffers (engine.py): its state exists for 1/(dp·cp) of the parameters.

After backward a reduce-scatter has left on each rank the averaged gradient of its shard of every unit; the
shard's pieces are views of the buffers, one per parameter part, so each joins its parameter's group (learning
rate, weight decay) and the optimizer's element-wise math is exactly its math on the whole model. After the update
the engine all-gathers the parameters (ZeRO-1/2; ZeRO-3 gathers each layer when it next runs).
"""
from __future__ import annotations

import torch

from nanoexp.parallel.gradient_sync import GradientSync


class ShardedOptimizer:
    """`optimizer_class(groups, **options)` over this rank's shard of `grad_sync`'s buffers.

    `groups` are torch-style groups of model parameters (with their lr, weight decay, ...); each shard piece
    joins the group of its parameter, so `param_groups` here are torch's (set `g["lr"]` before `step()`).
    `pieces` are the ShardPieces in state order: what checkpoints save and load, `state[piece.value]` holding
    that piece's state by key."""

    def __init__(self, grad_sync: GradientSync, groups: list[dict], optimizer_class=torch.optim.AdamW, **options):
        self.grad_sync = grad_sync
        self.pieces = grad_sync.shard_pieces()
        piece_groups = [{**g, "params": []} for g in groups]
        group_of = {id(p): piece_groups[i] for i, g in enumerate(groups) for p in g["params"]}
        for piece in self.pieces:
            piece.value.grad = piece.grad   # the optimizer reads the averaged shard from here
            piece.value.piece = piece       # and which parameter, which range (Muon puts matrices together)
            group_of[id(piece.param)]["params"].append(piece.value)
        self.inner = optimizer_class([g for g in piece_groups if g["params"]], **options)
        self.param_groups, self.state, self.defaults = self.inner.param_groups, self.inner.state, self.inner.defaults

    @property
    def num_steps(self) -> int:
        """Updates applied so far (the largest "step" in the state: a piece loaded without state counts from 0)."""
        steps = [int(s["step"].item()) for s in self.state.values() if "step" in s]
        return max(steps, default=0)

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        self.grad_sync.gather_parameters()

    def zero_grad(self, set_to_none: bool = False) -> None:
        self.grad_sync.zero_grad()
