"""The tensor-parallel plan: which layer of a plain Llama becomes which layer of tensor_parallel.py, named by its
module path, and `apply_tensor_parallel`, which puts them in and declares what else tp changes (heads per rank,
parameters whose gradients are summed over tp)."""
from __future__ import annotations

import functools
from fnmatch import fnmatchcase

import torch
import torch.distributed as dist
from torch import nn

from nanoexp.model.llama import MLP, Attention, RMSNorm
from nanoexp.model.moe import MoE
from nanoexp.parallel.context import Axis
from nanoexp.model.placement import place
from nanoexp.parallel.tensor_parallel import (ColumnInput, ColumnParallelLinear, RowParallelLinear,
                                              VocabParallelCrossEntropy, VocabParallelEmbedding, _divide)


# -- the plan: which layer of the plain model becomes which, by its path ("*": any one name) -------------------
# "column" and "row" linears, the "vocab" embedding, the LM "head" (a column linear gathering its own input); a
# block reads its input once, through its "input" slot. A MoE block's experts are expert parallelism's.
PLAN = {"model.embed_tokens": "vocab",
        "model.layers.*.self_attn.qkv_input": "input",
        "model.layers.*.self_attn.q_proj": "column",
        "model.layers.*.self_attn.k_proj": "column",
        "model.layers.*.self_attn.v_proj": "column",
        "model.layers.*.self_attn.o_proj": "row",
        "lm_head": "head"}
DENSE_MLP_PLAN = {"model.layers.*.mlp.mlp_input": "input",
                  "model.layers.*.mlp.gate_proj": "column",
                  "model.layers.*.mlp.up_proj": "column",
                  "model.layers.*.mlp.down_proj": "row"}


def _matches(pattern: str, path: str) -> bool:
    names, parts = path.split("."), pattern.split(".")
    return len(names) == len(parts) and all(fnmatchcase(name, part) for name, part in zip(names, parts))


def plan_of(model: nn.Module) -> dict[str, str]:
    """{module path: style} of every layer of `model` the plan splits. Raises ValueError naming a plan entry that
    matches no module (a renamed layer would otherwise stay whole on every rank, silently)."""
    plan = {**PLAN, **(DENSE_MLP_PLAN if any(isinstance(m, MLP) for m in model.modules()) else {})}
    paths = [path for path, _ in model.named_modules()]
    found = {}
    for pattern, style in plan.items():
        matched = [path for path in paths if _matches(pattern, path)]
        if not matched:
            raise ValueError(f"tensor-parallel plan entry {pattern!r} matches no module of the model")
        found.update(dict.fromkeys(matched, style))
    return found


def apply_tensor_parallel(model: nn.Module, axis: Axis, sequence_parallel: bool) -> nn.Module:
    """Replace the plan's layers of a plain Llama (on the meta device) by their tp versions, in place, and declare
    what tp changes about the rest: norms and MoE blocks see part of the sequence under SP (their gradients are
    summed over tp), q/k norms part of the heads (summed over tp too), a MoE block's router counts are summed over
    tp. With tp = 1 the layers compute what the
    plain ones do, and still declare their split dimension: initialisation draws along it on every layout."""
    tied = model.shape.tie_word_embeddings
    for path, style in plan_of(model).items():
        parent, _, name = path.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, name, _parallel_version(getattr(owner, name), style, axis, sequence_parallel))
    attentions = [module for module in model.modules() if isinstance(module, Attention)]
    for module in attentions:
        module.heads = _divide(module.heads, axis.size, "num_attention_heads")
        module.kv_heads = _divide(module.kv_heads, axis.size, "num_key_value_heads")
    if tied:   # the LM head is the embedding
        model.lm_head.weight = model.model.embed_tokens.weight
    model.cross_entropy = VocabParallelCrossEntropy(axis) if axis.size > 1 else model.cross_entropy
    for module in attentions:   # q/k norms: each tp rank normalises its own heads, its gradient their part
        if axis.size > 1 and not sequence_parallel:
            for param in [*module.q_norm.parameters(), *module.k_norm.parameters()]:
                place(param, sequence_parallel=True)
    if sequence_parallel:
        for module in model.modules():
            if isinstance(module, (RMSNorm, MoE)):
                for param in module.parameters():
                    place(param, sequence_parallel=True)
        if model.moe_losses is not None and axis.size > 1:
            model.moe_losses.token_sums.append(functools.partial(all_reduce_, group=axis.group))
    return model


def _parallel_version(layer: nn.Module, style: str, axis: Axis, sequence_parallel: bool) -> nn.Module:
    h = sequence_parallel
    if style == "input":
        return ColumnInput(axis, h) if axis.size > 1 else layer
    if style == "vocab":
        return VocabParallelEmbedding(layer.num_embeddings, layer.embedding_dim, axis, sequence_parallel=h)
    if style == "row":
        return RowParallelLinear(layer.in_features, layer.out_features, axis, sequence_parallel=h)
    return ColumnParallelLinear(layer.in_features, layer.out_features, axis, sequence_parallel=h,
                                gather_input=style == "head")


def all_reduce_(tensor: torch.Tensor, group) -> None:
    dist.all_reduce(tensor, group=group)
