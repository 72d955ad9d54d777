"""Pipeline parallelism: split the layers into stages and schedule micro-batches through them.

Layout: stage 0 owns the token embedding plus the first block of layers; the last stage owns
the last layers plus the final norm and the LM head (so it is the one that computes the
loss). Stages in between hold only transformer layers. Activations travel forward between
neighbouring stages and their gradients travel backward, point to point.

Three schedules, all producing exactly the gradients of plain gradient accumulation:

* AllForwardAllBackward ("afab", GPipe-like): every micro-batch forward, then every
  micro-batch backward. Simple, but a stage holds the activations of all micro-batches.
* OneForwardOneBackward ("1f1b"): a few warm-up forwards, then alternate one forward with
  one backward, then drain the remaining backwards. The same bubble as AFAB, but stage r
  holds at most (pp - r) micro-batches of activations instead of all of them.
* Interleaved 1F1B ("interleaved_1f1b", in interleaved.py): each rank holds several
  non-adjacent chunks of layers (virtual stages), which shrinks the bubble.

The engine only moves activations and calls backward; the caller's ``forward_step`` runs the
stage's modules and, on the last stage, the loss.
"""
from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from nanoexp.parallel.trace import NO_TRACE


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
# stage the missing direction is a no-op and receives return None. `trace` records the time
# each call spent communicating (see trace.py).

def _communicate(ctx, sends=(), recvs=(), trace=NO_TRACE) -> list[torch.Tensor]:
    """Post the given sends [(tensor, peer)] and receives [(shape, dtype, peer)] as one
    batch and wait for all of them; returns the received tensors in order."""
    ops, received, labels = [], [], []
    for tensor, peer in sends:
        # gloo: sending a non-contiguous tensor fails on the sender and hangs the receiver.
        ops.append(dist.P2POp(dist.isend, tensor.contiguous(), peer, group=ctx.pp_group))
        labels.append("send_forward" if peer == ctx.next_rank else "send_backward")
    for shape, dtype, peer in recvs:
        buf = torch.empty(shape, dtype=dtype, device=ctx.device)
        ops.append(dist.P2POp(dist.irecv, buf, peer, group=ctx.pp_group))
        received.append(buf)
        labels.append("recv_forward" if peer == ctx.prev_rank else "recv_backward")
    if ops:
        with trace.span(" ".join(labels)):
            for req in dist.batch_isend_irecv(ops):
                req.wait()
    return received


def send_forward(ctx, output: torch.Tensor, trace=NO_TRACE) -> None:
    """Send this stage's output activation to the next stage (no-op on the last stage)."""
    if not ctx.is_last_stage:
        _communicate(ctx, sends=[(output.detach(), ctx.next_rank)], trace=trace)


def recv_forward(ctx, shape, dtype, trace=NO_TRACE) -> torch.Tensor | None:
    """Receive the input activation from the previous stage as a leaf that requires grad
    (None on the first stage, which reads its micro-batch itself)."""
    if ctx.is_first_stage:
        return None
    (x,) = _communicate(ctx, recvs=[(shape, dtype, ctx.prev_rank)], trace=trace)
    return x.requires_grad_()


def send_backward(ctx, input_grad: torch.Tensor | None, trace=NO_TRACE) -> None:
    """Send the gradient of this stage's input to the previous stage (no-op on stage 0)."""
    if not ctx.is_first_stage:
        _communicate(ctx, sends=[(input_grad, ctx.prev_rank)], trace=trace)


def recv_backward(ctx, shape, dtype, trace=NO_TRACE) -> torch.Tensor | None:
    """Receive the gradient of this stage's output from the next stage (None on the last)."""
    if ctx.is_last_stage:
        return None
    (g,) = _communicate(ctx, recvs=[(shape, dtype, ctx.next_rank)], trace=trace)
    return g


def send_forward_recv_backward(ctx, output, shape, dtype, trace=NO_TRACE) -> torch.Tensor | None:
    """1F1B steady state, towards the next stage: send an activation and receive the
    gradient of an older one, in ONE batch. Posting both before waiting is what keeps the
    two neighbours (each sending to the other) from waiting on each other forever."""
    if ctx.is_last_stage:
        return None
    (g,) = _communicate(ctx, sends=[(output.detach(), ctx.next_rank)],
                        recvs=[(shape, dtype, ctx.next_rank)], trace=trace)
    return g


def send_backward_recv_forward(ctx, input_grad, shape, dtype, trace=NO_TRACE) -> torch.Tensor | None:
    """1F1B steady state, towards the previous stage: the mirror image of
    send_forward_recv_backward. Returns the next input activation (a leaf requiring grad)."""
    if ctx.is_first_stage:
        return None
    (x,) = _communicate(ctx, sends=[(input_grad, ctx.prev_rank)],
                        recvs=[(shape, dtype, ctx.prev_rank)], trace=trace)
    return x.requires_grad_()


