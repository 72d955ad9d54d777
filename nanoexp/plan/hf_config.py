"""A Hugging Face config.json as nanoexp overrides, for planning a model that has no conf/model/ group:
Llama (LlamaForCausalLM), Mixtral (every layer num_local_experts experts of intermediate_size) and Qwen-MoE
(Qwen2-MoE / Qwen3-MoE: num_experts of moe_intermediate_size every decoder_sparse_step layers, Qwen2's shared
expert counted as shared_expert_intermediate_size / moe_intermediate_size experts; Qwen3's q/k norms). A head_dim other than hidden / heads (Qwen3's) is not read: nanoexp derives it.

    python scripts/plan.py --hf-config path/to/config.json --gpus 64 --gpu h100
"""
from __future__ import annotations

import json

SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
              "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")


def _value(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def overrides_of(path: str) -> list[str]:
    """Hydra overrides (model=llama3_8b's dtype and defaults, this shape) for the config.json at `path`.
    ValueError for a model type it does not know."""
    with open(path) as f:
        config = json.load(f)
    model_type = config.get("model_type", "llama")
    if model_type not in ("llama", "mixtral", "qwen2_moe", "qwen3_moe"):
        raise ValueError(f"{path}: model_type {model_type!r} is not one of llama, mixtral, qwen2_moe, qwen3_moe")
    out = ["model=llama3_8b"]
    out += [f"model.model_config.{key}={_value(config[key])}" for key in SHAPE_KEYS if key in config]
    out.append(f"model.model_config.num_key_value_heads={config.get('num_key_value_heads', config['num_attention_heads'])}")
    if "rope_theta" in config:
        out.append(f"model.model_config.rope_theta={float(config['rope_theta'])}")
    if model_type == "mixtral":
        out += [f"model.moe.num_experts={config['num_local_experts']}", f"model.moe.top_k={config['num_experts_per_tok']}",
                f"model.moe.moe_intermediate_size={config['intermediate_size']}", "model.moe.num_shared_experts=0",
                "model.moe.layer_frequency=1"]
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        width = config["moe_intermediate_size"]
        shared = config.get("shared_expert_intermediate_size", 0) // width
        out += [f"model.moe.num_experts={config['num_experts']}", f"model.moe.top_k={config['num_experts_per_tok']}",
                f"model.moe.moe_intermediate_size={width}", f"model.moe.num_shared_experts={shared}",
                f"model.moe.layer_frequency={config.get('decoder_sparse_step', 1)}",
                "model.moe.router=" + ("softmax_topk_normalized" if config.get("norm_topk_prob") else "softmax_topk")]
        if model_type == "qwen3_moe":
            out.append("model.model_config.qk_norm=true")
    return out
