"""A backward split in two for the zero-bubble schedules (schedules.py's "W" steps): B computes the gradient of a
stage's input, which the previous stage waits for, and leaves the weight gradients of its linears for W, which
nobody waits for, to run later in a slot that would otherwise idle (Qi et al. 2024, "Zero Bubble Pipeline
Parallelism"). The split is made at the linear: every `Linear.matmul` of the model becomes a `DeferredMatmul` around the matmul it
had (plain, or a number format's), whose backward, run inside `WeightGradients.deferring(key)`, returns the input's
gradient at once and keeps what the product saved and its output gradient to compute the weight's gradient when
`run(key)` is called. A matmul splits through three methods, `split_forward(x, weight, layer) -> (y, saved)`,
`input_grad(saved, grad)` and `weight_grad(saved, grad)`: `PlainSplit` for F.linear, a number format's own
(numerics/fp8.py's Fp8Matmul); the two halves are what its own backward computes, in its order. The other parameters
(norms, embedding) get their gradients in B, as before. W accumulates each weight gradient through autograd
(`torch.autograd.backward` on the weight), so gradient hooks fire as for any gradient. W needs no communication:
tensor parallelism's gathers and reductions are in B (they move inputs and their gradients), and a linear's weight
gradient is local to its rank.
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
        for weight, split, saved, grad in self.pending.pop(key, []):
            grad_weight = split.weight_grad(saved, grad)
            with torch.enable_grad():
                torch.autograd.backward(weight, grad_weight.to(weight.dtype))


class PlainSplit:
    """F.linear's product and its backward's halves, in the dtype autocast chooses (as `plain_matmul`)."""

    @staticmethod
    def split_forward(x: torch.Tensor, weight: torch.Tensor, layer) -> tuple[torch.Tensor, tuple]:
        if torch.is_autocast_enabled(x.device.type):   # the product in autocast's dtype, as F.linear's would be
            x = x.to(torch.get_autocast_dtype(x.device.type))
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x, weight.to(x.dtype)), (x, weight)

    @staticmethod
    def input_grad(saved: tuple, grad: torch.Tensor) -> torch.Tensor:
        return grad.matmul(saved[1].to(grad.dtype))

    @staticmethod
    def weight_grad(saved: tuple, grad: torch.Tensor) -> torch.Tensor:
        x = saved[0]
        return grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class DeferredMatmul:
    """`Linear.matmul` whose weight gradient waits for W (its backward runs inside `store.deferring`); `split` is
    the matmul it wraps, seen as its forward and its backward's two halves. Under model.compile it runs eagerly
    between the compiled pieces of its block (a graph break, __call__)."""

    def __init__(self, store: WeightGradients, split):
        self.store, self.split = store, split
        self.__name__ = "deferred weight gradient" + ("" if split is PlainSplit else f" of {split.__name__}")

    # Under model.compile each call is a graph break: the backward's side effect (keeping its halves in the store)
    # is one AOTAutograd cannot put in a compiled backward, so the linear runs eagerly and the block's other ops
    # (norms, attention, rotary, SwiGLU) compile between linears.
    @torch.compiler.disable
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, layer) -> torch.Tensor:
        # the weight enters detached: autograd has no edge to it in B (not even an empty call of its gradient
        # hooks); W accumulates into layer.weight itself
        return _DeferredLinear.apply(x, weight.detach(), layer, self.store, self.split)


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, layer, store: WeightGradients, split):
        y, saved = split.split_forward(x, weight, layer)
        # tensors through save_for_backward (recomputation's hooks see them, in-place changes are caught)
        ctx.save_for_backward(*(item for item in saved if isinstance(item, torch.Tensor)))
        ctx.others = [None if isinstance(item, torch.Tensor) else item for item in saved]
        ctx.store, ctx.layer, ctx.split = store, layer, split
        return y

    @staticmethod
    def backward(ctx, grad):
        if ctx.store.collecting is None:
            raise RuntimeError("a linear whose weight gradient waits for W ran a backward outside a B step")
        tensors = iter(ctx.saved_tensors)
        saved = tuple(next(tensors) if item is None else item for item in ctx.others)
        ctx.store.collecting.append((ctx.layer.weight, ctx.split, saved, grad))
        return ctx.split.input_grad(saved, grad), None, None, None, None


def defer_weight_gradients(model: torch.nn.Module) -> WeightGradients:
    """Give every linear of `model` a DeferredMatmul around its matmul, on one new store; returns the store. A
    matmul other than the plain one splits through its own split_forward / input_grad / weight_grad."""
    from nanoexp.model.linear import Linear, plain_matmul

    store = WeightGradients()
    for module in model.modules():
        if isinstance(module, Linear):
            split = PlainSplit if module.matmul is plain_matmul else module.matmul
            if not all(hasattr(split, name) for name in ("split_forward", "input_grad", "weight_grad")):
                raise ValueError(f"a zero-bubble schedule cannot split the backward of a "
                                 f"{getattr(split, '__name__', type(split).__name__)} linear into B and W")
            module.matmul = DeferredMatmul(store, split)
    return store
