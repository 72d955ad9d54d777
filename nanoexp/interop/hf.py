"""Hugging Face transformers interop: config.json, tokenizer files, weights.

nanoexp's parameter names already equal LlamaForCausalLM's, so the mapping is the identity (full
shapes: `nanoexp.model.llama.parameter_shapes`), except a mixture of experts' blocks, which are named as
Mixtral's or Qwen3-MoE's checkpoints name them (`hf_name`); what this module adds is the choice of the
architecture (`hf_architecture`: Llama; a mixture of experts as Mixtral, or with q/k norms as Qwen3-MoE), the
translation between `model.model_config` and HF's configs, loading HF weights on any layout, and the tokenizer
files for the built-in byte tokenizer.

Vocabulary: HF's `vocab_size` is nanoexp's padded vocabulary (`model.make_vocab_size_divisible_by`),
so the weights and logits keep their shape. The padding ids never occur in the data, so training
pushes their logits down; they stay in the softmax of a loss (as in training: evaluate.py includes
them), and generate.py never samples them.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import torch
from safetensors import safe_open

from nanoexp.model.llama import LlamaShape, parameter_shapes
from nanoexp.model.moe import routes_with_bias
from nanoexp.model.mup import ROUTER
from nanoexp.model.placement import EMBEDDING, LM_HEAD, expert_values, local_slice, placement, stored_names

EOD_TOKEN = "<|endoftext|>"


MIXTRAL, QWEN3_MOE = "mixtral", "qwen3_moe"   # the transformers model types a nanoexp mixture of experts exports as


def hf_mismatch(shape: LlamaShape) -> str | None:
    """Why no transformers architecture holds a model of this shape (None when one does, `hf_architecture`):
    Mixtral's every layer is MoE, without shared experts or q/k norms, its top-k weights renormalised; Qwen3-MoE
    has q/k norms and no shared experts; neither routes with a bias; a dense model with q/k norms (Qwen3) is
    not exported."""
    if shape.moe is None:
        return "model.model_config.qk_norm=true: a dense Qwen3 is not exported" if shape.qk_norm else None
    moe = shape.moe
    wrong = [f"model.moe.num_shared_experts={moe.num_shared_experts}"] if moe.num_shared_experts else []
    wrong += ["model.moe.balance=bias"] if routes_with_bias(moe.balance) else []
    if not shape.qk_norm:   # Mixtral
        wrong += [f"model.moe.layer_frequency={moe.layer_frequency}"] if moe.layer_frequency != 1 else []
        wrong += ["model.moe.router=softmax_topk"] if not moe.normalize_top_k else []
    return None if not wrong else (f"{', '.join(wrong)}: Hugging Face's Mixtral (every layer MoE, router "
                                   "softmax_topk_normalized) and Qwen3-MoE (model.model_config.qk_norm=true) have no "
                                   "shared experts and no routing bias")


def hf_architecture(shape: LlamaShape) -> str:
    """The transformers model_type of a model of this shape: llama, mixtral or qwen3_moe (ValueError naming the
    keys when none holds it)."""
    if hf_mismatch(shape):
        raise ValueError(f"no Hugging Face architecture for this model: {hf_mismatch(shape)}")
    if shape.moe is None:
        return "llama"
    return QWEN3_MOE if shape.qk_norm else MIXTRAL


def hf_name(name: str, architecture: str = "llama") -> str:
    """The Hugging Face name of a stored nanoexp tensor (placement.stored_names): the same for a Llama and
    Qwen3-MoE's experts; a MoE block's router is Qwen3-MoE's `mlp.gate`; Mixtral's checkpoints on the Hub name the
    block `block_sparse_moe` (gate, experts.<e>.w1 / w3 / w2 = gate / up / down)."""
    if architecture == QWEN3_MOE:
        return name.replace(".mlp.router.", ".mlp.gate.")
    if architecture != MIXTRAL:
        return name
    if ".mlp.router." in name:
        return name.replace(".mlp.router.", ".block_sparse_moe.gate.")
    if ".mlp.experts." in name:
        for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            name = name.replace(f".{ours}.", f".{theirs}.")
        return name.replace(".mlp.experts.", ".block_sparse_moe.experts.")
    return name


def hf_config(shape: LlamaShape, eod_id: int) -> dict:
    """config.json of the transformers model (hf_architecture) with this shape (vocab_size = padded vocabulary)."""
    architecture, moe = hf_architecture(shape), shape.moe
    if architecture == MIXTRAL:
        return {**llama_config(shape, eod_id), "architectures": ["MixtralForCausalLM"], "model_type": MIXTRAL,
                "intermediate_size": moe.intermediate_size, "num_local_experts": moe.num_experts,
                "num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.aux_loss_coef,
                "output_router_logits": False, "router_jitter_noise": 0.0, "sliding_window": None}
    if architecture == QWEN3_MOE:
        return {**llama_config(shape, eod_id), "architectures": ["Qwen3MoeForCausalLM"], "model_type": QWEN3_MOE,
                "moe_intermediate_size": moe.intermediate_size, "num_experts": moe.num_experts,
                "num_experts_per_tok": moe.top_k, "norm_topk_prob": moe.normalize_top_k,
                "decoder_sparse_step": moe.layer_frequency, "mlp_only_layers": [],
                "router_aux_loss_coef": moe.aux_loss_coef, "output_router_logits": False,
                "use_sliding_window": False, "sliding_window": None}
    return llama_config(shape, eod_id)


def llama_config(shape: LlamaShape, eod_id: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
            "num_hidden_layers": shape.num_hidden_layers, "num_attention_heads": shape.num_attention_heads,
            "num_key_value_heads": shape.num_key_value_heads, "head_dim": shape.head_dim,
            "vocab_size": shape.vocab_size, "max_position_embeddings": shape.max_position_embeddings,
            "rope_theta": shape.rope_theta, "rope_scaling": None, "rms_norm_eps": shape.rms_norm_eps,
            "tie_word_embeddings": shape.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
            "attention_dropout": 0.0, "bos_token_id": eod_id, "eos_token_id": eod_id,
            "torch_dtype": "float32", "initializer_range": 0.02}


def bake_multipliers(tensors: dict[str, torch.Tensor], shape: LlamaShape) -> tuple[dict, LlamaShape]:
    """Full weights and shape of a transformers Llama that computes the logits of this model, whose
    forward may carry multipliers (µP): the attention scale goes into q_proj (HF scales q·k by
    1/sqrt(head_dim); rotary embeddings are linear in q), the logit multiplier into the LM head (and a
    mixture's router multiplier into each router). A
    tied LM head gets its own scaled tensor (the embedding keeps its values): exported untied."""
    tensors = dict(tensors)
    if shape.attention_scale is not None:   # into q's last linear map: q_proj, or the q norm's weight after it
        factor = shape.attention_scale * math.sqrt(shape.head_dim)
        q = "q_norm" if shape.qk_norm else "q_proj"
        for name in [f"model.layers.{n}.self_attn.{q}.weight" for n in range(shape.num_hidden_layers)]:
            tensors[name] = tensors[name] * factor
    if shape.logit_multiplier != 1.0:
        tensors[LM_HEAD] = tensors.get(LM_HEAD, tensors[EMBEDDING]) * shape.logit_multiplier
        shape = replace(shape, tie_word_embeddings=False)
    if shape.moe is not None and shape.moe.router_multiplier != 1.0:   # into each router, as the LM head's
        for name in [n for n in tensors if n.endswith(ROUTER)]:
            tensors[name] = tensors[name] * shape.moe.router_multiplier
        shape = replace(shape, moe=replace(shape.moe, router_multiplier=1.0))
    return tensors, replace(shape, attention_scale=None, logit_multiplier=1.0)


# The model_config keys an HF config must match, and the HF key each one is read from.
MATCHED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rope_theta", "rms_norm_eps", "tie_word_embeddings")


def read_hf_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder} is not a Hugging Face model folder: {path} is missing")
    with open(path) as f:
        config = json.load(f)
    unsupported = [f"model_type={config.get('model_type')}"] if config.get("model_type", "llama") not in (
        "llama", MIXTRAL, QWEN3_MOE) else []
    unsupported += ["mlp_only_layers"] if config.get("mlp_only_layers") else []   # Qwen3-MoE's dense exceptions
    unsupported += ["use_sliding_window"] if config.get("use_sliding_window") else []
    unsupported += [f"hidden_act={config['hidden_act']}"] if config.get("hidden_act", "silu") != "silu" else []
    unsupported += [k for k in ("rope_scaling", "attention_bias", "mlp_bias") if config.get(k)]
    if unsupported:
        raise ValueError(f"{path}: nanoexp's Llama does not support {', '.join(unsupported)}")
    rope = config.get("rope_parameters") or {}   # transformers >= 5 nests rope_theta here
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{path}: nanoexp's Llama does not support rope_type={rope['rope_type']}")
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config.setdefault("tie_word_embeddings", False)
    return config


# For each transformers MoE model type: (nanoexp key, its value from the shape, the HF key) to match.
MOE_KEYS = {
    MIXTRAL: lambda moe: (("num_experts", moe.num_experts, "num_local_experts"),
                          ("top_k", moe.top_k, "num_experts_per_tok"),
                          ("moe_intermediate_size", moe.intermediate_size, "intermediate_size")),
    QWEN3_MOE: lambda moe: (("num_experts", moe.num_experts, "num_experts"),
                            ("top_k", moe.top_k, "num_experts_per_tok"),
                            ("moe_intermediate_size", moe.intermediate_size, "moe_intermediate_size"),
                            ("layer_frequency", moe.layer_frequency, "decoder_sparse_step")),
}


def check_hf_matches(config: dict, shape: LlamaShape, folder: str) -> None:
    """Raise naming the first model.model_config (or model.moe) key whose value differs from the HF config."""
    model_type = config.get("model_type", "llama")
    moe_keys = MOE_KEYS.get(model_type)
    experts = config.get("num_local_experts", config.get("num_experts", 0))
    if (moe_keys is not None) != (shape.moe is not None):
        raise ValueError(f"model.init_method.path={folder} holds a {model_type} model: set "
                         f"model.moe.num_experts={experts} to load it")
    if (model_type == QWEN3_MOE) != shape.qk_norm:
        raise ValueError(f"model.init_method.path={folder} holds a {model_type} model: set "
                         f"model.model_config.qk_norm={str(model_type == QWEN3_MOE).lower()} to load it")
    for key, ours, theirs in moe_keys(shape.moe) if moe_keys else ():
        if config.get(theirs, 1) != ours:
            raise ValueError(f"model.init_method.path={folder}: its config.json has {theirs}={config.get(theirs, 1)} "
                             f"but model.moe.{key}={ours}; set model.moe.{key}={config.get(theirs, 1)}")
    if model_type == QWEN3_MOE and config.get("norm_topk_prob", False) != shape.moe.normalize_top_k:
        router = "softmax_topk_normalized" if config.get("norm_topk_prob") else "softmax_topk"
        raise ValueError(f"model.init_method.path={folder}: its config.json has norm_topk_prob="
                         f"{config.get('norm_topk_prob', False)}; set model.moe.router={router}")
    for key in MATCHED_KEYS:
        if model_type == MIXTRAL and key == "intermediate_size":   # Mixtral's is the experts' width (above)
            continue
        ours = getattr(shape, key)
        if key in config and config[key] != ours:
            raise ValueError(f"model.init_method.path={folder}: its config.json has {key}={config[key]} but "
                             f"model.model_config.{key}={ours}; set model.model_config.{key}={config[key]}")
    if config["vocab_size"] > shape.vocab_size:
        raise ValueError(f"model.init_method.path={folder}: vocab_size={config['vocab_size']} is larger than "
                         f"the padded vocabulary {shape.vocab_size}; raise model.model_config.vocab_size")


def hf_weight_files(folder: str) -> list[str]:
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no *.safetensors weights (only safetensors are read, "
                                "never pickled .bin files)")
    return [os.path.join(folder, f) for f in files]


@torch.no_grad()
def load_hf_weights(model, folder: str) -> None:
    """Fill this rank's shard of `model` from a local HF Llama, Mixtral or Qwen3-MoE folder (any layout).
    Vocabulary rows beyond the HF vocabulary (nanoexp's padding) keep their initial values."""
    config = read_hf_config(folder)
    check_hf_matches(config, model.shape, folder)
    architecture, full_shapes = config.get("model_type", "llama"), parameter_shapes(model.shape)
    where = {}
    for path in hf_weight_files(folder):
        with safe_open(path, "pt") as f:
            where.update({key: path for key in f.keys()})

    def read(source: str) -> torch.Tensor:
        name = hf_name(source, architecture)
        if name not in where:
            raise KeyError(f"{folder} has no tensor {name}")
        with safe_open(where[name], "pt") as f:
            tensor = f.get_tensor(name).float()
        if source not in (EMBEDDING, LM_HEAD) and tuple(tensor.shape) != full_shapes[source]:
            raise ValueError(f"{where[name]}: {name} has shape {tuple(tensor.shape)}, expected {full_shapes[source]}")
        return tensor

    for name, param in model.named_parameters():
        sources = stored_names(name, param)
        if len(sources) > 1:   # a stacked routed-expert tensor: one HF tensor per expert
            param.copy_(torch.stack([read(source) for source in sources]))
            continue
        source = sources[0]
        hf_tensor = read(source)
        if source in (EMBEDDING, LM_HEAD):   # [vocab, h], split over rows
            if hf_tensor.shape[1] != param.shape[1]:
                raise ValueError(f"{folder}: {hf_name(source)} has shape {tuple(hf_tensor.shape)}, expected "
                                 f"[<= {model.shape.vocab_size}, {param.shape[1]}]")
            start = placement(param).part * param.shape[0]
            rows = hf_tensor[start:start + param.shape[0]]
            param[:rows.shape[0]].copy_(rows)   # rows past the HF vocabulary (padding) keep their init
            continue
        param.copy_(local_slice(hf_tensor, param))


def hf_tensors(model) -> dict[str, torch.Tensor]:
    """A one-process model's weights by the names of its Hugging Face architecture (hf_architecture), each
    routed expert's matrices apart: what `from_pretrained` reads."""
    architecture, out = hf_architecture(model.shape), {}
    for name, param in model.named_parameters():
        for source, values in zip(stored_names(name, param), param if expert_values(name, param) else [param]):
            out[hf_name(source, architecture)] = values.detach().contiguous()
    return out


def write_byte_tokenizer(folder: str) -> None:
    """tokenizer.json + tokenizer_config.json that make AutoTokenizer encode text to nanoexp's byte
    ids (UTF-8 byte b -> id b, no special tokens added) and <|endoftext|> to 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    # ByteLevel maps each byte to one printable character; a BPE with no merges keeps one token per byte.
    byte_to_char = _gpt2_byte_chars()
    assert set(byte_to_char.values()) == set(ByteLevel.alphabet())
    vocab = {char: b for b, char in byte_to_char.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOD_TOKEN])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD_TOKEN, "bos_token": EOD_TOKEN,
                   "model_max_length": 1 << 30, "clean_up_tokenization_spaces": False}, f, indent=2)


def _gpt2_byte_chars() -> dict[int, str]:
    """The byte -> printable character table of GPT-2's byte-level BPE (Radford et al. 2019):
    printable Latin-1 bytes map to themselves, the others to code points from 256 upwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_tokenizer(name_or_path: str, folder: str) -> None:
    """Tokenizer files for `tokenizer.tokenizer_name_or_path`: generated for "byte", copied otherwise."""
    if name_or_path == "byte":
        write_byte_tokenizer(folder)
        return
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(name_or_path, local_files_only=True).save_pretrained(folder)
