"""The pipeline engine: runs this rank's schedule (schedules.py) for one optimizer step.

Stage 0 owns the token embedding and the first layers, the last stage the last layers, the final norm and the
LM head (it computes the loss); stages in between hold only layers. Activations travel forward between
neighbouring stages and their gradients backward, point to point. Every engine of `parallelism.pp_engine`
(afab, 1f1b, interleaved_1f1b, zb_h1) gives exactly the gradients of plain gradient accumulation; they differ only
in their schedule, which this executor takes from `schedule` and runs step by step. The caller's
`forward_step` runs the chunk's modules and, on the last stage, the loss: the engine knows no model.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from nanoexp.parallel.pipeline.schedules import SCHEDULES, check_shape, peer, schedule
from nanoexp.observe.trace import NO_TRACE


class PipelineEngine:
    """Runs one optimizer step's micro-batches through this rank's pipeline stage by the schedule named
    `schedule` (afab, 1f1b, interleaved_1f1b, zb_h1: Layout.schedule) with `num_chunks` chunks of
    layers per rank (Layout.virtual_stages: 1 except for interleaved_1f1b); chunk `num_chunks - 1` of the
    last stage computes the loss. It keeps the per-micro-batch forward and backward steps and their
    bookkeeping: losses, the gradient sync's calls around each backward, `max_in_flight` (most micro-batch
    chunks whose activations were held at once), the trace."""

    def __init__(self, ctx, schedule: str, num_chunks: int = 1, trace=NO_TRACE, weight_gradients=None):
        check_shape(schedule, ctx.pp, num_chunks)   # the number of micro-batches is checked at each run
        self.ctx, self.schedule, self.num_chunks, self.trace = ctx, schedule, num_chunks, trace
        self.weight_gradients = weight_gradients   # WeightGradients of the model's linears: schedules with W steps
        if SCHEDULES[schedule].splits_backward and weight_gradients is None:
            raise ValueError(f"the {schedule} schedule splits backwards: it needs the model's WeightGradients")
        self.max_in_flight = 0

    def run(self, forward_step, micro_batches: list, tensor_shape: tuple, dtype,
            grad_sync=None) -> list[torch.Tensor]:
        """Forward and backward every micro-batch; gradients accumulate in the parameters.

        ``forward_step(micro_batch, input_tensor, chunk)`` runs chunk ``chunk`` and returns, for the loss
        chunk of the last stage, the scalar loss of that micro-batch (already scaled so that the sum over
        micro-batches is the step loss); elsewhere the activation to send on, which must have exactly
        ``tensor_shape`` and ``dtype`` (both also size the receive buffers, so every stage must pass the
        same values). ``input_tensor`` is None for chunk 0 of the first stage. ``grad_sync`` (GradientSync)
        hears of each backward through chunk c: ``before_backward(c, last)`` and ``after_backward(c, last)``,
        ``last`` for the chunk's last of the step (its gradients are final after it). Returns the detached
        per-micro-batch losses on the last stage, [] elsewhere.
        """
        if not micro_batches:
            raise ValueError("PipelineEngine.run needs at least one micro-batch")
        self._sync, self._backwards_done, self.max_in_flight = grad_sync, [0] * self.num_chunks, 0
        self._weights_done = [0] * self.num_chunks
        losses = self._execute(forward_step, micro_batches, tensor_shape, dtype, forward_only=False)
        assert self._backwards_done == [len(micro_batches)] * self.num_chunks
        assert self._weights_done == [len(micro_batches) if self.splits_backward else 0] * self.num_chunks
        return losses

    @property
    def splits_backward(self) -> bool:
        return SCHEDULES[self.schedule].splits_backward

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
            for step in schedule(self.schedule, ctx.pp, self.num_chunks, len(micro_batches), ctx.pp_rank, forward_only):
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
                elif kind == "B":
                    x, y = stash.pop((chunk, mb))
                    input_grad = self._backward(mb, x, y, inbox.pop(step, None), chunk)
                    if input_grad is not None:
                        outbox[step] = input_grad
                else:
                    self._weight_step(mb, chunk)
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
            rank = ctx.layout.rank_at(peer(msg, ctx.pp, ctx.pp_rank), ctx.dp_rank, ctx.cp_rank, ctx.tp_rank)
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
        last = self._backwards_done[chunk] == self._num_micro
        sync = self._sync if not self.splits_backward else None   # split: the sync hears of the W steps instead
        if sync is not None:
            sync.before_backward(chunk, last)   # e.g. let the gradient hooks start reductions
        deferring = self.weight_gradients.deferring((chunk, i)) if self.splits_backward else nullcontext()
        with self.trace.span("backward", mb=i, chunk=chunk), deferring:
            if output_grad is None:  # the loss chunk: output is the loss
                output.backward()
            else:
                torch.autograd.backward(output, output_grad)
        if sync is not None:
            sync.after_backward(chunk, last)
        if input_tensor is None:
            return None
        # A stage that ignores its input still owes the previous stage a gradient.
        return input_tensor.grad if input_tensor.grad is not None else torch.zeros_like(input_tensor)

    def _weight_step(self, i, chunk=0):
        """W of micro-batch i through a chunk: the weight gradients its B left (weight_grad.py). The gradient sync
        hears of it as of a backward: the chunk's last W is its last gradient (its last B came before)."""
        self._weights_done[chunk] += 1
        last = self._weights_done[chunk] == self._num_micro
        if self._sync is not None:
            self._sync.before_backward(chunk, last)
        with self.trace.span("weight", mb=i, chunk=chunk):
            self.weight_gradients.run((chunk, i))
        if self._sync is not None:
            self._sync.after_backward(chunk, last)

    def _release(self, output, chunk=0):
        """Free an output activation once it has been sent: the next stage owns a copy and
        our backward needs only its graph and shape. A one-element view keeps the shape (so
        autograd's shape check passes) without the memory; tensors the graph saved for
        backward are separate tensors and stay intact."""
        if self.is_loss_chunk(chunk) or output.grad_fn is None or output._base is not None:
            return  # a loss, a leaf or a view: leave it alone
        output.data = torch.empty((), dtype=output.dtype, device=output.device).expand(output.shape)
