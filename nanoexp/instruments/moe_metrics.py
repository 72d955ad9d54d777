"""A mixture of experts' step metrics, from the records its layers kept (MoeLosses.records), equal on every rank."""
from __future__ import annotations

import torch
import torch.distributed as dist

LOAD_IMBALANCE = "moe_load_imbalance/layer_"   # + n: layer n's busiest expert's load over the mean


@torch.no_grad()
def moe_step_values(losses, ctx, micro_batches: int) -> tuple[list[str], torch.Tensor]:
    """The step's MoE metrics, names and values on the device (the trainer reads them with its other scalars):
    `moe_aux_loss` and `moe_z_loss` (and with a sequence-wise loss `moe_seq_aux_loss`), summed over the MoE layers
    and averaged over the global batch's `micro_batches` (before their coefficients); per MoE layer n
    `moe_load_imbalance/layer_n`: the most tokens an expert got over the mean (1: balanced); with a capacity factor
    `moe_dropped_fraction`: the share of the step's assignments beyond their expert's capacity. The loads
    themselves, [MoE layers, E], go to `losses.loads`: each expert's assignments in the step, summed over every
    rank that routed them (what balance=bias moves its bias by). One all-reduce over all ranks; clears the records."""
    moe, experts = losses.moe, losses.moe.num_experts
    values = torch.zeros(4 + len(losses.moe_layers) * experts, device=ctx.device)
    for record in losses.records:
        if ctx.tp_rank == 0 or ctx.layout.sequence_parallel:   # parts of the micro-batch's tokens (all of them on
            values[0] += record.aux                                # every tp rank without SP)
            values[1] += record.z
            values[3] += 0 if record.seq_aux is None else record.seq_aux
        if ctx.tp_rank == 0 and ctx.cp_rank == 0:   # the counts are the micro-batch's on each of its ranks
            start = 4 + losses.moe_layers.index(record.layer) * experts
            values[start:start + experts] += record.counts
            values[2] += record.dropped
    losses.records.clear()
    if ctx.world_size > 1:
        dist.all_reduce(values)
    loads = losses.loads = values[4:].view(len(losses.moe_layers), experts)
    imbalance = loads.max(dim=1).values / loads.mean(dim=1).clamp_min(1e-12)
    names = ["moe_aux_loss", "moe_z_loss"] + [f"{LOAD_IMBALANCE}{n}" for n in losses.moe_layers]
    parts = [values[:2] / micro_batches, imbalance]
    if moe.capacity_factor is not None:
        names.append("moe_dropped_fraction")
        parts.append((values[2] / loads.sum().clamp_min(1.0)).view(1))
    if moe.seq_aux_loss_coef > 0:
        names.append("moe_seq_aux_loss")
        parts.append((values[3] / micro_batches).view(1))
    return names, torch.cat(parts)
