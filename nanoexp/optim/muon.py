"""Muon for the hidden matrices, AdamW for the rest, as one optimizer (`optimizer.optimizer_factory.name=muon`).

Muon (torch.optim.Muon's update: momentum, Nesterov, a Newton–Schulz orthogonalisation of the update direction,
its learning-rate adjustment, decoupled weight decay) takes the parameters `takes_muon` names; torch's AdamW takes
the others. Under tensor parallelism the momentum stays sharded like its weight (element-wise, and checkpoints
reshard it by placement), while the orthogonalisation needs the whole matrix: the update direction's shards are
all-gathered over tp, every tp rank orthogonalises the same whole matrix and keeps its slice; under ZeRO the
direction is first put together from the dp x cp ranks' flat pieces. The rule, the choice of gathering and what
is not built yet: docs/optimizers.md.
"""
from __future__ import annotations

import math
from collections.abc import MutableMapping
from types import SimpleNamespace

import torch
import torch.distributed as dist

from nanoexp.model.llama import EMBEDDING, LM_HEAD
from nanoexp.model.mup import ROUTER
from nanoexp.model.placement import local_slice, placement

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)   # torch.optim.Muon's (Keller Jordan's quintic)
EPS = 1e-7                                   # torch.optim.Muon's floor on the norm before the iteration


def takes_muon(name: str, param) -> bool:
    """Whether Muon updates `param` (named by the values it holds, placement.value_name): the 2-D hidden
    matrices (attention and MLP projections, shared experts) and the stacked routed experts (3-D: one matrix per
    expert, each orthogonalised alone). The embedding, the LM head, the MoE router and every vector (norms) go to
    AdamW: their rows are looked up or scored one by one, not used as a linear map."""
    return param.ndim in (2, 3) and name not in (EMBEDDING, LM_HEAD) and not name.endswith(ROUTER)


def updater(name: str, ndim: int) -> str:
    """What updates a parameter of `ndim` dimensions named `name` (the learning-rate table's column)."""
    return "muon" if takes_muon(name, SimpleNamespace(ndim=ndim)) else "adamW"


def state_bytes(hidden_share: float) -> float:
    """Bytes of state per element it updates: one float32 momentum on the hidden matrices (`hidden_share` of the
    elements), AdamW's two moments on the rest (docs/memory.md)."""
    return 8 - 4 * hidden_share


ADJUST_LR_FNS = ("original", "match_rms_adamw")   # optimizer.optimizer_factory.muon_adjust_lr_fn


def problems(cfg) -> list[str]:
    """Why Muon's settings cannot run, one line each naming the key (docs/optimizers.md)."""
    f, key = cfg.optimizer.optimizer_factory, "optimizer.optimizer_factory."
    out = [] if f.muon_adjust_lr_fn in ADJUST_LR_FNS else [
        f"{key}muon_adjust_lr_fn={f.muon_adjust_lr_fn}: allowed values are {', '.join(ADJUST_LR_FNS)}"]
    if len(f.muon_ns_coefficients) != 3:
        out.append(f"{key}muon_ns_coefficients={list(f.muon_ns_coefficients)}: must be three numbers (a, b, c)")
    elif diverges(tuple(f.muon_ns_coefficients), f.muon_ns_steps):
        out.append(f"{key}muon_ns_coefficients={list(f.muon_ns_coefficients)}: the Newton–Schulz iteration "
                   f"diverges in {f.muon_ns_steps} steps (muon_ns_steps) on a unit-norm matrix, its singular values "
                   f"pass {DIVERGED:g}; torch's are {list(NS_COEFFICIENTS)}")
    if cfg.parallelism.dp_shard is not None:
        out.append(f"parallelism.dp_shard={cfg.parallelism.dp_shard}: Muon gathers its matrices over all of dp x cp "
                   "and has no hybrid sharding; use AdamW or parallelism.dp_shard=null")
    return out


DIVERGED = 1e3   # a singular value this far past 1 (where the iteration drives them) has diverged


def diverges(coefficients: tuple[float, float, float], steps: int) -> bool:
    """Whether `orthogonalise` blows up: it acts on each singular value s of the unit-norm matrix (0 < s <= 1)
    alone, s <- a·s + b·s³ + c·s⁵, so that polynomial iterated from every s in (0, 1] (float64, a fine grid)
    passes DIVERGED or stops being finite. Working coefficients stay below 2 (torch's: 1.21 at most)."""
    a, b, c = coefficients
    s = torch.linspace(0, 1, 4097, dtype=torch.float64)
    for _ in range(steps):
        s = a * s + b * s ** 3 + c * s ** 5
        if not bool((s.abs() <= DIVERGED).all()):   # NaN compares false: diverged too
            return True
    return False


