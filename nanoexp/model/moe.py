"""Mixture of experts: a router sends each token to its top-k of E SwiGLU experts, dropless, beside shared experts
every token goes through. The routed experts' weights are stacked and run by a kernel (nanoexp/model/experts.py).
The routing is kept even by the Switch load-balancing loss (`balance=aux_loss`) or by DeepSeek-V3's routing bias
(`balance=bias`: added to the scores for the choice of experts only, moved after each step by `update_expert_biases`
from the loads every rank routed), optionally with a sequence-wise balancing loss and the ST-MoE router z-loss.
The block is built whole and plain; expert parallelism keeps a rank's share of the experts and replaces `route`
by an exchange between ranks (nanoexp/parallel/expert_parallel.py). Where ranks split a micro-batch's tokens (cp,
tp under sequence parallelism) `MoeLosses.token_sums` add the router's counts over them, so the losses are the
whole micro-batch's on every layout; they enter backward where the layer runs (`_AddLossGradient`).
The losses' formulas, the balancing and the parity measurements: docs/moe.md."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nanoexp.model.experts import ExpertCounts, GroupedExperts
from nanoexp.model.linear import Linear

ROUTERS = ("softmax_topk", "softmax_topk_normalized")
DEFAULT_BIAS_UPDATE_RATE = 0.001   # DeepSeek-V3's gamma (model.moe.bias_update_rate=null)


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
    expert_kernel: str = "grouped_mm"      # experts.EXPERT_KERNELS
    balance: str = "aux_loss"              # BALANCES
    bias_update_rate: float = DEFAULT_BIAS_UPDATE_RATE   # balance=bias: the bias's step per optimizer step
    seq_aux_loss_coef: float = 0.0         # the sequence-wise balancing loss, per MoE layer

    def capacity(self, tokens: int) -> int | None:
        """The most assignments an expert takes from `tokens` tokens: ceil(capacity_factor x tokens x top_k / E)
        (the Switch Transformer's rule), None when dropless."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def is_moe_layer(self, n: int) -> bool:
        """Every layer_frequency-th layer is MoE (the last of each group of layer_frequency)."""
        return (n + 1) % self.layer_frequency == 0


def routes_with_bias(balance: str) -> bool:
    """Whether model.moe.balance keeps a routing bias per MoE layer (a buffer checkpoints keep)."""
    return balance in BALANCES and BALANCES[balance].routing_bias   # an unknown value: named by its domain check


def balance_rules(moe) -> list[tuple[bool, str]]:
    """model.moe.balance picks one way to keep the routing even: the other way's key must not be set."""
    return [
        (moe.balance == "aux_loss" or moe.aux_loss_coef == 0,
         f"model.moe.aux_loss_coef={moe.aux_loss_coef} with model.moe.balance={moe.balance}: the load-balancing loss "
         "trains only under balance=aux_loss; set model.moe.aux_loss_coef=0 (its value is still logged as "
         "moe_aux_loss) or balance=aux_loss"),
        (routes_with_bias(moe.balance) or moe.bias_update_rate is None,
         f"model.moe.bias_update_rate={moe.bias_update_rate} with model.moe.balance={moe.balance}: the rate moves "
         "the routing bias of balance=bias; set model.moe.balance=bias or bias_update_rate=null"),
    ]


def moe_layer_shapes(hidden: int, moe: MoeShape, prefix: str) -> dict[str, tuple[int, ...]]:
    """The full shape of every parameter of one MoE block (`prefix`: "model.layers.<n>.mlp."), each routed expert's
    matrices apart, as checkpoints store them (experts.expert_value_names)."""
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
    """A SwiGLU MLP, whole on this rank: the shared experts (the routed ones are stacked: experts.py)."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = Linear(hidden, width)
        self.up_proj = Linear(hidden, width)
        self.down_proj = Linear(width, hidden)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoeRecord(NamedTuple):
    """What a MoE layer's training forward leaves for the step's metrics and the bias update."""
    layer: int
    aux: torch.Tensor        # the load-balancing loss (before its coefficient)
    z: torch.Tensor          # the router z-loss
    counts: torch.Tensor     # assignments per expert, the micro-batch's (summed over the ranks splitting it)
    dropped: torch.Tensor | int   # assignments beyond their expert's capacity
    seq_aux: torch.Tensor | None   # the sequence-wise balancing loss (None: its coefficient is 0)


class MoeLosses:
    """What the model's MoE layers share: the weight of their losses in the step loss (`scale`: cp / micro-batches
    per replica, so that the dp x cp gradient average gives the mean over the global batch's micro-batches; set
    by the step runner), whether forwards are recorded (training forwards; not a forward recomputed inside
    backward), the step's records for the metrics, and `token_sums`: what adds a rank's router counts to those
    of the other ranks holding part of the micro-batch (set by the parallel dimensions that split it)."""

    def __init__(self, moe: MoeShape, moe_layers: list[int]):
        self.moe, self.moe_layers = moe, moe_layers   # the model's MoE layers (all stages)
        self.scale, self.recording = 1.0, False
        self.records: list[MoeRecord] = []
        self.loads: torch.Tensor | None = None   # the last step's, [MoE layers, E], every rank's (moe_metrics.py)
        self.token_sums: list = []       # callables summing a counts tensor over ranks, in place

    def add(self, layer: int, out: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor, chosen: torch.Tensor,
            dropped: torch.Tensor | int = 0, sequences: int = 1):
        """`out` with the layer's losses attached (in a forward with grad). A forward recomputed inside backward
        (parallelism.recompute_layer) computes them again, as activation checkpointing needs the same saved
        tensors, but records nothing. The tokens are `sequences` sequences' (the micro-batch's rows) in order."""
        if not torch.is_grad_enabled():
            return out
        moe, experts = self.moe, self.moe.num_experts
        by_sequence = moe.seq_aux_loss_coef > 0
        with torch.no_grad():   # one tensor of counts, summed over the ranks splitting the micro-batch at once
            counts = [expert_counts(chosen.reshape(-1), experts), torch.tensor([logits.shape[0]], device=chosen.device)]
            if by_sequence:
                counts += [sequence_counts(chosen, sequences, experts).reshape(-1),
                           torch.full((sequences,), logits.shape[0] // sequences, device=chosen.device)]
            counts = torch.cat(counts).to(probs.dtype)
            for token_sum in self.token_sums:
                token_sum(counts)
        tokens = counts[experts]
        share = counts[:experts] / (tokens * moe.top_k)   # f_e
        aux = experts * (share * probs.sum(0) / tokens).sum()
        z = torch.logsumexp(logits, dim=-1).pow(2).sum() / tokens
        seq_aux = sequence_aux_loss(counts[experts + 1:], probs, sequences, moe) if by_sequence else None
        if self.recording:
            self.records.append(MoeRecord(layer, aux.detach(), z.detach(), counts[:experts], dropped,
                                          None if seq_aux is None else seq_aux.detach()))
        loss = moe.aux_loss_coef * aux + moe.z_loss_coef * z
        if seq_aux is not None:
            loss = loss + moe.seq_aux_loss_coef * seq_aux
        return _AddLossGradient.apply(out, self.scale * loss)

    @contextlib.contextmanager
    def training_forward(self):
        """Record the MoE layers' losses and loads during this block (a training forward)."""
        self.recording = True
        try:
            yield
        finally:
            self.recording = False


