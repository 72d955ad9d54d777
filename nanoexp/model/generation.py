"""Autoregressive decoding with a KV cache, for one process holding the whole model (tp = pp = 1).

It reuses the blocks of llama.py (norms, projections, rotary embeddings, attention kernel, MLP) and only
changes the attention step: keys and values of earlier positions are kept per layer, so each new token costs
one position's work instead of re-running the whole prefix.
"""
from __future__ import annotations

import torch

from nanoexp.model.attention import Causal
from nanoexp.model.llama import LlamaForCausalLM, apply_rotary


class KVCache:
    """Per layer: keys and values [b, kv_heads, positions so far, d]."""

    def __init__(self):
        self.keys: dict[str, torch.Tensor] = {}
        self.values: dict[str, torch.Tensor] = {}

    def extend(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.keys:
            k, v = torch.cat([self.keys[layer], k], dim=2), torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    @property
    def length(self) -> int:
        """Cached positions (read it before a forward step: layers extend the cache one by one)."""
        return next(iter(self.keys.values())).shape[2] if self.keys else 0


def _attend(attn, x, cos, sin, cache: KVCache, layer: str, start: int):
    """The Attention block on new positions x [b, s, h] (the first at position `start`), reading
    and extending this layer's cache."""
    b, s, _ = x.shape
    q = attn.q_proj(x).view(b, s, attn.heads, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(b, s, attn.kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(b, s, attn.kv_heads, attn.head_dim).transpose(1, 2)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k, v = cache.extend(layer, k, v)
    out = attn.kernel(q, k, v, attn.scale, Causal(offset=start))   # new query i sits at position start + i
    return attn.o_proj(out.transpose(1, 2).reshape(b, s, attn.heads * attn.head_dim))


def is_whole(model: LlamaForCausalLM) -> bool:
    """Whether `model` holds every layer and unsplit weights (one process's model)."""
    return (model.model.embed_tokens is not None and model.lm_head is not None
            and len(model.model.layers) == model.shape.num_hidden_layers
            and all(getattr(p, "placement", None) is None or p.placement.parts == 1 for p in model.parameters()))


@torch.no_grad()
def forward_with_cache(model: LlamaForCausalLM, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [b, s, vocab] of the new tokens input_ids [b, s], which follow the cached positions."""
    if not is_whole(model):
        raise ValueError("KV-cache decoding runs on one process holding the whole model (tp = pp = 1)")
    start, s = cache.length, input_ids.shape[1]
    cos, sin = model.rotary(torch.arange(start, start + s, device=input_ids.device))
    x = model.model.embed_tokens(input_ids)
    for name, layer in model.model.layers.items():
        x = x + _attend(layer.self_attn, layer.input_layernorm(x), cos, sin, cache, name, start)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.logits(x)


@torch.no_grad()
def generate(model: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int, vocab_size: int,
             temperature: float = 0.0, top_k: int | None = None, stop_id: int | None = None,
             generator: torch.Generator | None = None) -> list[int]:
    """New token ids after the prompt: greedy when temperature == 0, else sampled (optionally top-k).
    Ids >= vocab_size (the vocabulary's padding) are never produced; stops after `stop_id`."""
    cache, out = KVCache(), []
    ids = torch.tensor([prompt_ids], device=model.model.embed_tokens.weight.device)
    limit = model.shape.max_position_embeddings
    for _ in range(max_new_tokens):
        if cache.length + ids.shape[1] > limit:
            break
        logits = forward_with_cache(model, ids, cache)[0, -1].float()
        logits[vocab_size:] = float("-inf")
        if temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                threshold = torch.topk(logits, min(top_k, vocab_size)).values[-1]
                logits[logits < threshold] = float("-inf")
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        out.append(token)
        if token == stop_id:
            break
        ids = torch.tensor([[token]], device=ids.device)
    return out
