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

Communication: an engine does not decide what to post as it goes. Its steps for one optimizer
step -- forwards, backwards and batches of sends and receives, each batch posted with one
``batch_isend_irecv`` and waited on as a whole -- are data, ``p2p_plan.schedule``, and
``PipelineEngine`` executes them in order. So the ops an engine posts are exactly
``p2p_plan.plan``, which ``p2p_plan.check`` replays under NCCL's rules (in-order channels, no
tags, a send completes only when its receive is posted) to show that it cannot deadlock there.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nanoexp.parallel.p2p_plan import peer, schedule
from nanoexp.parallel.trace import NO_TRACE


def split_layers(num_layers: int, pp: int) -> list[range]:
    """Assign layers to pipeline stages: ``pp`` contiguous, balanced ranges covering
    ``range(num_layers)``. When the split is uneven the earlier stages get one extra layer
    (the last stage also carries the final norm and the LM head, so it should not be the
    heavier one). The embedding lives on stage 0, the final norm + LM head on stage pp-1.
    Raises ValueError if pp < 1 or pp > num_layers (a stage without layers)."""
    if pp < 1 or pp > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {pp} pipeline stages "
                         f"(every stage needs at least one layer)")
    base, extra = divmod(num_layers, pp)
    ranges, start = [], 0
    for stage in range(pp):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


# -- engines ---------------------------------------------------------------------------------

class PipelineEngine:
    """Runs one optimizer step's micro-batches through this rank's pipeline stage.

    What runs when, and which messages are posted together, is ``p2p_plan.schedule`` for the
    engine's ``name``; this class executes it and holds the per-micro-batch forward and backward
    steps and the bookkeeping (losses, the last-backward hook, ``max_in_flight``, the trace). A
    rank holds ``num_chunks`` chunks of layers (1 except for the interleaved engine); chunk
    ``num_chunks - 1`` of the last stage computes the loss.
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
        self._hook, self._backwards_done, self.max_in_flight = on_last_backward, [0] * self.num_chunks, 0
        losses = self._execute(forward_step, micro_batches, tensor_shape, dtype, forward_only=False)
        assert self._backwards_done == [len(micro_batches)] * self.num_chunks
        return losses

    @torch.no_grad()
    def forward_only(self, forward_step, micro_batches: list, tensor_shape: tuple, dtype) -> list[torch.Tensor]:
        """Evaluation: every micro-batch through every chunk (micro-batch by micro-batch),
        keeping no graph. Returns the per-micro-batch losses on the last stage, [] elsewhere.
        Not traced: the timeline shows training steps only."""
        if not micro_batches:
            return []
        trace, self.trace = self.trace, NO_TRACE
        try:
            return self._execute(forward_step, micro_batches, tensor_shape, dtype, forward_only=True)
        finally:
            self.trace = trace

    def is_loss_chunk(self, chunk: int) -> bool:
        return self.ctx.is_last_stage and chunk == self.num_chunks - 1

    def _execute(self, forward_step, micro_batches, tensor_shape, dtype, forward_only) -> list[torch.Tensor]:
        """Run this rank's schedule step by step; returns the losses recorded by the loss chunk."""
        ctx = self.ctx
        self._forward_fn, self._micro_batches, self._losses = forward_step, micro_batches, []
        self._shape, self._dtype, self._num_micro = tuple(tensor_shape), dtype, len(micro_batches)
        # Keyed by compute op ("F" | "B", chunk, mb): tensors received for it, tensors it made
        # that are still to be sent, and (input, output) of each forward until its backward.
        inbox, outbox, stash = {}, {}, {}
        try:
            for step in schedule(self.name, ctx.pp, self.num_chunks, len(micro_batches), ctx.pp_rank, forward_only):
                if step[0] == "P2P":
                    self._exchange(step[1], inbox, outbox, keep_graph=not forward_only)
                    continue
                kind, chunk, mb = step
                if kind == "F":
                    x = inbox.pop(step, None)
                    y = self._forward(mb, x, chunk)
                    if not self.is_loss_chunk(chunk):
                        outbox[step] = y
                    if not forward_only:
                        stash[chunk, mb] = (x, y)
                        self.max_in_flight = max(self.max_in_flight, len(stash))
                else:
                    x, y = stash.pop((chunk, mb))
                    input_grad = self._backward(mb, x, y, inbox.pop(step, None), chunk)
                    if input_grad is not None:
                        outbox[step] = input_grad
        finally:
            self._forward_fn = self._micro_batches = None
        assert not (inbox or outbox or stash), "the schedule left messages or activations behind"
        losses, self._losses = self._losses, []
        return losses

    def _exchange(self, batch, inbox: dict, outbox: dict, keep_graph: bool) -> None:
        """Post one batch of the schedule with one batch_isend_irecv and wait for all of it:
        sends take their tensor from ``outbox``, receives leave theirs in ``inbox``. No tags:
        as under NCCL, the k-th send to a peer meets the peer's k-th receive from us."""
        ctx, ops, labels, received, sent = self.ctx, [], [], [], []
        for msg in batch:
            verb, op = msg[0], msg[1:]
            rank = ctx.global_rank(peer(msg, ctx.pp, ctx.pp_rank), ctx.dp_rank, ctx.tp_rank)
            if verb == "send":
                tensor = outbox.pop(op)
                sent.append((tensor, op))
                # gloo: sending a non-contiguous tensor fails on the sender and hangs the receiver.
                ops.append(dist.P2POp(dist.isend, tensor.detach().contiguous(), rank, group=ctx.pp_group))
            else:
                buf = torch.empty(self._shape, dtype=self._dtype, device=ctx.device)
                ops.append(dist.P2POp(dist.irecv, buf, rank, group=ctx.pp_group))
                received.append((buf, op))
            labels.append(f"{verb}_{'forward' if op[0] == 'F' else 'backward'}")
        with self.trace.span(" ".join(labels)):
            for req in dist.batch_isend_irecv(ops):   # ops (and their buffers) live until here
                req.wait()
        for buf, op in received:
            # A received activation is this chunk's input: a leaf whose gradient goes back.
            inbox[op] = buf.requires_grad_() if op[0] == "F" and keep_graph else buf
        for tensor, op in sent:
            if op[0] == "F":
                self._release(tensor, op[1])

    # -- one micro-batch through one chunk ----------------------------------------------------
    def _forward(self, i, input_tensor, chunk=0):
        """Run forward_step on micro-batch i; for the loss chunk record the loss, elsewhere
        check the output against tensor_shape/dtype (a mismatch would corrupt or hang the
        receiver)."""
        with self.trace.span("forward", mb=i, chunk=chunk):
            output = self._forward_fn(self._micro_batches[i], input_tensor, chunk)
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
    """GPipe-style: all forwards, then all backwards in the same order, one message per batch.
    Holds every micro-batch's activations at the peak (max_in_flight == number of micro-batches)."""

    name = "afab"


