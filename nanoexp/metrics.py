"""FLOP count and MFU, memory, and the metric writers (metrics.jsonl, TensorBoard, W&B).

Only global rank 0 creates a MetricsWriter; the trainer hands it plain dicts.
"""
from __future__ import annotations

import json
import os

import psutil
import torch

from nanoexp.model.llama import LlamaShape

# Dense (no 2:4 sparsity) peak TFLOP/s per GPU and model.dtype, matched against
# torch.cuda.get_device_name in this order (so "H100 PCIe" wins over "H100").
# Sources, NVIDIA datasheets: "H200 Tensor Core GPU" (H200 SXM), "H100 Tensor Core GPU" (H100 SXM
# and PCIe), "A100 Tensor Core GPU" (A100 SXM/PCIe). bfloat16 is the tensor-core BF16 figure (the
# datasheets print it with sparsity: 1979 / 1513 / 624, halved here); float32 is the plain FP32
# (non-tensor-core) figure, since PyTorch does not use TF32 for matmuls by default. CPUs have no
# entry: set logging.peak_tflops to get an MFU there.
PEAK_TFLOPS = [
    ("H200", "bfloat16", 989.0), ("H200", "float32", 67.0),
    ("H100 PCIe", "bfloat16", 756.0), ("H100 PCIe", "float32", 51.0),
    ("H100", "bfloat16", 989.0), ("H100", "float32", 67.0),
    ("A100", "bfloat16", 312.0), ("A100", "float32", 19.5),
]


def flops_per_token(shape: LlamaShape, seq_len: int) -> float:
    """Model FLOPs per training token (forward + backward = 3x forward), as in PaLM (Chowdhery
    et al. 2022, appendix B): 6 * (matmul parameters) + 12 * layers * hidden * seq for attention
    scores and values. The attention term counts the full s x s matrix (not the causal half),
    and the embedding lookup is not a matmul so its parameters are left out; the LM head is
    counted. Recomputed work is not model work: `mfu` and `model_tflops_per_sec` use this."""
    h, L = shape.hidden_size, shape.num_hidden_layers
    return 6.0 * (L * layer_matmul_params(shape) + shape.vocab_size * h) + 12.0 * L * h * seq_len


def layer_matmul_params(shape: LlamaShape) -> int:
    """Weights of one decoder block that enter matmuls: q, o (h x h), k, v (h x kv), gate, up, down."""
    h, kv = shape.hidden_size, shape.num_key_value_heads * shape.head_dim
    return 2 * h * h + 2 * h * kv + 3 * h * shape.intermediate_size


def hardware_flops_per_token(shape: LlamaShape, seq_len: int, recompute_layer: bool) -> float:
    """FLOPs the hardware executes per training token: the model FLOPs plus, with activation
    recomputation, the forward of every decoder block rerun during backward (per layer
    2 * block matmul parameters + 4 * hidden * seq for attention) minus its down projection:
    torch's non-reentrant checkpoint stops recomputing once every saved tensor is back, and
    nothing saves down_proj's output. Behind `hardware_tflops_per_sec`."""
    extra = 0.0
    if recompute_layer:
        rerun = layer_matmul_params(shape) - shape.hidden_size * shape.intermediate_size
        extra = shape.num_hidden_layers * (2.0 * rerun + 4.0 * shape.hidden_size * seq_len)
    return flops_per_token(shape, seq_len) + extra


def peak_tflops(device: torch.device, dtype: str, override: float | None) -> float | None:
    """Per-device peak TFLOP/s: the override, else the table entry of this GPU, else None."""
    if override:
        return float(override)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for gpu, table_dtype, value in PEAK_TFLOPS:
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
            # A run resumed into the same folder continues the same W&B run: its id is kept here.
            id_path = os.path.join(run_dir, "wandb_run_id.txt")
            run_id = open(id_path).read().strip() if os.path.exists(id_path) else wandb.util.generate_id()
            with open(id_path, "w") as f:
                f.write(run_id)
            self.wandb = wandb.init(project=cfg.logging.wandb.project or cfg.general.project,
                                    entity=cfg.logging.wandb.entity, name=cfg.general.run, id=run_id,
                                    resume="allow", mode=cfg.logging.wandb.mode, dir=run_dir, config=flat_config)

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
