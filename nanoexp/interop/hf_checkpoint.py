"""Whole checkpoints to and from Hugging Face folders (scripts/convert_to_hf.py, scripts/convert_from_hf.py).

`convert_to_hf` exports a checkpoint of any layout as a transformers Llama folder (a mixture of experts as
Mixtral, or with q/k norms as Qwen3-MoE: nanoexp.interop.hf.hf_architecture): config.json (vocab_size = nanoexp's padded vocabulary), model.safetensors (float32) and the
tokenizer files. A µP model's multipliers are baked into the weights (nanoexp.interop.hf.bake_multipliers), so
transformers' Llama gives its logits. `convert_from_hf` writes a local HF Llama, Mixtral or Qwen3-MoE folder as a nanoexp
checkpoint at step 0 without optimizer state, and returns the overrides that give nanoexp its shape and tokenizer.
The tensor names and configs themselves are nanoexp.interop.hf's.
"""
from __future__ import annotations

import json
import os

from omegaconf import OmegaConf
from safetensors.torch import save_file

from nanoexp.checkpoint import CheckpointManager, Progress
from nanoexp.checkpoint.load import check_compatible, checked_input
from nanoexp.config import ConfigError, compose
from nanoexp.data.tokenizer import build_tokenizer
from nanoexp.interop import check_output_folder
from nanoexp.interop.hf import (MIXTRAL, QWEN3_MOE, bake_multipliers, hf_architecture, hf_config, hf_mismatch,
                                hf_name, parameter_shapes, read_hf_config, write_tokenizer)
from nanoexp.parallel.context import ParallelContext
from nanoexp.checks import check_config
from nanoexp.runtime.build import build_model
from nanoexp.model.shape import model_shape
from nanoexp.runtime.optim import build_optimizer


def convert_to_hf(checkpoint: str, out: str) -> None:
    """Write the checkpoint folder `checkpoint` (<checkpoints_path>/<step>) as the Hugging Face folder `out` (new or
    empty: nothing is overwritten)."""
    check_output_folder(out, "the Hugging Face model")
    reader = checked_input(checkpoint)
    cfg = OmegaConf.create(reader.meta["config"])
    shape = model_shape(cfg)
    if hf_mismatch(shape):
        raise ConfigError(f"{checkpoint} holds a model no Hugging Face architecture holds: {hf_mismatch(shape)}")
    check_compatible(reader, shape)
    tokenizer = build_tokenizer(cfg.tokenizer.tokenizer_name_or_path)
    tensors = {name: reader.full_tensor(name).contiguous() for name in parameter_shapes(shape)}
    os.makedirs(out, exist_ok=True)
    tensors, shape = bake_multipliers(tensors, shape)
    architecture = hf_architecture(shape)
    tensors = {hf_name(name, architecture): tensor for name, tensor in tensors.items()}   # its names for MoE blocks
    weights = os.path.join(out, "model.safetensors")
    save_file(tensors, weights, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(weights, 0o666 & ~umask)   # safetensors writes 0600, like a temporary file: these are for others
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config(shape, tokenizer.eod_id), f, indent=2)
    write_tokenizer(cfg.tokenizer.tokenizer_name_or_path, out)


def model_overrides(hf_dir: str) -> list[str]:
    """The config overrides that give nanoexp the HF model's shape and tokenizer."""
    c = read_hf_config(hf_dir)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings")
    out = [f"model.model_config.{k}={str(c[k]).lower() if isinstance(c[k], bool) else c[k]}" for k in keys]
    if c.get("model_type") == MIXTRAL:   # a mixture of experts: every layer, no shared experts, renormalised
        out += [f"model.moe.num_experts={c['num_local_experts']}", f"model.moe.top_k={c['num_experts_per_tok']}",
                f"model.moe.moe_intermediate_size={c['intermediate_size']}", "model.moe.num_shared_experts=0",
                "model.moe.layer_frequency=1", "model.moe.router=softmax_topk_normalized"]
    if c.get("model_type") == QWEN3_MOE:   # q/k norms, no shared experts, MoE every decoder_sparse_step-th layer
        router = "softmax_topk_normalized" if c.get("norm_topk_prob") else "softmax_topk"
        out += ["model.model_config.qk_norm=true", f"model.moe.num_experts={c['num_experts']}",
                f"model.moe.top_k={c['num_experts_per_tok']}",
                f"model.moe.moe_intermediate_size={c['moe_intermediate_size']}", "model.moe.num_shared_experts=0",
                f"model.moe.layer_frequency={c.get('decoder_sparse_step', 1)}", f"model.moe.router={router}",
                f"model.moe.aux_loss_coef={c.get('router_aux_loss_coef', 0.001)}"]
    has_tokenizer = any(os.path.isfile(os.path.join(hf_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    return out + [f"tokenizer.tokenizer_name_or_path={os.path.abspath(hf_dir) if has_tokenizer else 'byte'}"]


def convert_from_hf(hf_dir: str, out: str, overrides: list[str]) -> list[str]:
    """Write the HF folder `hf_dir` as the checkpoint `out`/0 (`out` new or empty); return the overrides to train
    from it with."""
    check_output_folder(out, "the nanoexp checkpoint")
    config = os.path.join(hf_dir, "config.json")
    try:
        overrides = model_overrides(hf_dir) + overrides
    except json.JSONDecodeError as error:
        raise ConfigError(f"{config}: not valid JSON ({error})") from None
    except (OSError, ValueError) as error:   # no config.json, an architecture nanoexp's Llama lacks: named already
        raise ConfigError(str(error)) from None
    except KeyError as error:
        raise ConfigError(f"{config} lacks {error}") from None
    cfg = compose(overrides + [f"model.init_method.path={os.path.abspath(hf_dir)}",
                               "parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1"])
    check_config(cfg, world_size=1)
    cfg.checkpoint.checkpoints_path = out
    ctx = ParallelContext()
    model = build_model(cfg, ctx)
    CheckpointManager(cfg, ctx, out).save(0, model, build_optimizer(cfg, model), Progress(), wait=True)
    return overrides
