"""FLOP count and MFU, memory, and the metric writers (metrics.jsonl, TensorBoard, W&B).

Only global rank 0 creates a MetricsWriter; the trainer hands it plain dicts.
"""
from __future__ import annotations

import json
import os

import psutil
import torch

from nanoexp.model.llama import LlamaShape

# Dense peak FLOP/s per device, from the vendors' datasheets (without sparsity).
# bf16: NVIDIA H100 SXM / H200 SXM 989 TFLOP/s, A100 SXM 312 TFLOP/s; float32 (non-tensor-core)
# H100/H200 67, A100 19.5. CPUs have no entry: set logging.peak_tflops to get an MFU there.
PEAK_TFLOPS = {
    ("H200", "bfloat16"): 989.0, ("H100", "bfloat16"): 989.0, ("A100", "bfloat16"): 312.0,
    ("H200", "float32"): 67.0, ("H100", "float32"): 67.0, ("A100", "float32"): 19.5,
}


def flops_per_token(shape: LlamaShape, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), as in PaLM (Chowdhery et al.
    2022, appendix B): 6 * (matmul parameters) + 12 * layers * hidden * seq for attention scores
    and values. The attention term counts the full s x s matrix (not the causal half), and the
    embedding lookup is not a matmul so its parameters are left out; the LM head is counted."""
    h, i, v, L = shape.hidden_size, shape.intermediate_size, shape.vocab_size, shape.num_hidden_layers
    kv = shape.num_key_value_heads * shape.head_dim
    matmul_params = L * (2 * h * h + 2 * h * kv + 3 * h * i) + v * h
    return 6.0 * matmul_params + 12.0 * L * h * seq_len


def peak_tflops(device: torch.device, dtype: str, override: float | None) -> float | None:
    """Per-device peak TFLOP/s: the override, else the table entry of this GPU, else None."""
    if override:
        return float(override)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for (gpu, table_dtype), value in PEAK_TFLOPS.items():
            if gpu in name and table_dtype == dtype:
                return value
    return None


def peak_memory_mb(device: torch.device) -> float:
    """Max allocated memory on CUDA; resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return psutil.Process().memory_info().rss / 2**20


class MetricsWriter:
    """Appends one JSON line per record to metrics.jsonl (floats at full precision), and mirrors
    scalars to TensorBoard and W&B when enabled."""

    def __init__(self, run_dir: str, cfg, flat_config: dict):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tensorboard = self.wandb = None
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if cfg.logging.wandb.mode != "disabled":
            import wandb
            self.wandb = wandb.init(project=cfg.logging.wandb.project or cfg.general.project,
                                    entity=cfg.logging.wandb.entity, name=cfg.general.run,
                                    mode=cfg.logging.wandb.mode, dir=run_dir, config=flat_config)

    def write(self, record: dict) -> None:
        # json writes floats with repr(), which round-trips exactly: runs compare bit for bit.
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        step = record["step"]
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
