"""A model's shape from the config: the LlamaShape (and MoeShape) that building, the memory estimate, the planner,
checkpoints and the reports all read, computed in one place."""
from __future__ import annotations

from nanoexp.config import num_kv_heads, padded_vocab_size
from nanoexp.model.llama import LlamaShape
from nanoexp.model.moe import DEFAULT_BIAS_UPDATE_RATE, MoeShape
from nanoexp.model.mup import parametrization_of


def moe_shape(cfg) -> MoeShape | None:
    """model.moe for the layers (None for a dense model)."""
    moe = cfg.model.moe
    if moe.num_experts == 0:
        return None
    return MoeShape(num_experts=moe.num_experts, top_k=moe.top_k,
                    intermediate_size=moe.moe_intermediate_size or cfg.model.model_config.intermediate_size,
                    num_shared_experts=moe.num_shared_experts, layer_frequency=moe.layer_frequency,
                    normalize_top_k=moe.router == "softmax_topk_normalized", aux_loss_coef=moe.aux_loss_coef,
                    z_loss_coef=moe.z_loss_coef, capacity_factor=moe.capacity_factor,
                    router_multiplier=parametrization_of(cfg).logit_multiplier,
                    # .get: a checkpoint's config from before these keys
                    expert_kernel=moe.get("expert_kernel", "grouped_mm"), balance=moe.get("balance", "aux_loss"),
                    bias_update_rate=(DEFAULT_BIAS_UPDATE_RATE if moe.get("bias_update_rate") is None
                                      else moe.bias_update_rate),
                    seq_aux_loss_coef=moe.get("seq_aux_loss_coef", 0.0))


def model_shape(cfg) -> LlamaShape:
    m, mup = cfg.model.model_config, parametrization_of(cfg)
    return LlamaShape(hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                      num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
                      num_key_value_heads=num_kv_heads(cfg), vocab_size=padded_vocab_size(cfg),
                      max_position_embeddings=m.max_position_embeddings, rope_theta=m.rope_theta,
                      rms_norm_eps=m.rms_norm_eps, tie_word_embeddings=m.tie_word_embeddings,
                      attention_scale=mup.attention_scale(m.hidden_size // m.num_attention_heads),
                      logit_multiplier=mup.logit_multiplier, moe=moe_shape(cfg),
                      attention_kernel=cfg.model.get("attention_kernel", "auto"), qk_norm=m.get("qk_norm", False))