class OneForwardOneBackward(PipelineEngine):
    """1F1B: stage r runs (pp - r - 1) warm-up forwards, then alternates one forward and one
    backward, then drains the warm-up backwards. It holds at most pp - r micro-batches. In the
    steady state each send shares a batch with the receive the neighbour answers it with
    (send_forward_recv_backward, send_backward_recv_forward), so the two neighbours never wait
    on each other's sends.

    With fewer micro-batches than stages the warm-up is capped at the number of micro-batches,
    so the early stages degenerate to all-forward-all-backward: still correct, more bubble.
    """

    name = "1f1b"


def build_engine(name: str, ctx, virtual_stages: int = 1, trace=NO_TRACE) -> PipelineEngine:
    """The engine for config value ``parallelism.pp_engine`` (afab, 1f1b or interleaved_1f1b,
    any case); ``virtual_stages`` (chunks per rank) is only for interleaved_1f1b."""
    from nanoexp.parallel.interleaved import InterleavedOneForwardOneBackward   # it builds on this module

    engines = {"afab": AllForwardAllBackward, "1f1b": OneForwardOneBackward,
               "interleaved_1f1b": InterleavedOneForwardOneBackward}
    key = str(name).lower()
    if key not in engines:
        raise ValueError(f"unknown pipeline engine {name!r}; expected one of {sorted(engines)}")
    if key == "interleaved_1f1b":
        return engines[key](ctx, num_chunks=virtual_stages, trace=trace)
    if virtual_stages != 1:
        raise ValueError(f"{virtual_stages} virtual stages per rank need the interleaved_1f1b engine")
    return engines[key](ctx, trace=trace)
