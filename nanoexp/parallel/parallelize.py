"""From a plain model to this rank's part of it: each parallel dimension of the layout applied in turn."""
from __future__ import annotations

from torch import nn

from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.context_parallel import apply_context_parallel
from nanoexp.parallel.expert_parallel import apply_expert_parallel
from nanoexp.parallel.pipeline.split import apply_pipeline
from nanoexp.parallel.tensor_parallel_plan import apply_tensor_parallel


def parallelize(model: nn.Module, ctx: ParallelContext) -> nn.Module:
    """Apply ctx's layout to `model`, a whole plain model on the meta device, in place: context parallelism's
    attention, tensor parallelism's layers (always: they declare the split dimensions initialisation draws
    along), expert parallelism's share of the experts, then the pipeline stage's part."""
    layout = ctx.layout
    if layout.cp > 1:
        apply_context_parallel(model, ctx.axis("cp"), layout.cp_mode)
    apply_tensor_parallel(model, ctx.axis("tp"), layout.sequence_parallel)
    if layout.ep > 1:
        apply_expert_parallel(model, ctx.axis("ep"))
    return apply_pipeline(model, layout, ctx.pp_rank)