def hidden_lr_scale(cfg, width_multiplier: float) -> float:
    """Under µP, the rate on the hidden matrices over the scheduled one at width multiplier m. Muon's update is
    orthogonal, spectral norm 1, times lr·sqrt(max(1, rows/cols)) with muon_adjust_lr_fn=original: the same at
    every width, the size µP's spectral condition asks (Yang, Simon and Bernstein, "A Spectral Condition for
    Feature Learning", 2023), so 1; match_rms_adamw multiplies it by 0.2·sqrt(max(rows, cols)): 1/sqrt(m)."""
    adjust = cfg.get("optimizer", {}).get("optimizer_factory", {}).get("muon_adjust_lr_fn", "original")
    return {"original": 1.0, "match_rms_adamw": width_multiplier ** -0.5}[adjust]


def lr_notes(cfg) -> list[str]:
    """What the learning-rate table adds under its rows."""
    return [f"muon: each matrix's rate is also scaled by its shape (muon_adjust_lr_fn="
            f"{cfg.optimizer.optimizer_factory.muon_adjust_lr_fn}; docs/optimizers.md)"]


def orthogonalise(update: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = 5, eps: float = EPS):
    """The quintic Newton–Schulz iteration X <- aX + (bA + cA²)X, A = XXᵀ, in bfloat16 on the wide orientation
    of the matrix scaled to unit Frobenius norm: about U·Vᵀ of update = U·S·Vᵀ (the singular values land near 1,
    not exactly on it). The same operations as torch.optim.Muon's, so that results agree bit for bit."""
    a, b, c = coefficients
    tall = update.shape[0] > update.shape[1]
    x = update.bfloat16()
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def orthogonalise_each(update: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = 5, eps: float = EPS):
    """`orthogonalise` of a matrix, or of each matrix of a stack [E, rows, columns] (routed experts) alone."""
    if update.ndim == 3:
        return torch.stack([orthogonalise(matrix, coefficients, steps, eps) for matrix in update])
    return orthogonalise(update, coefficients, steps, eps)


def adjusted_lr(lr: float, adjust_lr_fn: str, shape) -> float:
    """The rate of a whole matrix of `shape` (rows, columns): "original" keeps the update's RMS across aspect
    ratios (√max(1, rows/columns)); "match_rms_adamw" gives it AdamW's RMS (0.2·√max(rows, columns)). A stack of
    matrices: each one's."""
    rows, columns = shape[-2:]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, columns))
    return lr * math.sqrt(max(1.0, rows / columns))


def whole(shard: torch.Tensor, param, tp_group) -> torch.Tensor:
    """The whole matrix of a tp-split parameter's `shard` (all-gathered over tp along its split dimension)."""
    p = placement(param)
    if p.split_dim is None or p.parts == 1:
        return shard
    shards = [torch.empty_like(shard) for _ in range(p.parts)]
    dist.all_gather(shards, shard.contiguous(), group=tp_group)
    return torch.cat(shards, dim=p.split_dim)


def momentum_direction(grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
    """Element-wise (so it runs on any shard): the momentum buffer's update, and the direction to orthogonalise
    (Nesterov's look-ahead, or the buffer itself)."""
    buf = state.setdefault("momentum_buffer", torch.zeros_like(grad))
    buf.lerp_(grad, 1 - group["momentum"])
    return grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf


class TensorParallelMuon(torch.optim.Optimizer):
    """torch.optim.Muon's update on matrices that may be tp shards (their `placement`): the momentum is kept per
    shard, the orthogonalisation and the learning-rate adjustment see the whole matrix."""

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=NS_COEFFICIENTS, ns_steps=5, adjust_lr_fn="original", eps=EPS, tp_group=None):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, eps=eps)
        super().__init__(params, defaults)
        self.tp_group = tp_group

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            lr = group["lr"]
            for p in (p for p in group["params"] if p.grad is not None):
                direction = whole(momentum_direction(p.grad, self.state[p], group), p, self.tp_group)
                update = local_slice(orthogonalise_each(direction, group["ns_coefficients"], group["ns_steps"],
                                                        group["eps"]), p)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], direction.shape))


