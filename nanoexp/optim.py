"""AdamW parameter groups (with µP's per-group learning rates), the learning-rate schedule, and clipping
by the true global norm."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from nanoexp.model.mup import GROUPS, STANDARD, Parametrization, parametrization_of
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.placement import counted_here, value_name
from nanoexp.parallel.zero import ZeroAdamW


def parameter_groups(model: nn.Module, weight_decay: float, parametrization: Parametrization = STANDARD) -> list[dict]:
    """Weight decay on matrices only: norms (and biases, if any) are 1-D and are not decayed. Each group
    has its `lr_scale` (the µP multiplier on the scheduled rate, see set_lr); standard has two groups,
    matrices and vectors, µP splits the hidden matrices off the matrices."""
    members: dict[str, list] = {group: [] for group in GROUPS}
    for name, param in model.named_parameters():
        members[parametrization.group(value_name(name, param), param.ndim)].append(param)
    return [{"params": params, "weight_decay": 0.0 if group == "vectors" else weight_decay,
             "lr_scale": parametrization.lr_scale(group), "group": group}
            for group, params in members.items() if params]


def build_optimizer(cfg, model: nn.Module, ctx: ParallelContext):
    """torch AdamW (foreach or fused), or ZeRO-1 AdamW with state sharded over dp."""
    o = cfg.optimizer
    f = o.optimizer_factory
    groups = parameter_groups(model, o.weight_decay, parametrization_of(cfg))
    lr = o.learning_rate_scheduler.learning_rate
    betas = (f.adam_beta1, f.adam_beta2)
    if o.zero_stage == 1:
        return ZeroAdamW(groups, ctx.dp_group, ctx.dp_rank, ctx.dp, lr=lr, betas=betas, eps=f.adam_eps,
                         weight_decay=o.weight_decay)
    fused = bool(f.torch_adam_is_fused)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=f.adam_eps, fused=fused or None,
                             foreach=None if fused else True)


def min_decay_lr(cfg) -> float:
    """The rate the decay ends at: optimizer.learning_rate_scheduler.min_decay_lr, or half the peak if null."""
    s = cfg.optimizer.learning_rate_scheduler
    return s.min_decay_lr if s.min_decay_lr is not None else 0.5 * s.learning_rate


def lr_at(step: int, cfg) -> float:
    """The learning rate used by the update of optimizer step `step` (the first step is 1)."""
    s = cfg.optimizer.learning_rate_scheduler
    peak, warmup = s.learning_rate, s.lr_warmup_steps
    if step <= warmup:
        return peak * step / warmup if s.lr_warmup_style == "linear" else peak
    decay_steps = s.lr_decay_steps or max(cfg.tokens.train_steps - warmup, 1)
    progress = min((step - warmup) / decay_steps, 1.0)
    floor = min_decay_lr(cfg)
    if s.lr_decay_style == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if s.lr_decay_style == "linear":
        return peak - (peak - floor) * progress
    return peak


def set_lr(optimizer, lr: float) -> None:
    """Every group trains at the scheduled `lr` times its lr_scale (µP: 1/m for hidden matrices)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


@torch.no_grad()
def global_grad_norm(params: list[nn.Parameter], ctx: ParallelContext) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, each parameter counted once across tp and pp
    (gradients are already identical across dp)."""
    grads = [p.grad.float() for p in params if p.grad is not None and counted_here(p, ctx.tp_rank)]
    device = params[0].device if params else torch.device("cpu")
    sq = torch.stack([g.pow(2).sum() for g in grads]).sum() if grads else torch.zeros((), device=device)
    if ctx.model_parallel_group is not None and ctx.tp * ctx.pp > 1:
        dist.all_reduce(sq, group=ctx.model_parallel_group)
    return sq.sqrt()


@torch.no_grad()
def clip_gradients(params: list[nn.Parameter], max_norm: float | None, ctx: ParallelContext) -> float:
    """Scale the gradients so that the global norm is at most max_norm; returns the norm before."""
    norm = global_grad_norm(params, ctx)
    if max_norm is not None:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, scale)
    return norm.item()
