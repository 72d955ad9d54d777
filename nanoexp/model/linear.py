"""The model's linear layer, and the seam number formats plug into.

Every projection of the model (attention, MLP, experts, router, LM head) is a `Linear`. Tensor parallelism
replaces the ones its plan names with sharded subclasses (nanoexp/parallel/tensor_parallel.py); a number
format replaces `matmul`, the product itself, on the layers it converts, sharded or not, so that it never has
to know how a layer communicates.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def plain_matmul(x: torch.Tensor, weight: torch.Tensor, layer: "Linear") -> torch.Tensor:
    """x W^T in the dtype autocast chooses: what a layer computes until a converter says otherwise."""
    return F.linear(x, weight)


class Linear(nn.Module):
    """y = x W^T (Llama's projections have no bias); W is [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.matmul = plain_matmul   # (x, weight, layer) -> x W^T; number formats replace it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}" + self.format_repr()

    def format_repr(self) -> str:
        """", <format>" when a number format replaced the matmul, else ""."""
        name = getattr(self.matmul, "__name__", type(self.matmul).__name__)
        return "" if self.matmul is plain_matmul else f", {name}"