class ShardedMuon(TensorParallelMuon):
    """TensorParallelMuon's update under ZeRO, over this rank's shard `pieces` (parallel/zero/units.py ShardPiece: a
    range of a parameter's flattened elements) of the Muon `matrices`. The momentum stays sharded (element-wise);
    each matrix's update direction is put together from the pieces of every rank of `dp_group` (a routed expert's:
    of `expert_group`, the edp ranks holding it; an all-reduce of the pieces placed in zeros: every element is in
    exactly one rank's piece), then over tp, orthogonalised whole on every rank, and each rank applies its pieces'
    part. Every rank walks all `matrices` in one order, also
    those it holds no piece of, so the collectives pair."""

    def __init__(self, pieces, matrices, dp_group=None, tp_group=None, expert_group=None, **settings):
        super().__init__(pieces, tp_group=tp_group, **settings)
        self.matrices, self.dp_group, self.expert_group = matrices, dp_group, expert_group
        self.pieces_of = {id(m): [] for m in matrices}
        for group in self.param_groups:
            for value in group["params"]:
                self.pieces_of[id(value.piece.param)].append((value, group))

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for matrix in self.matrices:
            pieces = self.pieces_of[id(matrix)]
            flat = torch.zeros(matrix.numel(), dtype=torch.float32, device=matrix.device)
            for value, group in pieces:
                flat[value.piece.start:value.piece.end] = momentum_direction(value.grad, self.state[value], group)
            shard_group = self.expert_group if placement(matrix).expert else self.dp_group   # who shards it (ZeRO)
            if shard_group is not None and dist.get_world_size(shard_group) > 1:
                dist.all_reduce(flat, group=shard_group)
            direction = whole(flat.view(matrix.shape), matrix, self.tp_group)
            if not pieces:   # no piece here: the collectives above were this rank's part
                continue
            ns = pieces[0][1]   # the Newton–Schulz settings are the optimizer's, the same in every group
            update = local_slice(orthogonalise_each(direction, ns["ns_coefficients"], ns["ns_steps"], ns["eps"]),
                                 matrix).reshape(-1)
            for value, group in pieces:
                lr = group["lr"]
                value.mul_(1 - lr * group["weight_decay"])
                value.add_(update[value.piece.start:value.piece.end],
                           alpha=-adjusted_lr(lr, group["adjust_lr_fn"], direction.shape))


class _States(MutableMapping):
    """The inner optimizers' `state` as one mapping, each parameter's read and written in its owner's."""

    def __init__(self, optimizers):
        self.owner = {id(p): o for o in optimizers for g in o.param_groups for p in g["params"]}
        self.optimizers = optimizers

    def __getitem__(self, param):
        if id(param) not in self.owner:
            raise KeyError(param)
        return self.owner[id(param)].state[param]

    def __setitem__(self, param, value):
        self.owner[id(param)].state[param] = value

    def __delitem__(self, param):
        del self.owner[id(param)].state[param]

    def __iter__(self):
        return (p for o in self.optimizers for p in o.state)

    def __len__(self):
        return sum(len(o.state) for o in self.optimizers)


class MuonWithAdamW:
    """One optimizer over torch-style `groups` (with their lr_scale and weight decay): each group is split into
    its Muon part (`takes_muon`, by `names`: id -> value name) and its AdamW part. `param_groups` are both
    optimizers' (set `g["lr"]` before `step()`), `state` holds each parameter's by key (momentum_buffer;
    exp_avg, exp_avg_sq, step), `defaults` are AdamW's."""

    def __init__(self, groups: list[dict], names: dict, adamw: dict, muon: dict, tp_group=None, zero=None):
        """`zero`: under ZeRO, (the Muon matrices in model order, the dp x cp group, the edp group that shards
        routed experts); `groups` then hold shard pieces' values (`value.piece`), named by their parameter."""
        def matrix(p):
            return p.piece.param if zero else p

        def part(muon_side: bool) -> list[dict]:
            parts = [{**g, "params": [p for p in g["params"]
                                      if takes_muon(names[id(matrix(p))], matrix(p)) == muon_side]} for g in groups]
            return [g for g in parts if g["params"]]

        self.adamw = torch.optim.AdamW(part(False), **adamw)
        if zero:
            matrices, dp_group, expert_group = zero
            pieces = part(True) or [{"params": []}]   # a rank may hold no piece yet take part in the gathers
            self.muon = ShardedMuon(pieces, matrices, dp_group, tp_group, expert_group, **muon) if matrices else None
        else:
            self.muon = TensorParallelMuon(part(True), **muon, tp_group=tp_group) if part(True) else None
        self.optimizers = [self.adamw] + ([self.muon] if self.muon else [])
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]
        self.state, self.defaults = _States(self.optimizers), self.adamw.defaults

    @torch.no_grad()
    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict() if self.muon else None}

    def load_state_dict(self, state: dict) -> None:
        self.adamw.load_state_dict(state["adamw"])
        if self.muon:
            self.muon.load_state_dict(state["muon"])
