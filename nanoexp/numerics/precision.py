"""model.dtype as a context: float32 runs as written; bfloat16 runs the forward under autocast (weights, gradients
and optimizer state stay float32), so matmuls and attention take bf16 inputs and norms, softmax and the loss keep
float32."""
from __future__ import annotations

import contextlib

import torch


def autocast(cfg, device: torch.device):
    """The context every forward runs in."""
    if cfg.model.dtype == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
