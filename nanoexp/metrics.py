"""FLOP count and MFU, memory, and the metric writers (metrics.jsonl, TensorBoard, W&B).

Only global rank 0 creates a MetricsWriter; the trainer hands it plain dicts.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass

import torch

from nanoexp.model.llama import LlamaShape, layer_shapes

# Dense (no 2:4 sparsity) peak TFLOP/s per GPU and model.dtype, matched against
# torch.cuda.get_device_name in this order (so "H100 PCIe" wins over "H100").
# Sources, NVIDIA datasheets: "H200 Tensor Core GPU" (H200 SXM), "H100 Tensor Core GPU" (H100 SXM
# and PCIe), "A100 Tensor Core GPU" (A100 SXM/PCIe). bfloat16 is the tensor-core BF16 figure (the
# datasheets print it with sparsity: 1979 / 1513 / 624, halved here); float32 is the plain FP32
# (non-tensor-core) figure, since PyTorch does not use TF32 for matmuls by default. CPUs have no
# entry: their peak is measured at start (measure_cpu_peak) unless logging.peak_tflops is set.
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
    """Weights of one decoder block that enter matmuls: q, o, k, v, gate, up, down (not the norms)."""
    return sum(math.prod(s) for s in layer_shapes(shape, 0).values() if len(s) == 2)


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


@dataclass
class Peak:
    """A peak matmul throughput and where it came from."""
    tflops: float | None
    source: str


def job_peak(device: torch.device, dtype: str, override: float | None, world_size: int, nodes: int,
             measured: Peak | None = None) -> Peak:
    """The whole job's peak, which MFU divides the job's model FLOP/s by. On CUDA: per GPU (the
    override, else the datasheet table) times the GPUs. On CPU: per node (the override, else
    `measured`, see `measure_cpu_peak`) times the nodes, since a node's ranks share its cores."""
    if device.type == "cuda":
        per_gpu, source = (override, "logging.peak_tflops") if override else gpu_table_peak(device, dtype)
        return Peak(per_gpu * world_size if per_gpu else None, f"{source}, x {world_size} GPU(s)")
    per_node, source = (override, "logging.peak_tflops") if override else (
        (measured.tflops, measured.source) if measured else (None, "not measured"))
    return Peak(per_node * nodes if per_node else None, f"{source}, x {nodes} node(s)")


def gpu_table_peak(device: torch.device, dtype: str) -> tuple[float | None, str]:
    name = torch.cuda.get_device_name(device)
    for gpu, table_dtype, value in PEAK_TFLOPS:
        if gpu in name and table_dtype == dtype:
            return value, f"datasheet: {gpu} {dtype} dense"
    return None, f"{name} is not in PEAK_TFLOPS: set logging.peak_tflops"


def measure_cpu_peak(dtype: str, threads: int, size: int = 1024, repeats: int = 4) -> Peak:
    """This node's matmul peak: the best of `repeats` timed size x size matmuls in `dtype` on `threads`
    threads (about 0.05-0.3 s on 2 cores). The operands are built without any random generator, so
    the training RNG is untouched; nothing is written anywhere."""
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.linspace(-1.0, 1.0, size * size).reshape(size, size).to(torch_dtype)
        b = a.t().contiguous()
        torch.mm(a, b)   # warm-up: thread pool, caches
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    tflops = 2.0 * size ** 3 / best / 1e12
    return Peak(tflops, f"measured: best of {repeats} {size}x{size} {dtype} matmuls on {threads} threads")


def start_wandb(run_dir: str, cfg):
    """A W&B run carrying the whole resolved config, named, grouped and tagged by `logging.wandb`
    (run.py fills the nulls from the Hydra job). A run resumed into the same folder continues the
    same W&B run: its id, chosen by W&B at the first start, is kept in wandb_run_id.txt."""
    import wandb
    from omegaconf import OmegaConf

    w = cfg.logging.wandb
    id_path = os.path.join(run_dir, "wandb_run_id.txt")
    run_id = open(id_path).read().strip() if os.path.exists(id_path) else None
    run = wandb.init(project=w.project or cfg.general.project, entity=w.entity, name=w.name or cfg.general.run,
                     group=w.group, tags=list(w.tags or []), id=run_id, resume="allow", mode=w.mode, dir=run_dir,
                     config=OmegaConf.to_container(cfg, resolve=True))
    with open(id_path, "w") as f:
        f.write(run.id)
    return run


class MetricsWriter:
    """Appends one JSON line per record to metrics.jsonl (floats at full precision), and mirrors
    scalars to TensorBoard and W&B when enabled."""

    def __init__(self, run_dir: str, cfg):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tensorboard = self.wandb = None
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if cfg.logging.wandb.mode != "disabled":
            self.wandb = start_wandb(run_dir, cfg)

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
