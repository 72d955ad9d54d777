"""Pipeline parallelism: split the layers into stages and schedule micro-batches through them.

Layout: stage 0 owns the token embedding plus the first block of layers; the last stage owns
the last layers plus the final norm and the LM head (so it is the one that computes the
loss). Stages in between hold only transformer layers. Activations travel forward between
neighbouring stages and their gradients travel backward, point to point.

Two schedules, both producing exactly the gradients of plain gradient accumulation:

* AllForwardAllBackward ("afab", GPipe-like): every micro-batch forward, then every
  micro-batch backward. Simple, but a stage holds the activations of all micro-batches.
* OneForwardOneBackward ("1f1b"): a few warm-up forwards, then alternate one forward with
  one backward, then drain the remaining backwards. The same bubble as AFAB, but stage r
  holds at most (pp - r) micro-batches of activations instead of all of them.

The engine only moves activations and calls backward; the caller's ``forward_step`` runs the
stage's modules and, on the last stage, the loss.
"""
from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist


def split_layers(num_layers: int, pp: int) -> list[range]:
    """Assign layers to pipeline stages: ``pp`` contiguous, balanced ranges covering
    ``range(num_layers)``. When the split is uneven the earlier stages get one extra layer
    (the last stage also carries the final norm and the LM head, so it should not be the
    heavier one). The embedding lives on stage 0, the final norm + LM head on stage pp-1.
    Raises ValueError if pp < 1 or pp > num_layers (a stage without layers)."""
    if pp < 1 or pp > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {pp} pipeline stages "
                         f"(need 1 <= parallelism.pp <= num_layers)")
    base, extra = divmod(num_layers, pp)
    ranges, start = [], 0
    for stage in range(pp):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


# -- point-to-point --------------------------------------------------------------------------
# Every function below is called by both neighbours with matching ops: what one stage sends
# in a call, the neighbour receives in its matching call. Peers are global ranks. On an end
# stage the missing direction is a no-op and receives return None.

def _communicate(ctx, sends=(), recvs=()) -> list[torch.Tensor]:
    """Post the given sends [(tensor, peer)] and receives [(shape, dtype, peer)] as one
    batch and wait for all of them; returns the received tensors in order."""
    ops, received = [], []
    for tensor, peer in sends:
        # gloo: sending a non-contiguous tensor fails on the sender and hangs the receiver.
        ops.append(dist.P2POp(dist.isend, tensor.contiguous(), peer, group=ctx.pp_group))
    for shape, dtype, peer in recvs:
        buf = torch.empty(shape, dtype=dtype, device=ctx.device)
        ops.append(dist.P2POp(dist.irecv, buf, peer, group=ctx.pp_group))
        received.append(buf)
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return received


def send_forward(ctx, output: torch.Tensor) -> None:
    """Send this stage's output activation to the next stage (no-op on the last stage)."""
    if not ctx.is_last_stage:
        _communicate(ctx, sends=[(output.detach(), ctx.next_rank)])


def recv_forward(ctx, shape, dtype) -> torch.Tensor | None:
    """Receive the input activation from the previous stage as a leaf that requires grad
    (None on the first stage, which reads its micro-batch itself)."""
    if ctx.is_first_stage:
        return None
    (x,) = _communicate(ctx, recvs=[(shape, dtype, ctx.prev_rank)])
    return x.requires_grad_()


def send_backward(ctx, input_grad: torch.Tensor | None) -> None:
    """Send the gradient of this stage's input to the previous stage (no-op on stage 0)."""
    if not ctx.is_first_stage:
        _communicate(ctx, sends=[(input_grad, ctx.prev_rank)])


def recv_backward(ctx, shape, dtype) -> torch.Tensor | None:
    """Receive the gradient of this stage's output from the next stage (None on the last)."""
    if ctx.is_last_stage:
        return None
    (g,) = _communicate(ctx, recvs=[(shape, dtype, ctx.next_rank)])
    return g


