"""FLOP count (model and hardware FLOPs per token) and the metric writers (metrics.jsonl, TensorBoard, W&B).
MFU divides the model FLOP/s by the peak of peak.py.

Only global rank 0 creates a MetricsWriter; the trainer hands it plain dicts.
"""
from __future__ import annotations

import json
import math
import os

from nanoexp.model.llama import LlamaShape, layer_shapes
from nanoexp.runtime.recompute import RecomputePolicy


def flops_per_token(shape: LlamaShape, seq_len: int) -> float:
    """Model FLOPs per training token (forward + backward = 3x forward), as in PaLM (Chowdhery
    et al. 2022, appendix B): 6 * (matmul parameters) + 12 * layers * hidden * seq for attention
    scores and values. The attention term counts the full s x s matrix (not the causal half),
    and the embedding lookup is not a matmul so its parameters are left out; the LM head is
    counted. Of a mixture of experts only what a token goes through counts (6 * N_active). Recomputed
    work is not model work: `mfu` and `model_tflops_per_sec` use this."""
    h, L = shape.hidden_size, shape.num_hidden_layers
    matmuls = sum(layer_matmul_params(shape, n) for n in range(L))
    return 6.0 * (matmuls + shape.vocab_size * h) + 12.0 * L * h * seq_len


def layer_matmul_params(shape: LlamaShape, n: int = 0) -> int:
    """Weights of decoder block n that a token's matmuls go through: q, o, k, v, gate, up, down (not the norms);
    in a MoE block the router, its top_k routed experts and the shared ones."""
    total = sum(math.prod(s) for s in layer_shapes(shape, n).values() if len(s) == 2)
    if shape.is_moe_layer(n):
        total -= (shape.moe.num_experts - shape.moe.top_k) * 3 * shape.hidden_size * shape.moe.intermediate_size
    return total


def down_projection_params(shape: LlamaShape, n: int) -> int:
    """The down projections a token goes through in block n (one, or top_k routed and the shared ones)."""
    moe = shape.moe
    if not shape.is_moe_layer(n):
        return shape.hidden_size * shape.intermediate_size
    return shape.hidden_size * moe.intermediate_size * (moe.top_k + moe.num_shared_experts)


def hardware_flops_per_token(shape: LlamaShape, seq_len: int, recompute=False, cp: int = 1) -> float:
    """FLOPs the hardware executes per training token: the model FLOPs plus what activation recomputation runs
    again in backward (`recompute`: a RecomputePolicy, or True for full, False for none). A recomputed layer reruns
    its projections (2 * block matmul parameters) but its down projections, unless the policy keeps the matmuls'
    outputs, and its attention (4 * hidden * seq), unless it keeps attention's: torch's non-reentrant checkpoint
    stops once every saved tensor is back, and nothing saves a down projection's output. Under cp > 1 attention is
    a context-parallel kernel, which no policy keeps. Behind `hardware_tflops_per_sec`."""
    policy = recompute if isinstance(recompute, RecomputePolicy) else RecomputePolicy("full" if recompute else "none")
    extra = 0.0
    for n in (n for n in range(shape.num_hidden_layers) if policy.recomputes(n)):
        if not policy.keeps("matmul"):
            extra += 2.0 * (layer_matmul_params(shape, n) - down_projection_params(shape, n))
        if cp > 1 or not policy.keeps("attention"):
            extra += 4.0 * shape.hidden_size * seq_len
    return flops_per_token(shape, seq_len) + extra


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
