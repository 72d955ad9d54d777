"""The Llama decoder, built from tensor-parallel layers.

One class per block, each forward a few lines that read like the equations. Parameter names
match Hugging Face's LlamaForCausalLM one to one (`model.layers.3.self_attn.q_proj.weight`), on
every layout: a pipeline stage holds only its own layers but keeps their global indices.
With tp == 1 the parallel layers are plain linear/embedding ops.

Shapes: b = batch, s = sequence, h = hidden, d = head dim; under sequence parallelism the
activations between blocks are [b, s/tp, h] and the attention/MLP insides see the full s.
Under context parallelism (cp > 1) a rank holds s/cp tokens of every sample, its two zig-zag
chunks (nanoexp/parallel/zigzag.py), everywhere; only attention meets the other chunks, round a ring
of the cp ranks or by one all-gather of K/V (ctx.layout.cp_attention).
The layout (ctx.layout) says whether activations are sequence parallel and which cp attention runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nanoexp.model.moe import MoE, MoeLosses, MoeShape, moe_layer_shapes
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.placement import EMBEDDING, LM_HEAD, place
from nanoexp.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                              column_input, vocab_parallel_cross_entropy)
from nanoexp.parallel.zigzag import document_starts, zigzag_indices

try:  # optional GPU extra
    from flash_attn import flash_attn_func
except ImportError:  # pragma: no cover - not installable on CPU machines
    flash_attn_func = None


@dataclass
class LlamaShape:
    """The model's shape, as in `model.model_config` (vocab_size already padded), and the multipliers of
    its forward pass (set by model.parametrization=mup, see nanoexp/model/mup.py)."""
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_scale: float | None = None   # the factor on q·k (None: 1/sqrt(head_dim))
    logit_multiplier: float = 1.0
    moe: MoeShape | None = None   # model.moe (None: every layer dense)

    def is_moe_layer(self, n: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(n)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def layer_shapes(shape: LlamaShape, n: int) -> dict[str, tuple[int, ...]]:
    """The full shape of every parameter of decoder layer n, by Hugging Face name."""
    h, i, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q, kv, p = shape.num_attention_heads * d, shape.num_key_value_heads * d, f"model.layers.{n}."
    shapes = {p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
              p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
              p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,)}
    if shape.is_moe_layer(n):
        return {**shapes, **moe_layer_shapes(h, shape.moe, p + "mlp.")}
    return {**shapes, p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i)}


def parameter_shapes(shape: LlamaShape) -> dict[str, tuple[int, ...]]:
    """Every parameter of the whole model, in the model's order, with its full shape (a tied LM
    head is the embedding and is not listed). What counts, checks and exports parameters reads."""
    shapes = {EMBEDDING: (shape.vocab_size, shape.hidden_size)}
    for n in range(shape.num_hidden_layers):
        shapes.update(layer_shapes(shape, n))
    shapes["model.norm.weight"] = (shape.hidden_size,)
    if not shape.tie_word_embeddings:
        shapes[LM_HEAD] = (shape.vocab_size, shape.hidden_size)
    return shapes


def count_parameters(shape: LlamaShape) -> int:
    """Parameters of the whole model (all stages, unsharded), counting a tied embedding once."""
    return sum(math.prod(s) for s in parameter_shapes(shape).values())


def count_active_parameters(shape: LlamaShape) -> int:
    """Parameters a token goes through: all but the routed experts it is not sent to (top_k of E)."""
    moe = shape.moe
    if moe is None:
        return count_parameters(shape)
    moe_layers = sum(shape.is_moe_layer(n) for n in range(shape.num_hidden_layers))
    idle = (moe.num_experts - moe.top_k) * 3 * shape.hidden_size * moe.intermediate_size
    return count_parameters(shape) - moe_layers * idle


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        # Normalise in float32 (as HF does) so bf16 activations keep their precision here.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_tables(shape: LlamaShape, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [s, d] for positions 0..seq_len-1 (HF's half-split convention)."""
    d = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    """Rotate x [b, heads, s, d] by the position angles."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def causal_attention(q, k, v, scale: float | None = None):
    """q [b, nh, s, d], k/v [b, nkv, s, d] -> [b, nh, s, d], scores q·k * scale (None: 1/sqrt(d));
    flash-attn on CUDA half precision."""
    if flash_attn_func is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                              softmax_scale=scale)
        return out.transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def document_attention(q, k, v, document_ids, position_ids, kv_document_ids=None, kv_position_ids=None,
                       scale: float | None = None):
    """Causal attention within each document of packed samples: query i sees key j when both carry the same
    document id and j's position is not after i's (positions restart at 0 in each document, so within one document
    they order tokens as the sequence does). q [b, nh, s, d], k/v [b, nkv, s, d]; ids and positions [b, s] for the
    queries, and for the keys when those differ (a context-parallel chunk attending to keys it received). Scores
    q·k * scale (None: 1/sqrt(d))."""
    kv_document_ids = document_ids if kv_document_ids is None else kv_document_ids
    kv_position_ids = position_ids if kv_position_ids is None else kv_position_ids
    same_document = document_ids[:, None, :, None] == kv_document_ids[:, None, None, :]
    not_after = position_ids[:, None, :, None] >= kv_position_ids[:, None, None, :]
    mask = same_document & not_after                         # [b, 1, s, s]: one mask for every head
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape, ctx: ParallelContext):
        super().__init__()
        d = shape.head_dim
        self.heads = shape.num_attention_heads // ctx.tp          # heads on this tp rank
        self.kv_heads = shape.num_key_value_heads // ctx.tp
        self.head_dim, self.scale = d, shape.attention_scale
        self.ctx, self.sequence_parallel = ctx, ctx.layout.sequence_parallel
        self.context_attention = ctx.layout.cp_attention
        sp = dict(sequence_parallel=self.sequence_parallel)
        self.q_proj = ColumnParallelLinear(shape.hidden_size, shape.num_attention_heads * d, ctx, **sp)
        self.k_proj = ColumnParallelLinear(shape.hidden_size, shape.num_key_value_heads * d, ctx, **sp)
        self.v_proj = ColumnParallelLinear(shape.hidden_size, shape.num_key_value_heads * d, ctx, **sp)
        self.o_proj = RowParallelLinear(shape.num_attention_heads * d, shape.hidden_size, ctx, **sp)

    def forward(self, x, cos, sin, documents=None):
        x = column_input(x, self.ctx, self.sequence_parallel)   # one tp communication for q, k and v
        q = self.q_proj(x, input_is_ready=True)              # [b, s, heads*d] (full s even under SP)
        b, s, _ = q.shape
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x, input_is_ready=True).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x, input_is_ready=True).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # [b, heads, s, d]; documents (model.attention_mask=document): (document_ids, position_ids) [b, s], or
        # under cp where each token's document starts [b, s/cp] (LlamaForCausalLM.forward)
        if self.ctx.cp > 1:   # this rank's zig-zag chunks attend to the whole sequence (ring or all-gather)
            out = self.context_attention(q, k, v, self.ctx.cp_group, self.ctx.cp, self.ctx.cp_rank, self.scale,
                                         documents)
        elif documents is None:
            out = causal_attention(q, k, v, self.scale)
        else:
            out = document_attention(q, k, v, *documents, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape, ctx: ParallelContext):
        super().__init__()
        self.ctx, self.sequence_parallel = ctx, ctx.layout.sequence_parallel
        sp = dict(sequence_parallel=self.sequence_parallel)
        self.gate_proj = ColumnParallelLinear(shape.hidden_size, shape.intermediate_size, ctx, **sp)
        self.up_proj = ColumnParallelLinear(shape.hidden_size, shape.intermediate_size, ctx, **sp)
        self.down_proj = RowParallelLinear(shape.intermediate_size, shape.hidden_size, ctx, **sp)

    def forward(self, x):
        x = column_input(x, self.ctx, self.sequence_parallel)   # one tp communication for gate and up
        gate, up = self.gate_proj(x, input_is_ready=True), self.up_proj(x, input_is_ready=True)
        return self.down_proj(F.silu(gate) * up)              # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape, ctx: ParallelContext, n: int = 0, moe_losses: MoeLosses | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape, ctx)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = (MoE(shape.hidden_size, shape.moe, moe_losses, n, ctx)
                    if shape.is_moe_layer(n) else MLP(shape, ctx))

    def forward(self, x, cos, sin, documents=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, documents)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """HF's `model.*`: embedding (first stage), this stage's layers, final norm (last stage)."""

    def __init__(self, shape: LlamaShape, ctx: ParallelContext, layer_ids: list[int], moe_losses=None):
        super().__init__()
        self.embed_tokens = (VocabParallelEmbedding(shape.vocab_size, shape.hidden_size, ctx,
                                                    sequence_parallel=ctx.layout.sequence_parallel)
                             if ctx.is_first_stage else None)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(shape, ctx, i, moe_losses) for i in layer_ids})
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps) if ctx.is_last_stage else None


class LlamaForCausalLM(nn.Module):
    """One pipeline stage of a Llama (the whole model when pp == 1).

    ``layer_ids``: the global layer indices of each chunk this rank holds (Layout.stage_layers; one chunk
    without virtual stages), run one at a time by ``forward(chunk=c)``; None: every layer in one chunk. The
    embedding belongs to chunk 0 of the first stage, the final norm and LM head to the last chunk of the last
    stage. Parameter names do not depend on the chunking."""

    def __init__(self, shape: LlamaShape, ctx: ParallelContext, layer_ids: list[range] | None = None,
                 recompute_layer: bool = False):
        super().__init__()
        self.shape, self.ctx = shape, ctx
        self.sequence_parallel, self.recompute_layer = ctx.layout.sequence_parallel, recompute_layer
        self.chunks = [range(shape.num_hidden_layers)] if layer_ids is None else list(layer_ids)
        self.moe_losses = (MoeLosses(ctx, shape.moe, [n for n in range(shape.num_hidden_layers)
                                                      if shape.is_moe_layer(n)]) if shape.moe else None)
        self.model = LlamaBody(shape, ctx, [i for chunk in self.chunks for i in chunk], self.moe_losses)
        self.lm_head = None
        if ctx.is_last_stage:
            self.lm_head = ColumnParallelLinear(shape.hidden_size, shape.vocab_size, ctx,
                                                sequence_parallel=self.sequence_parallel)
        self.tie_embeddings()
        # Under SP the norm weights see only part of the sequence: their grads are summed over tp.
        for module in self.modules():
            if isinstance(module, RMSNorm):
                place(module.weight, sequence_parallel=self.sequence_parallel)

    def tie_embeddings(self) -> None:
        """With tie_word_embeddings the LM head is the embedding, where the layout puts it
        (Layout.lm_head_weight): the same tensor on one stage, or a copy on the last stage."""
        tied, layout, pp_rank = self.shape.tie_word_embeddings, self.ctx.layout, self.ctx.pp_rank
        if layout.embedding_has_copy(pp_rank, tied):
            place(self.model.embed_tokens.weight, tied_across_stages=True)
        head = layout.lm_head_weight(pp_rank, tied)
        if head == "embedding":
            self.lm_head.weight = self.model.embed_tokens.weight
        elif head == "copy":
            place(self.lm_head.weight, tied_across_stages=True, tied_copy=True)

    def has_embedding(self, chunk: int = 0) -> bool:
        return self.ctx.is_first_stage and chunk == 0

    def has_head(self, chunk: int = 0) -> bool:
        return self.ctx.is_last_stage and chunk == len(self.chunks) - 1

    def chunk_units(self, chunk: int) -> list[tuple[nn.Module, list[nn.Parameter]]]:
        """The modules forward(chunk=chunk) runs, in order, each with its parameters: the embedding, the
        layers, the final norm, the LM head (whose weight is the embedding's when tied on one stage)."""
        modules = [self.model.layers[str(i)] for i in self.chunks[chunk]]
        if self.has_embedding(chunk):
            modules.insert(0, self.model.embed_tokens)
        if self.has_head(chunk):
            modules += [self.model.norm, self.lm_head]
        return [(module, list(module.parameters())) for module in modules]

    def units_by_chunk(self) -> list[list[tuple[nn.Module, list[nn.Parameter]]]]:
        """`chunk_units` of every chunk, in chunk order (what GradientSync takes)."""
        return [self.chunk_units(c) for c in range(len(self.chunks))]

    def forward(self, input_ids=None, hidden_states=None, labels=None, chunk: int = 0, position_ids=None,
                document_ids=None):
        """First stage (chunk 0): input_ids [b, s]. Otherwise: hidden_states from the previous stage.
        The last stage's last chunk returns the per-token losses [b, s] when labels are given (0 where
        a label is -100; the caller chooses the normalisation), else this rank's logits shard; other
        stages and chunks return hidden states. With document_ids and position_ids [b, s] (every stage
        gets them) attention stays within each document and rotary positions restart in each."""
        x = self.model.embed_tokens(input_ids) if self.has_embedding(chunk) else hidden_states
        seq_len = x.shape[1] * (self.ctx.tp if self.sequence_parallel else 1)   # SP: x holds s/tp
        cos, sin = self.rotary(seq_len, x.device)
        documents = None
        if document_ids is not None:   # positions restart in each document (under cp: of the whole sequence)
            cos, sin = rotary_tables(self.shape, seq_len * self.ctx.cp, x.device)
            cos, sin = cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)   # [b, 1, s, d]
            documents = ((document_ids, position_ids) if self.ctx.cp == 1    # computed once for every layer
                         else document_starts(position_ids, self.ctx.cp, self.ctx.cp_rank))
        for layer in (self.model.layers[str(i)] for i in self.chunks[chunk]):
            if self.recompute_layer and self.training:
                x = checkpoint(layer, x, cos, sin, documents, use_reentrant=False)
            else:
                x = layer(x, cos, sin, documents)
        if not self.has_head(chunk):
            return x
        logits = self.logits(x)                              # [b, s, vocab/tp]
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels, self.ctx)

    def rotary(self, local_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [s_local, d] at the positions of this rank's tokens: 0..s-1, or under cp the
        positions of its two zig-zag chunks of the s = local_len * cp tokens."""
        cp = self.ctx.cp
        cos, sin = rotary_tables(self.shape, local_len * cp, device)
        if cp == 1:
            return cos, sin
        positions = zigzag_indices(local_len * cp, cp, self.ctx.cp_rank).to(device)
        return cos[positions], sin[positions]

    def logits(self, x):
        """The LM head on the final norm of the last hidden states (times 1/m under µP)."""
        logits = self.lm_head(self.model.norm(x))
        return logits if self.shape.logit_multiplier == 1.0 else logits * self.shape.logit_multiplier