def send_forward_recv_backward(ctx, output, shape, dtype) -> torch.Tensor | None:
    """1F1B steady state, towards the next stage: send an activation and receive the
    gradient of an older one, in ONE batch. Posting both before waiting is what keeps the
    two neighbours (each sending to the other) from waiting on each other forever."""
    if ctx.is_last_stage:
        return None
    (g,) = _communicate(ctx, sends=[(output.detach(), ctx.next_rank)],
                        recvs=[(shape, dtype, ctx.next_rank)])
    return g


def send_backward_recv_forward(ctx, input_grad, shape, dtype) -> torch.Tensor | None:
    """1F1B steady state, towards the previous stage: the mirror image of
    send_forward_recv_backward. Returns the next input activation (a leaf requiring grad)."""
    if ctx.is_first_stage:
        return None
    (x,) = _communicate(ctx, sends=[(input_grad, ctx.prev_rank)],
                        recvs=[(shape, dtype, ctx.prev_rank)])
    return x.requires_grad_()


# -- engines ---------------------------------------------------------------------------------

class PipelineEngine:
    """Runs one optimizer step's micro-batches through this rank's pipeline stage.

    Subclasses implement ``_schedule``; the base class holds the per-micro-batch forward and
    backward steps and the bookkeeping (losses, the last-backward hook, ``max_in_flight``).
    """

    name = "base"

    def __init__(self, ctx):
        self.ctx = ctx
        self.max_in_flight = 0  # most micro-batches whose activations were held at once

    def run(self, forward_step, micro_batches: list, tensor_shape: tuple, dtype,
            on_last_backward=None) -> list[torch.Tensor]:
        """Forward and backward every micro-batch; gradients accumulate in the parameters.

        ``forward_step(micro_batch, input_tensor)`` returns, on the last stage, the scalar
        loss of that micro-batch (already scaled so that the sum over micro-batches is the
        step loss); elsewhere the activation to send on, which must have exactly
        ``tensor_shape`` and ``dtype`` (both are also used to allocate receive buffers, so
        every stage must pass the same values). ``input_tensor`` is None on the first stage.
        ``on_last_backward()`` is called once, right before this stage's last backward.
        Returns the detached per-micro-batch losses on the last stage, [] elsewhere.
        """
        if not micro_batches:
            raise ValueError("PipelineEngine.run needs at least one micro-batch")
        self._forward_fn, self._hook = forward_step, on_last_backward
        self._shape, self._dtype = tuple(tensor_shape), dtype
        self._num_micro, self._backwards_done = len(micro_batches), 0
        self._in_flight = self.max_in_flight = 0
        self._losses = []
        if self.ctx.pp == 1:
            self._accumulate(micro_batches)
        else:
            self._schedule(micro_batches)
        assert self._in_flight == 0 and self._backwards_done == self._num_micro
        losses, self._losses, self._forward_fn = self._losses, [], None
        return losses

    @torch.no_grad()
    def forward_only(self, forward_step, micro_batches: list, tensor_shape: tuple, dtype) -> list[torch.Tensor]:
        """Forward every micro-batch through the pipeline, keeping no graph (evaluation).
        Returns the per-micro-batch losses on the last stage, [] elsewhere."""
        losses = []
        for mb in micro_batches:
            output = forward_step(mb, recv_forward(self.ctx, tensor_shape, dtype))
            if self.ctx.is_last_stage:
                losses.append(output.detach())
            else:
                send_forward(self.ctx, output)
        return losses

    def _accumulate(self, micro_batches):
        """pp == 1: plain gradient accumulation, one micro-batch alive at a time."""
        for mb in micro_batches:
            self._backward(None, self._forward(mb, None), None)

    def _schedule(self, micro_batches):
        raise NotImplementedError

    # -- one micro-batch ------------------------------------------------------------------
    def _forward(self, micro_batch, input_tensor):
        """Run forward_step; on the last stage record the loss, elsewhere check the output
        against tensor_shape/dtype (a mismatch would corrupt or hang the receiver)."""
        output = self._forward_fn(micro_batch, input_tensor)
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        if self.ctx.is_last_stage:
            self._losses.append(output.detach())
        elif tuple(output.shape) != self._shape or output.dtype != self._dtype:
            raise ValueError(
                f"stage {self.ctx.pp_rank} produced {tuple(output.shape)} {output.dtype}, "
                f"but the pipeline was told tensor_shape={self._shape} dtype={self._dtype}")
        return output

    def _backward(self, input_tensor, output, output_grad):
        """Backpropagate one micro-batch; returns the gradient of its input (None on stage 0)."""
        self._backwards_done += 1
        if self._backwards_done == self._num_micro and self._hook is not None:
            self._hook()  # e.g. let the data-parallel gradient hooks fire during this backward
        if output_grad is None:  # last stage: output is the loss
            output.backward()
        else:
            torch.autograd.backward(output, output_grad)
        self._in_flight -= 1
        if input_tensor is None:
            return None
        # A stage that ignores its input still owes the previous stage a gradient.
        return input_tensor.grad if input_tensor.grad is not None else torch.zeros_like(input_tensor)

    def _release(self, output):
        """Free an output activation once it has been sent: the next stage owns a copy and
        our backward needs only its graph and shape. A one-element view keeps the shape (so
        autograd's shape check passes) without the memory; tensors the graph saved for
        backward are separate tensors and stay intact."""
        if self.ctx.is_last_stage or output.grad_fn is None or output._base is not None:
            return  # a loss, a leaf or a view: leave it alone
        output.data = torch.empty((), dtype=output.dtype, device=output.device).expand(output.shape)


