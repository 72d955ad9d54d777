"""ZeRO-1: AdamW whose optimizer state is sharded across the data-parallel group.

The parameters and gradients live in the flat, bucketed buffers of `GradientBuckets`
(data_parallel.py, `shard=True`): after backward a reduce-scatter leaves on each rank the averaged
gradient of its 1/dp of every bucket. This optimizer is torch's AdamW over those shard pieces
(views of the buffers, so Adam's elementwise math is exactly AdamW's on the whole model), keeping
exp_avg / exp_avg_sq for 1/dp of the parameters: 8N/dp bytes instead of 8N. After the update an
in-place all-gather per bucket gives every rank all updated parameters. Per step: one
reduce-scatter and one all-gather, the bytes of one all-reduce.
"""
from __future__ import annotations

import torch

from nanoexp.parallel.data_parallel import GradientBuckets, collective


class ZeroAdamW:
    """torch.optim.AdamW over this rank's shard of `grad_syncs`' buffers.

    `param_groups(params)` gives torch-style groups of model parameters (with their lr, weight
    decay, ...); each shard piece joins the group of its parameter, so `param_groups` here are
    torch's (set `g["lr"]` before `step()`). `pieces` are the ShardPieces in state order: what
    checkpoints save and load, with `state[piece.value]` holding that piece's AdamW moments."""

    def __init__(self, grad_syncs: list[GradientBuckets], groups: list[dict], **adamw):
        self.grad_syncs = grad_syncs
        self.pieces = [piece for sync in grad_syncs for piece in sync.shard_pieces()]
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
        steps = [s["step"] for s in self.state.values() if "step" in s]
        return int(steps[0].item()) if steps else 0

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        handles = []
        for sync in self.grad_syncs:
            if not sync.enabled:
                continue
            for bucket in sync.buckets:
                lo, hi = sync.shard_range(bucket)
                full = sync.values[bucket.start:bucket.start + bucket.numel]
                all_gather = collective("all_gather_single", "all_gather_into_tensor")
                handles.append(all_gather(full, sync.values[lo:hi], group=sync.group, async_op=True))
        for handle in handles:
            handle.wait()

    def zero_grad(self, set_to_none: bool = False) -> None:
        for sync in self.grad_syncs:
            sync.zero_grad()
