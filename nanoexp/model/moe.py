"""Mixture of experts: a router sends each token to its top-k of E SwiGLU experts, dropless, beside shared experts
every token goes through; the Switch load-balancing loss and the ST-MoE router z-loss keep the routing healthy.
The block is built whole and plain; expert parallelism keeps a rank's share of the experts and replaces `route`
by an exchange between ranks (nanoexp/parallel/expert_parallel.py). Where ranks split a micro-batch's tokens (cp,
tp under sequence parallelism) `MoeLosses.token_sums` add the router's counts over them, so the losses are the
whole micro-batch's on every layout; they enter backward where the layer runs (`_AddLossGradient`).
The losses' formulas and the parity measurements: docs/moe.md."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoexp.model.linear import Linear

ROUTERS = ("softmax_topk", "softmax_topk_normalized")


@dataclass(frozen=True)
class MoeShape:
    """model.moe, for the layers: E experts of width `intermediate_size`, top_k of them per token."""
    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int = 0
    layer_frequency: int = 1
    normalize_top_k: bool = False
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    capacity_factor: float | None = None   # None: dropless
    router_multiplier: float = 1.0         # on the router's logits: 1/m under µP (mup.py), else 1

    def capacity(self, tokens: int) -> int | None:
        """The most assignments an expert takes from `tokens` tokens: ceil(capacity_factor x tokens x top_k / E)
        (the Switch Transformer's rule), None when dropless."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def is_moe_layer(self, n: int) -> bool:
        """Every layer_frequency-th layer is MoE (the last of each group of layer_frequency)."""
        return (n + 1) % self.layer_frequency == 0


def moe_layer_shapes(hidden: int, moe: MoeShape, prefix: str) -> dict[str, tuple[int, ...]]:
    """The full shape of every parameter of one MoE block (`prefix`: "model.layers.<n>.mlp.")."""
    h, i = hidden, moe.intermediate_size
    shapes = {prefix + "router.weight": (moe.num_experts, h)}
    experts = [f"experts.{e}." for e in range(moe.num_experts)]
    experts += ["shared_experts."] if moe.num_shared_experts else []
    for expert in experts:
        width = i * (moe.num_shared_experts if expert == "shared_experts." else 1)
        shapes.update({prefix + expert + "gate_proj.weight": (width, h), prefix + expert + "up_proj.weight": (width, h),
                       prefix + expert + "down_proj.weight": (h, width)})
    return shapes


class Expert(nn.Module):
    """A SwiGLU MLP, whole on this rank."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = Linear(hidden, width)
        self.up_proj = Linear(hidden, width)
        self.down_proj = Linear(width, hidden)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoeLosses:
    """What the model's MoE layers share: the weight of their losses in the step loss (`scale`: cp / micro-batches
    per replica, so that the dp x cp gradient average gives the mean over the global batch's micro-batches; set
    by the step runner), whether forwards are recorded (training forwards; not a forward recomputed inside
    backward), the step's records for the metrics, and `token_sums`: what adds a rank's router counts to those
    of the other ranks holding part of the micro-batch (set by the parallel dimensions that split it)."""

    def __init__(self, moe: MoeShape, moe_layers: list[int]):
        self.moe, self.moe_layers = moe, moe_layers   # the model's MoE layers (all stages)
        self.scale, self.recording = 1.0, False
        self.records: list[tuple] = []   # (layer, aux, z, assignments per expert, assignments dropped)
        self.token_sums: list = []       # callables summing a counts tensor over ranks, in place

    def add(self, layer: int, out: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor, chosen: torch.Tensor,
            dropped: torch.Tensor | int = 0):
        """`out` with the layer's losses attached (in a forward with grad). A forward recomputed inside backward
        (parallelism.recompute_layer) computes them again, as activation checkpointing needs the same saved
        tensors, but records nothing."""
        if not torch.is_grad_enabled():
            return out
        moe = self.moe
        with torch.no_grad():
            counts = expert_counts(chosen.reshape(-1), moe.num_experts).to(probs.dtype)
            counts = torch.cat([counts, torch.full((1,), float(logits.shape[0]), device=counts.device,
                                                   dtype=counts.dtype)])   # + this rank's tokens
            for token_sum in self.token_sums:
                token_sum(counts)
        counts, tokens = counts[:-1], counts[-1]
        share = counts / (tokens * moe.top_k)   # f_e
        aux = moe.num_experts * (share * probs.sum(0) / tokens).sum()
        z = torch.logsumexp(logits, dim=-1).pow(2).sum() / tokens
        if self.recording:
            self.records.append((layer, aux.detach(), z.detach(), counts, dropped))
        loss = self.scale * (moe.aux_loss_coef * aux + moe.z_loss_coef * z)
        return _AddLossGradient.apply(out, loss)

    @contextlib.contextmanager
    def training_forward(self):
        """Record the MoE layers' losses and loads during this block (a training forward)."""
        self.recording = True
        try:
            yield
        finally:
            self.recording = False