class AllForwardAllBackward(PipelineEngine):
    """GPipe-style: all forwards, then all backwards in the same order. Holds every
    micro-batch's activations at the peak (max_in_flight == number of micro-batches)."""

    name = "afab"

    def _schedule(self, micro_batches):
        ctx, shape, dtype = self.ctx, self._shape, self._dtype
        stash = deque()
        for mb in micro_batches:
            x = recv_forward(ctx, shape, dtype)
            y = self._forward(mb, x)
            send_forward(ctx, y)
            self._release(y)
            stash.append((x, y))
        while stash:
            x, y = stash.popleft()
            g = recv_backward(ctx, shape, dtype)
            send_backward(ctx, self._backward(x, y, g))


class OneForwardOneBackward(PipelineEngine):
    """1F1B: stage r runs (pp - r - 1) warm-up forwards, then alternates one forward and one
    backward, then drains the warm-up backwards. It holds at most pp - r micro-batches.

    With fewer micro-batches than stages the warm-up is capped at the number of micro-batches,
    so the early stages degenerate to all-forward-all-backward: still correct, more bubble.
    """

    name = "1f1b"

    def _schedule(self, micro_batches):
        ctx, shape, dtype = self.ctx, self._shape, self._dtype
        num_warmup = min(ctx.pp - ctx.pp_rank - 1, len(micro_batches))
        num_steady = len(micro_batches) - num_warmup
        stash = deque()

        for mb in micro_batches[:num_warmup]:
            x = recv_forward(ctx, shape, dtype)
            y = self._forward(mb, x)
            send_forward(ctx, y)
            self._release(y)
            stash.append((x, y))

        # The steady state receives the next input together with sending a gradient, so
        # the first input is received up front.
        x = recv_forward(ctx, shape, dtype) if num_steady > 0 else None
        for i, mb in enumerate(micro_batches[num_warmup:]):
            y = self._forward(mb, x)
            stash.append((x, y))
            g = send_forward_recv_backward(ctx, y, shape, dtype)
            self._release(y)
            old_x, old_y = stash.popleft()  # backward the oldest micro-batch (FIFO)
            input_grad = self._backward(old_x, old_y, g)
            if i == num_steady - 1:
                send_backward(ctx, input_grad)
            else:
                x = send_backward_recv_forward(ctx, input_grad, shape, dtype)

        while stash:  # cool-down
            old_x, old_y = stash.popleft()
            g = recv_backward(ctx, shape, dtype)
            send_backward(ctx, self._backward(old_x, old_y, g))


ENGINES = {"afab": AllForwardAllBackward, "1f1b": OneForwardOneBackward}


def build_engine(name: str, ctx) -> PipelineEngine:
    """The engine for config value ``parallelism.pp_engine`` ("afab" or "1f1b", any case)."""
    key = str(name).lower()
    if key not in ENGINES:
        raise ValueError(f"unknown parallelism.pp_engine {name!r}; expected one of {sorted(ENGINES)}")
    return ENGINES[key](ctx)