def sequence_counts(chosen: torch.Tensor, sequences: int, num_experts: int) -> torch.Tensor:
    """[sequences, E]: how many of each sequence's assignments went to each expert."""
    chosen = chosen.reshape(sequences, -1)
    return torch.zeros(sequences, num_experts, dtype=torch.long, device=chosen.device).scatter_add_(
        1, chosen, torch.ones_like(chosen))


def sequence_aux_loss(counts: torch.Tensor, probs: torch.Tensor, sequences: int, moe: MoeShape) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balancing loss, averaged over the micro-batch's sequences: for a sequence of T
    tokens, E * sum_e (n_e / kT) * (sum_t p_te / T), n_e its assignments to expert e (1 when even, as the aux
    loss). `counts` holds each sequence's E counts, then each one's T (whole sequences: summed over the ranks
    splitting them); `probs` [tokens, E], this rank's part of each sequence, sequence by sequence."""
    experts = moe.num_experts
    per_expert, tokens = counts[:sequences * experts].view(sequences, experts), counts[sequences * experts:, None]
    probs_sum = probs.view(sequences, -1, experts).sum(1)   # this rank's part of each sequence's sum_t p_te
    return (experts * (per_expert / (tokens * moe.top_k)) * probs_sum / tokens).sum() / sequences


