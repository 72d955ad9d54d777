"""ZeRO stage 1: AdamW whose optimizer state is sharded across the data-parallel group.

All parameters are laid out, group after group, in one flat float32 index space padded to
a multiple of dp_size. Rank r owns the contiguous slice [r*S, (r+1)*S), S = padded/dp, and
keeps exp_avg / exp_avg_sq only for that slice: optimizer memory drops from 2N to 2N/dp
floats per rank. Each step a rank updates its slice, then an all-gather of the equal-size
slices gives every rank all updated parameters.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.optim import Optimizer

# Newer torch renames all_gather_into_tensor (and warns about the old name).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ZeroAdamW(Optimizer):
    """AdamW (torch.optim.AdamW math, decoupled weight decay) with dp-sharded state.

    Promises:
      * `step()` expects grads already averaged over dp (identical on every rank) and
        leaves identical parameters on every rank, equal (up to float rounding) to what
        torch.optim.AdamW would produce from the same grads.
      * `param_groups` are torch-style dicts; setting `g["lr"]` (by hand or with any
        torch LR scheduler, this is an `Optimizer`) takes effect at the next step. Groups
        may override lr, betas, eps and weight_decay.
      * A missing grad counts as zeros (torch would skip that param). GradientBuckets
        always creates grads, so under dp>1 this never happens.
      * Params are re-read at every step, so loading model weights after building the
        optimizer is safe. There is no separate fp32 master copy: keep params float32.
      * `dp_size == 1` works without any communication.
    """

    def __init__(self, param_groups, dp_group, dp_rank: int, dp_size: int, lr: float = 1e-3,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(param_groups, defaults)
        self.dp_group, self.dp_rank, self.dp_size = dp_group, dp_rank, dp_size
        self.num_steps = 0

        # Flat layout: group after group, so each group is one contiguous range.
        self._offsets: list[list[int]] = []
        self._group_ranges: list[tuple[int, int]] = []
        total = 0
        for g in self.param_groups:
            start, offs = total, []
            for p in g["params"]:
                offs.append(total)
                total += p.numel()
            self._offsets.append(offs)
            self._group_ranges.append((start, total))
        self.total_numel = total
        self.shard_numel = math.ceil(total / dp_size) if total else 0
        self.shard_start = dp_rank * self.shard_numel
        self.shard_end = self.shard_start + self.shard_numel

        first = self.param_groups[0]["params"][0]
        device = first.device
        self.exp_avg = torch.zeros(self.shard_numel, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self._shard = torch.zeros_like(self.exp_avg)   # this rank's params, float32
        self._grad = torch.zeros_like(self.exp_avg)    # this rank's grads, float32
        # Gather target for every rank's slice (padding included); unused with dp == 1.
        self._flat = (torch.zeros(self.shard_numel * dp_size, dtype=torch.float32, device=device)
                      if dp_size > 1 else None)

        # Which pieces of which params fall into this rank's slice:
        # (param, start within param, end within param, start within shard).
        self.pieces = []
        for g, offs in zip(self.param_groups, self._offsets):
            for p, off in zip(g["params"], offs):
                lo, hi = max(off, self.shard_start), min(off + p.numel(), self.shard_end)
                if lo < hi:
                    self.pieces.append((p, lo - off, hi - off, lo - self.shard_start))
        # Per group: the local range of the shard it covers (may be empty).
        self._segments = []
        for gi, (gs, ge) in enumerate(self._group_ranges):
            lo, hi = max(gs, self.shard_start), min(ge, self.shard_end)
            if lo < hi:
                self._segments.append((gi, lo - self.shard_start, hi - self.shard_start))

    # -- the update -----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.num_steps += 1
        t = self.num_steps

        for p, a, b, s in self.pieces:
            self._shard[s:s + b - a].copy_(p.detach().reshape(-1)[a:b])
            if p.grad is None:
                self._grad[s:s + b - a].zero_()
            else:
                self._grad[s:s + b - a].copy_(p.grad.reshape(-1)[a:b])

        for gi, lo, hi in self._segments:
            g = self.param_groups[gi]
            lr, (beta1, beta2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
            param, grad = self._shard[lo:hi], self._grad[lo:hi]
            m, v = self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi]
            # Same operations, in the same order, as torch's single-tensor AdamW.
            if wd != 0:
                param.mul_(1 - lr * wd)
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step_size = lr / (1 - beta1 ** t)
            bias_correction2_sqrt = (1 - beta2 ** t) ** 0.5
            denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
            param.addcdiv_(m, denom, value=-step_size)

        if self.dp_size == 1:
            self._copy_back(self._shard)
        else:
            # Equal-size contiguous slices: what gloo's all-gather needs.
            _all_gather(self._flat, self._shard, group=self.dp_group)
            self._copy_back(self._flat)
        return loss

    def _copy_back(self, flat: torch.Tensor):
        for g, offs in zip(self.param_groups, self._offsets):
            for p, off in zip(g["params"], offs):
                p.copy_(flat[off:off + p.numel()].view_as(p))
