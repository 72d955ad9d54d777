"""A MoE layer's routed experts: E SwiGLU MLPs whose weights are stacked, one tensor per projection, and the kernels
that run them on rows sorted by expert (`model.moe.expert_kernel`, `EXPERT_KERNELS`).

    gate_proj, up_proj [E, width, hidden]    down_proj [E, hidden, width]    (expert e: row e of each)

A kernel is called as `kernel(rows, counts, gate, up, down)`: `rows` [N, hidden] sorted by expert, `counts` the
rows of each expert (`ExpertCounts`), and returns each row's expert output [N, hidden] in the same order.
  grouped_mm  one `torch._grouped_mm` per projection over all experts (the matmul kernel torchtitan and Megatron's
              `--moe-grouped-gemm` use), where torch runs it (`grouped_mm_takes`), else `loop`;
  loop        one F.linear per expert and projection, on the expert's block of rows (the counts read on the host
              once, if the route did not already).
Checkpoints and Hugging Face files name each expert's matrices apart, as Mixtral's and Qwen3-MoE's checkpoints do
(`experts.<e>.gate_proj.weight`): `expert_value_names` gives those names for a stacked parameter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass
class ExpertCounts:
    """The rows of each expert, on the device (`tensor`, int64), and on the host when already read (`sizes`)."""
    tensor: torch.Tensor
    sizes: list[int] | None = None

    def host(self) -> list[int]:
        """The counts on the host: read once (a host synchronisation), then kept."""
        if self.sizes is None:
            self.sizes = self.tensor.tolist()
        return self.sizes


def loop(rows, counts: ExpertCounts, gate, up, down) -> torch.Tensor:
    """One SwiGLU per expert on its block of rows (an expert without rows runs on none: its gradient is zeros)."""
    blocks = rows.split(counts.host())
    # unbind: one backward node that stacks the experts' gradients, not one full-size gradient per expert
    outputs = [F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)
               for x, g, u, d in zip(blocks, gate.unbind(0), up.unbind(0), down.unbind(0))]
    return torch.cat(outputs)


def compute_dtype(rows: torch.Tensor) -> torch.dtype:
    """The dtype the matmuls run in: autocast's where it is on (as for F.linear), else the rows'."""
    if torch.is_autocast_enabled(rows.device.type):
        return torch.get_autocast_dtype(rows.device.type)
    return rows.dtype


def grouped_mm_takes(dtype: torch.dtype, gate: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs these operands (measured on CPU with torch 2.13): float32, bfloat16 and
    float16, the 2-byte types when every row is a multiple of 16 bytes (hidden and width multiples of 8); for any
    other dtype or shape grouped_mm runs `loop` instead, explicitly."""
    if dtype == torch.float32:
        return True
    width, hidden = gate.shape[1:]
    return dtype in (torch.bfloat16, torch.float16) and width % 8 == 0 and hidden % 8 == 0


def grouped_mm(rows, counts: ExpertCounts, gate, up, down) -> torch.Tensor:
    """Each projection as one grouped matmul over the experts' blocks; group e ends at counts[:e + 1].sum(), their
    running sum on the device (no read of the counts on the host, no Python loop). Autocast does not cast its
    operands: it casts them itself to autocast's dtype, as F.linear would be."""
    dtype = compute_dtype(rows)
    if not grouped_mm_takes(dtype, gate):
        return loop(rows, counts, gate, up, down)
    ends = counts.tensor.cumsum(0).to(torch.int32)
    x = rows.to(dtype)
    gate, up, down = (w.to(dtype).transpose(-2, -1) for w in (gate, up, down))   # [E, in, out]
    hidden = F.silu(torch._grouped_mm(x, gate, offs=ends)) * torch._grouped_mm(x, up, offs=ends)
    return torch._grouped_mm(hidden, down, offs=ends)


EXPERT_KERNELS: dict[str, Callable] = {"grouped_mm": grouped_mm, "loop": loop}


class GroupedExperts(nn.Module):
    """The routed experts a rank holds (all of them; expert parallelism keeps a slice, parallel/expert_parallel.py),
    run by `kernel` (EXPERT_KERNELS)."""

    def __init__(self, num_experts: int, hidden: int, width: int, kernel: str = "grouped_mm"):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, width, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, width, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, width))
        self.kernel_name = kernel
        self.kernel = EXPERT_KERNELS[kernel]

    def forward(self, rows: torch.Tensor, counts: ExpertCounts) -> torch.Tensor:
        return self.kernel(rows, counts, self.gate_proj, self.up_proj, self.down_proj)

    def extra_repr(self) -> str:
        experts, width, hidden = self.gate_proj.shape
        return f"experts={experts}, hidden={hidden}, width={width}, kernel={self.kernel_name}"


def is_stacked_expert(name: str) -> bool:
    """Whether parameter `name` is a stacked routed-expert tensor ("...mlp.experts.gate_proj")."""
    prefix, _, projection = name.rpartition(".")
    return prefix.endswith(".experts") and projection in PROJECTIONS


def expert_value_names(name: str, first: int, count: int) -> list[str]:
    """The names checkpoints and Hugging Face give experts first .. first + count - 1 of a stacked parameter:
    "model.layers.1.mlp.experts.gate_proj" -> "model.layers.1.mlp.experts.<e>.gate_proj.weight"."""
    prefix, _, projection = name.rpartition(".")
    return [f"{prefix}.{e}.{projection}.weight" for e in range(first, first + count)]
