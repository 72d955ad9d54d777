"""A run's optimizer, built from the registry (nanoexp/optim/registry.py): its parameter groups (with µP's
per-group learning rates), ZeRO's sharded wrapper when optimizer.zero_stage >= 1, and clipping by the true global
norm over the run's process groups."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from nanoexp.config import optimizer_name
from nanoexp.model.mup import GROUPS, STANDARD, Parametrization
from nanoexp.model.placement import value_name
from nanoexp.optim.registry import OPTIMIZERS, optimizer_parametrization
from nanoexp.parallel.gradient_sync import GradientSync
from nanoexp.parallel.zero.sharded_optimizer import ShardedOptimizer


def parameter_groups(model: nn.Module, weight_decay: float, parametrization: Parametrization = STANDARD) -> list[dict]:
    """Weight decay on matrices only: norms (and biases, if any) are 1-D and are not decayed. Each group
    has its `lr_scale` (the µP multiplier on the scheduled rate, see optim/schedule.py's set_lr); standard has two
    groups, matrices and vectors, µP splits the hidden matrices off the matrices."""
    members: dict[str, list] = {group: [] for group in GROUPS}
    for name, param in model.named_parameters():
        members[parametrization.group(value_name(name, param), param.ndim)].append(param)
    return [{"params": params, "weight_decay": parametrization.weight_decay(group, weight_decay),
             "lr_scale": parametrization.lr_scale(group), "group": group}
            for group, params in members.items() if params]


def build_optimizer(cfg, model: nn.Module, grad_sync: GradientSync | None = None):
    """The configured optimizer over the model's parameter groups, or, with optimizer.zero_stage >= 1, over this
    rank's shard of `grad_sync`'s buffers (ZeRO, parallel/zero/sharded_optimizer.py)."""
    o, entry = cfg.optimizer, OPTIMIZERS[optimizer_name(cfg)]
    optimizer_class, options = entry.build(cfg)
    groups = parameter_groups(model, o.weight_decay, optimizer_parametrization(cfg))
    if o.zero_stage >= 1 and grad_sync is None:
        raise ValueError(f"optimizer.zero_stage={o.zero_stage} shards the buffers of a GradientSync: pass one")
    options |= entry.rank_options(model, grad_sync, o.zero_stage)
    if o.zero_stage >= 1:
        return ShardedOptimizer(grad_sync, groups, optimizer_class, **options)
    return optimizer_class(groups, **options)


@torch.no_grad()
def clip_gradients(norm_inputs: tuple[list, list, object], max_norm: float | None, device) -> torch.Tensor:
    """Scale the gradients so that the global norm (each parameter counted once across tp and pp) is at
    most max_norm; returns the norm before, on the device (no host read: the trainer reads it with the step's
    other scalars). `norm_inputs`: GradientSync.norm_inputs (the gradients the
    update reads, those counted in the norm, the group their squares are summed over)."""
    grads, counted, group = norm_inputs
    sq = torch.stack([g.float().pow(2).sum() for g in counted]).sum() if counted else torch.zeros((), device=device)
    if group is not None:
        dist.all_reduce(sq, group=group)
    norm = sq.sqrt()
    if max_norm is not None:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm
