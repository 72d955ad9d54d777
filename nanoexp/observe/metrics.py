"""FLOP count (model and hardware FLOPs per token), the metric writers (metrics.jsonl, TensorBoard, W&B) and the
one reader of metrics.jsonl (`read_metrics`). MFU divides the model FLOP/s by the peak of peak.py.

Only global rank 0 creates a MetricsWriter; the trainer hands it plain dicts. A crash mid-write leaves a partial last
line: a writer appends from a fresh line, and the reader skips what is not a record, saying how many lines.
"""
from __future__ import annotations

import json
import logging
import math
import os

from nanoexp.model.llama import LlamaShape, layer_shapes
from nanoexp.runtime.recompute import RecomputePolicy

log = logging.getLogger("nanoexp")
METRICS_FILE = "metrics.jsonl"


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
        self.path = os.path.join(run_dir, METRICS_FILE)
        end_partial_line(self.path)
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

    def event(self, record: dict, title: str, text: str) -> None:
        """A finding (nanoexp/health/): its record as `write`'s, and its text as an event: TensorBoard's text, a W&B
        alert."""
        self.write(record)
        if self.tensorboard is not None:
            self.tensorboard.add_text(title, text, record["step"])
        if self.wandb is not None:
            self.wandb.alert(title=title, text=text, level="WARN")

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def end_partial_line(path: str) -> None:
    """End the file's last line if a crash cut it (no newline at the end), so that the next record appended is a
    line of its own instead of glued to the partial one."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            f.write(b"\n")


def read_metrics(run_dir: str) -> list[dict]:
    """The records of the run folder's metrics.jsonl, in order ([] without one). A line that is not a record (a JSON
    object with a step) is skipped: a partial line left by a crash mid-write, garbage; how many, said in one
    warning. A resumed run repeats the steps after its checkpoint: the later record of a step is the one that
    counts."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        return []
    records, unreadable = [], 0
    with open(path, errors="replace") as f:
        for line in filter(str.strip, f):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict) and "step" in record:
                records.append(record)
            else:
                unreadable += 1
    if unreadable:
        log.warning("%s: %d unreadable line%s skipped (not a JSON record: a crash mid-write leaves a partial one)",
                    path, unreadable, "" if unreadable == 1 else "s")
    return records
