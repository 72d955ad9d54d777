"""All-gather and reduce-scatter into one flat tensor, by the name this torch release gives them; all-reduces of
several tensors at once.

torch 2.13 renamed `all_gather_into_tensor` to `all_gather_single` and `reduce_scatter_tensor` to
`reduce_scatter_single`; nanoexp runs on releases before and after. The name is looked up at each call, so
that wrappers installed meanwhile (nanoexp.verify.comm_counter) see the call.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _collective(name: str, old_name: str):
    return getattr(dist, name, None) or getattr(dist, old_name)


def all_gather_into(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool = False):
    """Every rank's `shard` concatenated, in group rank order, into `output` (group size x shard)."""
    return _collective("all_gather_single", "all_gather_into_tensor")(output, shard, group=group, async_op=async_op)


def reduce_scatter_into(shard: torch.Tensor, full: torch.Tensor, group, async_op: bool = False):
    """The sum over the group of `full`, this rank's 1/size of it into `shard`."""
    return _collective("reduce_scatter_single", "reduce_scatter_tensor")(shard, full, group=group, async_op=async_op)


def all_reduce_each(tensors: list[torch.Tensor], group) -> None:
    """Sum each of `tensors` over `group` in place: every all-reduce posted, then every one waited for (the same
    order on every rank, as NCCL requires)."""
    for work in [dist.all_reduce(tensor, group=group, async_op=True) for tensor in tensors]:
        work.wait()
