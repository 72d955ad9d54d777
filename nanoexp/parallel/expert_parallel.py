"""Expert parallelism: each rank of an ep group holds num_experts / ep of a mixture's experts, and each routed
token's hidden state goes to the ep rank that holds its expert and comes back, by `all_to_all_single` over the
ep group. `apply_expert_parallel` makes a plain model so.

A MoE layer sorts its (token, expert) assignments by expert and calls `ExpertRoute(counts, ...)` with how many
rows go to each of the E experts. The route first exchanges those counts (one all-to-all of E integers: each
rank learns how many rows every peer sends to each of its experts), then `dispatch` sends the rows in one
variable-size all-to-all and regroups what arrived by local expert, for the layer's expert kernel to compute;
`combine` undoes both. Autograd runs
through both directions: the backward of a send is the reverse exchange of the gradients, with the split sizes
swapped.

Every rank of the ep group must make the same calls in the same order, which it does: the ranks run the same
layers on the same schedule, and a rank with no row for a peer still takes part (with a split of 0).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from nanoexp.model.experts import ExpertCounts
from nanoexp.model.moe import MoE
from nanoexp.parallel.context import Axis
from nanoexp.model.placement import place, placement


class _AllToAll(torch.autograd.Function):
    """Rows [sum(send_splits), ...] out to the group, [sum(receive_splits), ...] in; backward the reverse."""

    @staticmethod
    def forward(ctx, rows, receive_splits, send_splits, group):
        ctx.splits, ctx.group = (receive_splits, send_splits), group
        received = rows.new_empty((sum(receive_splits), *rows.shape[1:]))
        dist.all_to_all_single(received, rows.contiguous(), receive_splits, send_splits, group=group)
        return received

    @staticmethod
    def backward(ctx, grad):
        receive_splits, send_splits = ctx.splits
        sent_back = grad.new_empty((sum(send_splits), *grad.shape[1:]))
        dist.all_to_all_single(sent_back, grad.contiguous(), send_splits, receive_splits, group=ctx.group)
        return sent_back, None, None, None


class ExpertRoute:
    """One micro-batch's exchange in one MoE layer, from `counts[e]`: the rows this rank sends to expert e
    (rows sorted by expert), E = len(counts) experts of which each of the `ep` ranks of `group` holds E / ep
    consecutive ones. `local_counts[j]`: the rows that arrive for this rank's j-th expert (from every rank).
    The counts are read on the host whether or not the layer drops tokens (`dropless`): the exchange needs them."""

    def __init__(self, counts: torch.Tensor, dropless: bool, ep: int, group):
        self.ep, self.group = ep, group
        experts_per_rank = counts.numel() // ep
        received = torch.empty_like(counts)   # [source rank, local expert], flattened
        dist.all_to_all_single(received, counts, group=group)
        # The layer's one read of the device on the host: what arrives from each rank for each local expert, and
        # what this rank sends (its kept assignments per expert).
        both = torch.cat([received, counts]).tolist()
        arriving, sending = both[:counts.numel()], both[counts.numel():]
        by_source = [arriving[s * experts_per_rank:(s + 1) * experts_per_rank] for s in range(ep)]
        self.send_splits = [sum(sending[r * experts_per_rank:(r + 1) * experts_per_rank]) for r in range(ep)]
        self.receive_splits = [sum(row) for row in by_source]
        self.local_counts = ExpertCounts(received.view(ep, experts_per_rank).sum(0),
                                         [sum(row[j] for row in by_source) for j in range(experts_per_rank)])
        self.rows = sum(self.send_splits)
        # Arrived rows are grouped by source, then expert; `order` lists them by expert, then source: a stable
        # sort of each row's (local expert, source) key, built on the device.
        key = (torch.arange(experts_per_rank, device=counts.device).repeat(ep) * ep
               + torch.arange(ep, device=counts.device).repeat_interleave(experts_per_rank))
        row_keys = key.repeat_interleave(received, output_size=sum(self.receive_splits))
        self.order = torch.sort(row_keys, stable=True).indices

    def dispatch(self, rows: torch.Tensor) -> tuple[torch.Tensor, ExpertCounts]:
        """The rows this rank's experts compute, sorted by local expert, and how many each gets."""
        rows = _AllToAll.apply(rows, self.receive_splits, self.send_splits, self.group)[self.order]
        return rows, self.local_counts

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """The experts' outputs (in the order `dispatch` gave) back to the ranks and rows they came from."""
        by_source = torch.empty_like(rows).index_copy(0, self.order, rows)
        return _AllToAll.apply(by_source, self.send_splits, self.receive_splits, self.group)


def apply_expert_parallel(model: nn.Module, axis: Axis) -> nn.Module:
    """Each MoE block of `model` (on the meta device) keeps experts [rank x E/ep, (rank + 1) x E/ep) of its stacked
    expert tensors (placement `expert`, from `first_expert`: their gradients are summed over the edp ranks holding
    the same ones, and checkpoints name them by their global index), and exchanges its rows with the other ranks
    of the ep group."""
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        local = module.moe.num_experts // axis.size
        for name, param in list(module.experts.named_parameters()):
            kept = nn.Parameter(param[axis.rank * local:(axis.rank + 1) * local].clone())
            kept.placement = placement(param)   # what tp declared (sequence parallel), and now ep's share
            setattr(module.experts, name, place(kept, expert=True, first_expert=axis.rank * local))
        module.route = functools.partial(ExpertRoute, ep=axis.size, group=axis.group)
    return model
