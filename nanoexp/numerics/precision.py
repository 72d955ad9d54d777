"""model.dtype as a context: float32 runs as written; bfloat16 runs the forward under autocast (weights, gradients
and optimizer state stay float32), so matmuls and attention take bf16 inputs and norms, softmax and the loss keep
float32. On CUDA, float32 matmuls use TF32 tensor cores (10-bit mantissa inputs, float32 accumulation) unless
model.allow_tf32=false: without them a float32 run takes the GPU's plain FP32 path, several times slower."""
from __future__ import annotations

import contextlib

import torch


def autocast(cfg, device: torch.device):
    """The context every forward runs in."""
    if cfg.model.dtype == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def tf32_enabled(cfg, device: torch.device) -> bool:
    """Whether float32 matmuls run in TF32: model.allow_tf32, whose null means on CUDA."""
    allowed = cfg.model.allow_tf32
    return device.type == "cuda" and (allowed is None or bool(allowed))


def set_tf32(cfg, device: torch.device) -> bool:
    """Apply model.allow_tf32 to this process's CUDA matmuls and convolutions; returns whether TF32 is on."""
    enabled = tf32_enabled(cfg, device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled
    return enabled