def expert_counts(expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many entries of `expert` name each expert, on the device (bincount on CUDA reads the largest value on
    the host first)."""
    return torch.zeros(num_experts, dtype=torch.long, device=expert.device).scatter_add_(
        0, expert, torch.ones_like(expert))


class LocalRoute:
    """Rows sorted by expert to the experts, all on this rank: `counts[e]` rows for expert e. The split sizes are
    the layer's one read of the device on the host."""

    def __init__(self, counts: torch.Tensor):
        self.local_counts = counts.tolist()
        self.rows = sum(self.local_counts)   # the rows this rank routes

    def dispatch(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """One block of rows per expert (empty blocks included)."""
        return list(rows.split(self.local_counts))

    def combine(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """The experts' outputs back in the order of the rows."""
        return torch.cat(outputs)


class _AddLossGradient(torch.autograd.Function):
    """Identity on `out`; in backward, `loss` gets gradient 1 (it is part of the step loss)."""

    @staticmethod
    def forward(ctx, out, loss):
        ctx.loss_dtype = loss.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=ctx.loss_dtype, device=grad.device)


class MoE(nn.Module):
    """The MLP of a MoE layer: router, routed experts, shared experts (module docstring). `experts` are those this
    rank holds, named by their global index; `route(counts)` takes rows sorted by expert to them and back."""

    def __init__(self, hidden: int, moe: MoeShape, losses: MoeLosses, layer: int):
        super().__init__()
        self.moe, self.losses, self.layer = moe, losses, layer
        self.router = Linear(hidden, moe.num_experts)
        self.experts = nn.ModuleDict({str(e): Expert(hidden, moe.intermediate_size) for e in range(moe.num_experts)})
        self.shared_experts = (Expert(hidden, moe.intermediate_size * moe.num_shared_experts)
                               if moe.num_shared_experts else None)
        self.route = LocalRoute

    def forward(self, x):
        shape, tokens = x.shape, x.reshape(-1, x.shape[-1])            # [T, h]
        logits = self.router(tokens)                                   # [T, E]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))   # routing in float32 under bf16
        if self.moe.router_multiplier != 1.0:
            logits = logits * self.moe.router_multiplier
        probs = logits.softmax(dim=-1)
        weights, chosen = probs.topk(self.moe.top_k, dim=-1)          # [T, k]
        if self.moe.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        token, slot, counts, dropped = self.assignments(chosen)
        # Every expert runs, on the rows routed to it (possibly none): every rank then gets a gradient, zeros or
        # not, for each of its experts, in the same order (ZeRO-3 relies on it).
        route = self.route(counts)
        token, slot = token[:route.rows], slot[:route.rows]   # the kept assignments come first
        outputs = [expert(rows) for expert, rows in zip(self.experts.values(), route.dispatch(tokens[token]))]
        routed = route.combine(outputs) * weights[token, slot, None]
        out = torch.zeros_like(tokens).index_add(0, token, routed.to(tokens.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens).to(out.dtype)
        out = self.losses.add(self.layer, out, logits, probs, chosen, dropped)
        return out.view(shape)

    def assignments(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (token, slot) pairs sorted by expert then token, those that reach their expert first; the count per
        expert that reaches it and how many were dropped — all on the device (the route reads the counts). With a
        capacity, an expert keeps the first `capacity` tokens in order."""
        capacity, experts = self.moe.capacity(chosen.shape[0]), self.moe.num_experts
        expert, order = chosen.reshape(-1).sort(stable=True)           # by expert, then token
        counts = expert_counts(expert, experts)
        if capacity is not None:
            rank_in_expert = torch.arange(expert.numel(), device=expert.device) - (counts.cumsum(0) - counts)[expert]
            dropped = rank_in_expert >= capacity
            order = order[torch.sort(dropped.to(torch.int8), stable=True).indices]   # kept first, still in order
            kept = counts.clamp(max=capacity)
            return order // self.moe.top_k, order % self.moe.top_k, kept, counts.sum() - kept.sum()
        return order // self.moe.top_k, order % self.moe.top_k, counts, torch.zeros((), dtype=torch.long,
                                                                                     device=counts.device)
