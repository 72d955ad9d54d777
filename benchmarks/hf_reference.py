"""The Hugging Face side of benchmarks/bench.py: transformers' model of a nanoexp shape (LlamaForCausalLM, a
mixture of experts as MixtralForCausalLM or Qwen3MoeForCausalLM: nanoexp.interop.hf.hf_architecture), holding the
same weights, and the plain training loop around it (`PlainLoop`)."""
from __future__ import annotations

import contextlib
import os
import tempfile

import torch
import torch.nn.functional as F

from nanoexp.config import batch_accumulation, recompute_mode
from nanoexp.data.tokenizer import build_tokenizer
from nanoexp.interop.hf import MIXTRAL, hf_architecture, hf_config
from nanoexp.runtime.optim import parameter_groups


def hf_model(cfg, s, weights: dict | None):
    """HF's model of shape `s` (hf_architecture; ValueError when there is none); with `weights` (Hugging Face
    names) it holds those, else HF's own init."""
    if hf_architecture(s) != "llama":
        return moe_model(cfg, s, weights)
    from transformers import LlamaConfig, LlamaForCausalLM
    hf_cfg = LlamaConfig(hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                         num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
                         num_key_value_heads=s.num_key_value_heads, vocab_size=s.vocab_size,
                         max_position_embeddings=s.max_position_embeddings, rope_theta=s.rope_theta,
                         rms_norm_eps=s.rms_norm_eps, tie_word_embeddings=s.tie_word_embeddings,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(hf_cfg)
    if weights is not None:
        missing = model.load_state_dict(weights, strict=False)
        if missing.missing_keys or missing.unexpected_keys:
            raise RuntimeError(f"weights do not map onto the HF model: {missing}")
    return model


def moe_model(cfg, s, weights: dict | None):
    """transformers' Mixtral or Qwen3-MoE of shape `s`. The weights go through a safetensors folder with the Hub's
    names, as scripts/convert_to_hf.py writes them, so that `from_pretrained` lays them out for whichever
    transformers is installed (5 fuses each layer's experts into 3-D tensors)."""
    from safetensors.torch import save_file
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()   # from_pretrained's "Loading weights" bar would cut into the table
    config_class, model_class = ((MixtralConfig, MixtralForCausalLM) if hf_architecture(s) == MIXTRAL
                                 else (Qwen3MoeConfig, Qwen3MoeForCausalLM))
    config = config_class.from_dict(hf_config(s, build_tokenizer(cfg.tokenizer.tokenizer_name_or_path).eod_id),
                                    attn_implementation="sdpa")
    if weights is None:
        return model_class(config)
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        model, info = model_class.from_pretrained(folder, attn_implementation="sdpa", output_loading_info=True)
    if any(info.get(key) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")):
        raise RuntimeError(f"weights do not map onto the HF {model_class.__name__}: {info}")
    return model.float()


class PlainLoop:
    """HF's model of the config's shape (hf_model), trained the obvious way; with `weights` (Hugging Face names,
    nanoexp.interop.hf.hf_tensors of `trainer.model`) it starts from those, else from HF's own init."""

    def __init__(self, cfg, s, weights: dict | None = None):
        self.model = hf_model(cfg, s, weights)
        self.model.train()
        # HF's load-balancing loss pools the MoE layers' tokens and counts top_k assignments per token: with
        # equal loads in every layer it is top_k x nanoexp's per-layer aux, which nanoexp sums over the layers.
        moe_layers = sum(s.is_moe_layer(n) for n in range(s.num_hidden_layers))
        self.aux_weight = 0.0 if s.moe is None else s.moe.aux_loss_coef * moe_layers / s.moe.top_k
        if recompute_mode(cfg) != "none":   # HF's checkpointing is whole layers: the same gradients as any mode
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.model.fp8.enabled:   # torchao's own Float8Linear on the same linears: the peer of nanoexp's FP8
            from torchao.float8 import convert_to_float8_training
            from nanoexp.numerics.fp8 import emulated, float8_config
            kept = list(cfg.model.fp8.filter_fqns)   # emulated where nanoexp's are (model.fp8.emulate, this CPU)
            convert_to_float8_training(self.model, config=float8_config(cfg.model.fp8.recipe, emulated(cfg)),
                                       module_filter_fn=lambda module, fqn: not any(part in fqn for part in kept))
        if cfg.model.compile:
            for layer in self.model.model.layers:
                layer.compile()
        o, f = cfg.optimizer, cfg.optimizer.optimizer_factory
        fused = bool(f.torch_adam_is_fused)
        self.optimizer = torch.optim.AdamW(parameter_groups(self.model, o.weight_decay),
                                           lr=o.learning_rate_scheduler.learning_rate,
                                           betas=(f.adam_beta1, f.adam_beta2), eps=f.adam_eps,
                                           fused=fused or None, foreach=None if fused else True)
        self.clip, self.accumulation = o.clip_grad, batch_accumulation(cfg)
        self.autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if cfg.model.dtype == "bfloat16"
                         else contextlib.nullcontext())

    def losses(self, mb) -> tuple[torch.Tensor, torch.Tensor]:
        """The language-model loss and the loss trained on (plus, for a MoE, the load-balancing loss)."""
        moe = self.aux_weight > 0
        with self.autocast:
            out = self.model(input_ids=mb["input_ids"], **({"output_router_logits": True} if moe else {}))
        lm = F.cross_entropy(out.logits.float().flatten(0, 1), mb["labels"].flatten())
        return lm, (lm + self.aux_weight * out.aux_loss if moe else lm)

    def train_step(self, micro_batches, lr: float) -> float:
        """One optimizer step; returns the language-model loss (as nanoexp's train_step)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = 0.0
        for mb in micro_batches:
            lm, loss = self.losses(mb)
            (loss / self.accumulation).backward()
            total += lm.item() / self.accumulation
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total
