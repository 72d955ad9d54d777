"""How a parameter is placed across the ranks of one model replica: declared once, where the layer
creates it (`place`), and read through this module by everything else (init, gradient sums,
clipping, checkpoints, Hugging Face weights).

A parameter without a declaration is replicated on every tp rank of its pipeline stage. Tied
embeddings split over the pipeline (Layout.lm_head_weight decides where) are declared here as two
ends: the embedding, and the last stage's copy of its values, which is stored and counted nowhere
(`counted_here`) and reads its values from the embedding's name (`value_name`). A routed expert's
parameters under expert parallelism live on one rank of each ep group (ParallelContext.replica_rank). A stacked
routed-expert tensor holds several experts' matrices, which checkpoints and Hugging Face files store apart
(`expert_values`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from nanoexp.model.experts import expert_value_names, is_stacked_expert
from nanoexp.model.llama import EMBEDDING, LM_HEAD  # noqa: F401 - re-exported: where the parameters are named


@dataclass(frozen=True)
class Placement:
    split_dim: int | None = None      # the dimension tensor parallelism splits (None: each tp rank holds all of it)
    parts: int = 1                    # how many slices split_dim is cut into (tp) ...
    part: int = 0                     # ... and which of them this rank holds (tp_rank)
    sequence_parallel: bool = False   # each tp rank's gradient covers its part (of the sequence; of the heads,
    #                                   for q/k norms): summed over tp
    tied_across_stages: bool = False  # one end of an embedding tied over the first and last stage: grads summed
    tied_copy: bool = False           # the last stage's end: the embedding's values, stored and counted there
    expert: bool = False              # a routed expert's: on one rank of each ep group, gradients summed over edp
    first_expert: int = 0             # a stacked routed-expert tensor: the global index of its first expert


REPLICATED = Placement()


def place(param, **fields):
    """Declare (or extend) how `param` is placed; returns it."""
    param.placement = replace(placement(param), **fields)
    return param


def placement(param) -> Placement:
    return getattr(param, "placement", REPLICATED)


def counted_here(param, tp_rank: int) -> bool:
    """Whether this rank's copy is the one that counts within its replica (in the gradient norm and
    in checkpoints): a tp-split slice on every tp rank, a replicated parameter on tp rank 0, a tied
    copy nowhere (its twin, the embedding, holds the same values and summed gradient)."""
    p = placement(param)
    return not p.tied_copy and (p.split_dim is not None or tp_rank == 0)


def local_slice(full, param):
    """This rank's slice of the full tensor `full` of `param` (its part along split_dim), contiguous; may share
    storage with `full`."""
    p = placement(param)
    if p.split_dim is None or p.parts == 1:
        return full
    size = full.shape[p.split_dim]
    if size % p.parts:
        raise ValueError(f"dimension {p.split_dim} of a {tuple(full.shape)} tensor is not divisible by {p.parts}")
    return full.narrow(p.split_dim, p.part * (size // p.parts), size // p.parts).contiguous()


def value_name(name: str, param) -> str:
    """The parameter whose values `param` holds: itself, or the embedding for a tied copy (its seed
    at initialisation, its tensor in checkpoints and Hugging Face weights)."""
    return EMBEDDING if placement(param).tied_copy else name


def expert_values(name: str, param) -> list[str] | None:
    """The names of the stored tensors a stacked routed-expert parameter holds along its dimension 0, one per
    expert, by global index (model/experts.py); None for any other parameter (it holds `value_name`'s)."""
    if not is_stacked_expert(name):
        return None
    return expert_value_names(name, placement(param).first_expert, param.shape[0])


def stored_names(name: str, param) -> list[str]:
    """The names of the stored tensors `param` holds (checkpoints, Hugging Face files): one per routed expert of a
    stacked expert tensor, else `value_name`'s."""
    return expert_values(name, param) or [value_name(name, param)]
