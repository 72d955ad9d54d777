"""The pipeline split of a model: a pp rank keeps its chunks of layers (Layout.stage_layers), rank 0 the
embedding, the head's rank (Layout.head_rank) the final norm and the LM head. A tied LM head split from its
embedding becomes a copy of the embedding's values on the head's rank, whose gradient is summed with the embedding's (Layout.lm_head_weight)."""
from __future__ import annotations

import torch
from torch import nn

from nanoexp.parallel.layout import Layout
from nanoexp.model.placement import place, placement


def apply_pipeline(model: nn.Module, layout: Layout, pp_rank: int) -> nn.Module:
    """Keep what pp rank `pp_rank` of `layout` runs of a whole model built on the meta device, in place."""
    tied = model.shape.tie_word_embeddings
    model.chunks = layout.stage_layers(model.shape.num_hidden_layers, pp_rank)
    kept = {str(i) for chunk in model.chunks for i in chunk}
    for name in [name for name in model.model.layers if name not in kept]:
        del model.model.layers[name]
    embedding = model.model.embed_tokens.weight
    if layout.embedding_has_copy(pp_rank, tied):
        place(embedding, tied_across_stages=True)
    if layout.lm_head_weight(pp_rank, tied) == "copy":
        copy = nn.Parameter(torch.empty_like(embedding))
        copy.placement = placement(embedding)
        model.lm_head.weight = place(copy, tied_across_stages=True, tied_copy=True)
    if pp_rank != 0:
        model.model.embed_tokens = None
    if pp_rank != layout.head_rank:
        model.model.norm = model.lm_head = None
    return model
