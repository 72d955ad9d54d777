"""Building this rank's shard of the model from the config: its shape, its pipeline stage's layers
(or chunks of them), its tensor-parallel slices, initial weights (seeded, or a Hugging Face model's)."""
from __future__ import annotations

from nanoexp import config as C
from nanoexp.hf import load_hf_weights
from nanoexp.model.llama import LlamaForCausalLM, LlamaShape, init_weights
from nanoexp.model.mup import parametrization_of
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.pipeline import split_layers


def model_shape(cfg) -> LlamaShape:
    m, mup = cfg.model.model_config, parametrization_of(cfg)
    return LlamaShape(hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                      num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
                      num_key_value_heads=C.num_kv_heads(cfg), vocab_size=C.padded_vocab_size(cfg),
                      max_position_embeddings=m.max_position_embeddings, rope_theta=m.rope_theta,
                      rms_norm_eps=m.rms_norm_eps, tie_word_embeddings=m.tie_word_embeddings,
                      attention_scale=mup.attention_scale(m.hidden_size // m.num_attention_heads),
                      logit_multiplier=mup.logit_multiplier)


def build_model(cfg, ctx: ParallelContext) -> LlamaForCausalLM:
    """This rank's shard of the model, on its device: its pipeline stage's layers, its tensor-parallel
    slices. With v = parallelism.pp_virtual_stages > 1 the layers form pp·v stages and this rank holds
    v chunks of them: chunk c is stage c·pp + pp_rank (interleaved 1F1B). model.compile compiles each
    decoder block."""
    shape = model_shape(cfg)
    v = cfg.parallelism.pp_virtual_stages
    stages = split_layers(shape.num_hidden_layers, ctx.pp * v)
    layer_ids = [stages[c * ctx.pp + ctx.pp_rank] for c in range(v)] if v > 1 else stages[ctx.pp_rank]
    model = LlamaForCausalLM(shape, ctx, layer_ids, sequence_parallel=cfg.parallelism.tp_mode == "reduce_scatter",
                             recompute_layer=cfg.parallelism.recompute_layer, cp_mode=cfg.parallelism.cp_mode)
    init_weights(model, cfg.model.init_method.std, cfg.general.seed, parametrization_of(cfg))
    if cfg.model.init_method.path:   # start from a local Hugging Face Llama's weights
        load_hf_weights(model, cfg.model.init_method.path, ctx)
    if cfg.model.compile:
        for layer in model.model.layers.values():
            layer.compile()
    return model.to(ctx.device)