# -- engines ---------------------------------------------------------------------------------

class PipelineEngine:
    """Runs one optimizer step's micro-batches through this rank's pipeline stage.

    Subclasses implement ``_schedule``; the base class holds the per-micro-batch forward and
    backward steps and the bookkeeping (losses, the last-backward hook, ``max_in_flight``,
    the trace). A rank holds ``num_chunks`` chunks of layers (1 except for the interleaved
    engine); chunk ``num_chunks - 1`` of the last stage computes the loss.
    """

    name = "base"

    def __init__(self, ctx, num_chunks: int = 1, trace=NO_TRACE):
        self.ctx, self.num_chunks, self.trace = ctx, num_chunks, trace
        self.max_in_flight = 0  # most micro-batch chunks whose activations were held at once

    def run(self, forward_step, micro_batches: list, tensor_shape: tuple, dtype,
            on_last_backward=None) -> list[torch.Tensor]:
        """Forward and backward every micro-batch; gradients accumulate in the parameters.

        ``forward_step(micro_batch, input_tensor, chunk)`` runs chunk ``chunk`` (always 0
        without virtual stages) and returns, for the loss chunk of the last stage, the scalar
        loss of that micro-batch (already scaled so that the sum over micro-batches is the
        step loss); elsewhere the activation to send on, which must have exactly
        ``tensor_shape`` and ``dtype`` (both are also used to allocate receive buffers, so
        every stage must pass the same values). ``input_tensor`` is None for chunk 0 of the
        first stage. ``on_last_backward(chunk)`` is called once per chunk, right before that
        chunk's last backward (its gradients are final after it).
        Returns the detached per-micro-batch losses on the last stage, [] elsewhere.
        """
        if not micro_batches:
            raise ValueError("PipelineEngine.run needs at least one micro-batch")
        self._forward_fn, self._hook = forward_step, on_last_backward
        self._micro_batches = micro_batches
        self._shape, self._dtype = tuple(tensor_shape), dtype
        self._num_micro = len(micro_batches)
        self._backwards_done = [0] * self.num_chunks
        self._in_flight = self.max_in_flight = 0
        self._losses = []
        if self.ctx.pp == 1:
            self._accumulate()
        else:
            self._schedule()
        assert self._in_flight == 0 and self._backwards_done == [self._num_micro] * self.num_chunks
        losses, self._losses, self._forward_fn, self._micro_batches = self._losses, [], None, None
        return losses

    @torch.no_grad()
    def forward_only(self, forward_step, micro_batches: list, tensor_shape: tuple, dtype) -> list[torch.Tensor]:
        """Forward every micro-batch through the pipeline, keeping no graph (evaluation).
        Returns the per-micro-batch losses on the last stage, [] elsewhere."""
        losses = []
        for mb in micro_batches:
            output = forward_step(mb, recv_forward(self.ctx, tensor_shape, dtype), 0)
            if self.ctx.is_last_stage:
                losses.append(output.detach())
            else:
                send_forward(self.ctx, output)
        return losses

    def _accumulate(self):
        """pp == 1: plain gradient accumulation, one micro-batch alive at a time."""
        for i in range(self._num_micro):
            self._backward(i, None, self._forward(i, None), None)

    def _schedule(self):
        raise NotImplementedError

    def is_loss_chunk(self, chunk: int) -> bool:
        return self.ctx.is_last_stage and chunk == self.num_chunks - 1

    # -- one micro-batch through one chunk ----------------------------------------------------
    def _forward(self, i, input_tensor, chunk=0):
        """Run forward_step on micro-batch i; for the loss chunk record the loss, elsewhere
        check the output against tensor_shape/dtype (a mismatch would corrupt or hang the
        receiver)."""
        with self.trace.span("forward", mb=i, chunk=chunk):
            output = self._forward_fn(self._micro_batches[i], input_tensor, chunk)
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        if self.is_loss_chunk(chunk):
            self._losses.append(output.detach())
        elif tuple(output.shape) != self._shape or output.dtype != self._dtype:
            raise ValueError(
                f"stage {self.ctx.pp_rank} chunk {chunk} produced {tuple(output.shape)} {output.dtype}, "
                f"but the pipeline was told tensor_shape={self._shape} dtype={self._dtype}")
        return output

    def _backward(self, i, input_tensor, output, output_grad, chunk=0):
        """Backpropagate micro-batch i through a chunk; returns the gradient of its input
        (None for chunk 0 of the first stage)."""
        self._backwards_done[chunk] += 1
        if self._backwards_done[chunk] == self._num_micro and self._hook is not None:
            self._hook(chunk)  # e.g. let the data-parallel gradient hooks fire during this backward
        with self.trace.span("backward", mb=i, chunk=chunk):
            if output_grad is None:  # the loss chunk: output is the loss
                output.backward()
            else:
                torch.autograd.backward(output, output_grad)
        self._in_flight -= 1
        if input_tensor is None:
            return None
        # A stage that ignores its input still owes the previous stage a gradient.
        return input_tensor.grad if input_tensor.grad is not None else torch.zeros_like(input_tensor)

    def _release(self, output, chunk=0):
        """Free an output activation once it has been sent: the next stage owns a copy and
        our backward needs only its graph and shape. A one-element view keeps the shape (so
        autograd's shape check passes) without the memory; tensors the graph saved for
        backward are separate tensors and stay intact."""
        if self.is_loss_chunk(chunk) or output.grad_fn is None or output._base is not None:
            return  # a loss, a leaf or a view: leave it alone
        output.data = torch.empty((), dtype=output.dtype, device=output.device).expand(output.shape)


