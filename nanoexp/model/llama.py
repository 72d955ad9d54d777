"""The Llama decoder, plain: one process's whole model, with no process group in it.

One class per block, each forward a few lines that read like the equations. Parameter names match Hugging Face's
LlamaForCausalLM one to one (`model.layers.3.self_attn.q_proj.weight`). The parallel dimensions are applied to
this model after it is built (nanoexp/parallel/parallelize.py): they replace its projections, attention kernels
and loss with sharded ones and keep only a pipeline stage's layers, which keep their global indices.

Shapes: b = batch, s = sequence, h = hidden, d = head dim. Each block reads its input through an
`nn.Identity` slot (`qkv_input`, `mlp_input`) that tensor parallelism fills with its one communication for the
projections that share the input; the model itself never communicates. What a layer keeps for backward
(recomputation, offload) is set from outside too: nanoexp/runtime/recompute.py replaces the forward of the layers
it recomputes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoexp.model.attention import Causal, Documents, attention_kernel
from nanoexp.model.linear import Linear
from nanoexp.model.moe import MoE, MoeLosses, MoeShape, moe_layer_shapes, routes_with_bias

EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
IGNORE_INDEX = -100   # a label the loss skips (padding, the end of a packed document's context)


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
    attention_kernel: str = "auto"   # model.attention_kernel (attention.py)
    qk_norm: bool = False   # an RMSNorm over each head's q and k before the rotation (Qwen3's)

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
              p + "self_attn.o_proj.weight": (h, q)}
    if shape.qk_norm:
        shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    shapes[p + "post_attention_layernorm.weight"] = (h,)
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


def buffer_shapes(shape: LlamaShape) -> dict[str, tuple[int, ...]]:
    """The buffers checkpoints keep beside the parameters: each MoE layer's routing bias under balance=bias."""
    if shape.moe is None or not routes_with_bias(shape.moe.balance):
        return {}
    return {f"model.layers.{n}.mlp.expert_bias": (shape.moe.num_experts,) for n in range(shape.num_hidden_layers)
            if shape.is_moe_layer(n)}


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


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        d = shape.head_dim
        self.heads, self.kv_heads = shape.num_attention_heads, shape.num_key_value_heads   # on this rank
        self.head_dim, self.scale = d, shape.attention_scale
        self.qkv_input = nn.Identity()
        self.q_proj = Linear(shape.hidden_size, shape.num_attention_heads * d)
        self.k_proj = Linear(shape.hidden_size, shape.num_key_value_heads * d)
        self.v_proj = Linear(shape.hidden_size, shape.num_key_value_heads * d)
        self.o_proj = Linear(shape.num_attention_heads * d, shape.hidden_size)
        self.q_norm = RMSNorm(d, shape.rms_norm_eps) if shape.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(d, shape.rms_norm_eps) if shape.qk_norm else nn.Identity()
        self.kernel = attention_kernel(shape.attention_kernel)

    def forward(self, x, cos, sin, mask):
        x = self.qkv_input(x)
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.heads, self.head_dim)).transpose(1, 2)   # [b, heads, s, d]
        k = self.k_norm(self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.kernel(q, k, v, self.scale, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.mlp_input = nn.Identity()
        self.gate_proj = Linear(shape.hidden_size, shape.intermediate_size)
        self.up_proj = Linear(shape.hidden_size, shape.intermediate_size)
        self.down_proj = Linear(shape.intermediate_size, shape.hidden_size)

    def forward(self, x):
        x = self.mlp_input(x)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))   # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape, n: int = 0, moe_losses: MoeLosses | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MoE(shape.hidden_size, shape.moe, moe_losses, n) if shape.is_moe_layer(n) else MLP(shape)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """HF's `model.*`: the embedding, the layers (keyed by their global index), the final norm; a pipeline stage
    keeps its own (None where it has none)."""

    def __init__(self, shape: LlamaShape, moe_losses=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(shape, i, moe_losses) for i in range(shape.num_hidden_layers)})
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class CrossEntropy(nn.Module):
    """Per-token cross-entropy in float32, 0 (and no gradient) where the label is IGNORE_INDEX."""

    def forward(self, logits, labels):
        flat = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none",
                               ignore_index=IGNORE_INDEX)
        return flat.view(labels.shape)


class LlamaForCausalLM(nn.Module):
    """A Llama, or the part of one a pipeline stage holds.

    `chunks`: the global layer indices of each chunk this model runs, one at a time, by `forward(chunk=c)`:
    every layer in one chunk as built; a pipeline stage's chunks once split (virtual stages give several). The
    embedding belongs to chunk 0 of the first stage, the final norm and LM head to the last chunk of the last
    stage. Parameter names do not depend on the chunking."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.shape = shape
        self.chunks = [range(shape.num_hidden_layers)]
        self.moe_losses = (MoeLosses(shape.moe, [n for n in range(shape.num_hidden_layers) if shape.is_moe_layer(n)])
                           if shape.moe else None)
        self.model = LlamaBody(shape, self.moe_losses)
        self.lm_head = Linear(shape.hidden_size, shape.vocab_size)
        self.cross_entropy = CrossEntropy()
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._rotary = {}   # device -> cos, sin tables of every position

    def has_embedding(self, chunk: int = 0) -> bool:
        return self.model.embed_tokens is not None and chunk == 0

    def has_head(self, chunk: int = 0) -> bool:
        return self.lm_head is not None and chunk == len(self.chunks) - 1

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
        """Chunk 0 of the first stage reads input_ids [b, s], the others the hidden states of the chunk before.
        The loss chunk returns the per-token losses [b, s] when labels are given (0 where a label is
        IGNORE_INDEX; the caller chooses the normalisation), else the logits; other chunks return hidden states.
        position_ids: the positions of the tokens the attention sees, [s] or, with document_ids (attention within
        each document), [b, s], counting from 0 in each document; default 0 .. s-1."""
        x = self.model.embed_tokens(input_ids) if self.has_embedding(chunk) else hidden_states
        if position_ids is None:
            position_ids = torch.arange((input_ids if input_ids is not None else x).shape[1], device=x.device)
        cos, sin = self.rotary(position_ids)
        mask = Causal() if document_ids is None else Documents(document_ids, position_ids)
        for layer in (self.model.layers[str(i)] for i in self.chunks[chunk]):
            x = layer(x, cos, sin, mask)
        if not self.has_head(chunk):
            return x
        logits = self.logits(x)                              # [b, s, vocab] (a shard of the vocabulary under tp)
        return logits if labels is None else self.cross_entropy(logits, labels)

    def rotary(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at `position_ids`: [s, d], or [b, 1, s, d] for per-sample positions."""
        device = position_ids.device
        if device not in self._rotary:
            self._rotary[device] = rotary_tables(self.shape, self.shape.max_position_embeddings, device)
        cos, sin = (table[position_ids] for table in self._rotary[device])
        return (cos, sin) if position_ids.dim() == 1 else (cos.unsqueeze(1), sin.unsqueeze(1))

    def logits(self, x):
        """The LM head on the final norm of the last hidden states (times 1/m under µP)."""
        logits = self.lm_head(self.model.norm(x))
        return logits if self.shape.logit_multiplier == 1.0 else logits * self.shape.logit_multiplier
