"""A backward split in two for the zero-bubble schedules (schedules.py's "W" steps): B computes the gradient of a
stage's input, which the previous stage waits for, and leaves the weight gradients of its linears for W, which
nobody waits for, to run later in a slot that would otherwise idle (Qi et al. 2024, "Zero Bubble Pipeline
Parallelism").

The split is made at the linear: every `Linear.matmul` of the model becomes a `DeferredMatmul`, whose backward,
run inside `WeightGradients.deferring(key)`, returns the input's gradient at once and keeps (input, output
gradient) of the product to compute the weight's gradient when `run(key)` is called. The other parameters (norms, embedding) get their gradients in B, as before. W accumulates each
weight gradient through autograd (`torch.autograd.backward` on the weight), so gradient hooks fire as for any
gradient. W needs no communication: tensor parallelism's gathers and reductions are in B (they move inputs and
their gradients), and a linear's weight gradient is local to its rank.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F


class WeightGradients:
    """Weight gradients deferred from B steps, by (chunk, micro-batch), until their W step."""

    def __init__(self):
        self.collecting: list | None = None
        self.pending: dict[tuple, list] = {}

    @contextmanager
    def deferring(self, key: tuple):
        """Within: the linears' weight gradients are kept for `run(key)` instead of computed."""
        self.collecting = self.pending.setdefault(key, [])
        try:
            yield
        finally:
            self.collecting = None

    @torch.no_grad()
    def run(self, key: tuple) -> None:
        """The W step of `key`: each kept weight gradient, in the order backward reached them."""
        for weight, x, grad in self.pending.pop(key, []):
            grad_weight = grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
            with torch.enable_grad():
                torch.autograd.backward(weight, grad_weight.to(weight.dtype))


class DeferredMatmul:
    """`Linear.matmul` whose weight gradient waits for W (its backward runs inside `store.deferring`)."""
    __name__ = "deferred weight gradient"

    def __init__(self, store: WeightGradients):
        self.store = store

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, layer) -> torch.Tensor:
        # the weight enters detached: autograd has no edge to it in B (not even an empty call of its gradient
        # hooks); W accumulates into layer.weight itself
        if torch.is_autocast_enabled(x.device.type):   # the product in autocast's dtype, as F.linear's would be
            dtype = torch.get_autocast_dtype(x.device.type)
            with torch.autocast(x.device.type, enabled=False):
                return _DeferredLinear.apply(x.to(dtype), weight.detach(), layer, self.store)
        return _DeferredLinear.apply(x, weight.detach(), layer, self.store)


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, layer, store: WeightGradients):
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.layer = store, layer
        return F.linear(x, weight.to(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        if ctx.store.collecting is None:
            raise RuntimeError("a linear whose weight gradient waits for W ran a backward outside a B step")
        ctx.store.collecting.append((ctx.layer.weight, x, grad))
        return grad.matmul(weight.to(grad.dtype)), None, None, None


def defer_weight_gradients(model: torch.nn.Module) -> WeightGradients:
    """Give every linear of `model` a DeferredMatmul on one new store; returns the store. Its linears must still
    compute plainly (a number format's matmul has its own backward: refused with zero-bubble schedules)."""
    from nanoexp.model.linear import Linear, plain_matmul

    store = WeightGradients()
    for module in model.modules():
        if isinstance(module, Linear):
            if module.matmul is not plain_matmul:
                raise ValueError(f"a zero-bubble schedule cannot defer the weight gradient of a {module.matmul.__name__}"
                                 " linear")
            module.matmul = DeferredMatmul(store)
    return store