class AllForwardAllBackward(PipelineEngine):
    """GPipe-style: all forwards, then all backwards in the same order. Holds every
    micro-batch's activations at the peak (max_in_flight == number of micro-batches)."""

    name = "afab"

    def _schedule(self):
        ctx, shape, dtype, trace = self.ctx, self._shape, self._dtype, self.trace
        stash = deque()
        for i in range(self._num_micro):
            x = recv_forward(ctx, shape, dtype, trace)
            y = self._forward(i, x)
            send_forward(ctx, y, trace)
            self._release(y)
            stash.append((i, x, y))
        while stash:
            i, x, y = stash.popleft()
            g = recv_backward(ctx, shape, dtype, trace)
            send_backward(ctx, self._backward(i, x, y, g), trace)


class OneForwardOneBackward(PipelineEngine):
    """1F1B: stage r runs (pp - r - 1) warm-up forwards, then alternates one forward and one
    backward, then drains the warm-up backwards. It holds at most pp - r micro-batches.

    With fewer micro-batches than stages the warm-up is capped at the number of micro-batches,
    so the early stages degenerate to all-forward-all-backward: still correct, more bubble.
    """

    name = "1f1b"

    def _schedule(self):
        ctx, shape, dtype, trace = self.ctx, self._shape, self._dtype, self.trace
        num_warmup = min(ctx.pp - ctx.pp_rank - 1, self._num_micro)
        num_steady = self._num_micro - num_warmup
        stash = deque()

        for i in range(num_warmup):
            x = recv_forward(ctx, shape, dtype, trace)
            y = self._forward(i, x)
            send_forward(ctx, y, trace)
            self._release(y)
            stash.append((i, x, y))

        # The steady state receives the next input together with sending a gradient, so
        # the first input is received up front.
        x = recv_forward(ctx, shape, dtype, trace) if num_steady > 0 else None
        for k in range(num_steady):
            i = num_warmup + k
            y = self._forward(i, x)
            stash.append((i, x, y))
            g = send_forward_recv_backward(ctx, y, shape, dtype, trace)
            self._release(y)
            old_i, old_x, old_y = stash.popleft()  # backward the oldest micro-batch (FIFO)
            input_grad = self._backward(old_i, old_x, old_y, g)
            if k == num_steady - 1:
                send_backward(ctx, input_grad, trace)
            else:
                x = send_backward_recv_forward(ctx, input_grad, shape, dtype, trace)

        while stash:  # cool-down
            old_i, old_x, old_y = stash.popleft()
            g = recv_backward(ctx, shape, dtype, trace)
            send_backward(ctx, self._backward(old_i, old_x, old_y, g), trace)


def build_engine(name: str, ctx, virtual_stages: int = 1, trace=NO_TRACE) -> PipelineEngine:
    """The engine for config value ``parallelism.pp_engine`` (afab, 1f1b or interleaved_1f1b,
    any case); ``virtual_stages`` (chunks per rank) is only for interleaved_1f1b."""
    from nanoexp.parallel.interleaved import InterleavedOneForwardOneBackward   # it builds on this module

    engines = {"afab": AllForwardAllBackward, "1f1b": OneForwardOneBackward,
               "interleaved_1f1b": InterleavedOneForwardOneBackward}
    key = str(name).lower()
    if key not in engines:
        raise ValueError(f"unknown parallelism.pp_engine {name!r}; expected one of {sorted(engines)}")
    if key == "interleaved_1f1b":
        return engines[key](ctx, num_chunks=virtual_stages, trace=trace)
    if virtual_stages != 1:
        raise ValueError(f"parallelism.pp_virtual_stages={virtual_stages} needs parallelism.pp_engine=interleaved_1f1b")
    return engines[key](ctx, trace=trace)