def expert_counts(expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many entries of `expert` name each expert, on the device (bincount on CUDA reads the largest value on
    the host first)."""
    return torch.zeros(num_experts, dtype=torch.long, device=expert.device).scatter_add_(
        0, expert, torch.ones_like(expert))


class LocalRoute:
    """Rows sorted by expert to the experts, all on this rank, as they are. Dropless, every assignment is kept and
    their number is known on the host: nothing is read from the device; with a capacity the kept rows are counted
    on the host, the layer's one read of the device."""

    def __init__(self, counts: torch.Tensor, dropless: bool):
        self.counts = ExpertCounts(counts) if dropless else ExpertCounts(counts, counts.tolist())
        self.rows = None if dropless else sum(self.counts.sizes)   # the kept rows (None: all of them)

    def dispatch(self, rows: torch.Tensor) -> tuple[torch.Tensor, ExpertCounts]:
        """The rows the experts compute, sorted by expert, and how many each gets."""
        return rows, self.counts

    def combine(self, outputs: torch.Tensor) -> torch.Tensor:
        """The experts' outputs back in the order of the rows."""
        return outputs


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
    """The MLP of a MoE layer: router, routed experts, shared experts (module docstring). `experts` holds those this
    rank computes; `route(counts, dropless)` takes rows sorted by expert to them and back. Under balance=bias,
    `expert_bias` [E] (a buffer: no gradient, saved in checkpoints) is added to the scores to choose the experts."""

    def __init__(self, hidden: int, moe: MoeShape, losses: MoeLosses, layer: int):
        super().__init__()
        self.moe, self.losses, self.layer = moe, losses, layer
        self.router = Linear(hidden, moe.num_experts)
        self.experts = GroupedExperts(moe.num_experts, hidden, moe.intermediate_size, moe.expert_kernel)
        self.shared_experts = (Expert(hidden, moe.intermediate_size * moe.num_shared_experts)
                               if moe.num_shared_experts else None)
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts) if routes_with_bias(moe.balance) else None)
        self.route = LocalRoute

    def forward(self, x):
        shape, tokens = x.shape, x.reshape(-1, x.shape[-1])            # [T, h]
        logits = self.router(tokens)                                   # [T, E]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))   # routing in float32 under bf16
        if self.moe.router_multiplier != 1.0:
            logits = logits * self.moe.router_multiplier
        probs = logits.softmax(dim=-1)
        weights, chosen = self.choose(probs)                           # [T, k]
        token, slot, counts, dropped = self.assignments(chosen)
        # Every expert runs, on the rows routed to it (possibly none): every rank then gets a gradient, zeros or
        # not, for each of its experts (ZeRO-3 relies on it).
        route = self.route(counts, dropless=self.moe.capacity_factor is None)
        token, slot = token[:route.rows], slot[:route.rows]   # the kept assignments come first
        routed = route.combine(self.experts(*route.dispatch(tokens[token]))) * weights[token, slot, None]
        out = torch.zeros_like(tokens).index_add(0, token, routed.to(tokens.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens).to(out.dtype)
        out = self.losses.add(self.layer, out, logits, probs, chosen, dropped, sequences=shape[0])
        return out.view(shape)

    def choose(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts and their weights: the experts by probability plus the routing bias (which
        chooses, and does not weigh), the weights their probabilities (renormalised to sum to 1 if so set)."""
        scores = probs if self.expert_bias is None else probs + self.expert_bias
        chosen = scores.topk(self.moe.top_k, dim=-1).indices
        weights = probs.gather(-1, chosen)
        if self.moe.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

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


@torch.no_grad()
def update_expert_biases(model: nn.Module, loads: torch.Tensor) -> None:
    """After an optimizer step, DeepSeek-V3's rule for each MoE layer of `model` under balance=bias: its bias moves
    by bias_update_rate towards an even load, down for an expert above the mean load, up below it (by the sign of
    the error, not its size). `loads` [the model's MoE layers (every stage), E]: the step's assignments per expert,
    summed over every micro-batch and every rank that routed them, the same on every rank (moe_metrics.py), so
    every replica moves its bias alike."""
    for module in model.modules():
        if isinstance(module, MoE) and module.expert_bias is not None:
            load = loads[module.losses.moe_layers.index(module.layer)]
            module.expert_bias.add_(torch.sign(load.mean() - load).to(module.expert_bias.dtype),
                                    alpha=module.moe.bias_update_rate)


class Balance(NamedTuple):
    """A way to keep the routing even (model.moe.balance): whether it keeps a routing bias per MoE layer, and its
    post-step hook, `after_step(model, loads)`: what moves after each optimizer step by the step's loads (None:
    nothing; the runtime runs it, nanoexp/runtime/build.py)."""
    routing_bias: bool
    after_step: Callable[[nn.Module, torch.Tensor], None] | None = None


BALANCES = {"aux_loss": Balance(False), "bias": Balance(True, update_expert_biases), "none": Balance(False)}
