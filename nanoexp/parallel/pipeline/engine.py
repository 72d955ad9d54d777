"""The pipeline engine: runs this rank's schedule (schedules.py) for one optimizer step.

Virtual stage 0 owns the token embedding and the first layers, the last one the last layers, the final norm and
the LM head (it computes the loss); stages in between hold only layers (stages.py: which rank runs which).
Activations travel forward between neighbouring stages and their gradients backward, point to point through a
Mailbox (posted at once, waited for when read). Every schedule of `parallelism.pp_engine` (schedules.SCHEDULES)
gives exactly the gradients of plain gradient accumulation; they differ only
in their schedule, which this executor takes from `schedule` and runs step by step. The caller's
`forward_step` runs the chunk's modules and, on the last stage, the loss: the engine knows no model.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from nanoexp.parallel.pipeline.mailbox import Mailbox
from nanoexp.parallel.pipeline.schedules import SCHEDULES, check_shape, schedule, stage_map
from nanoexp.instruments.heartbeat import HEARTBEAT
from nanoexp.instruments.trace import NO_TRACE

ACTION_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}   # what the heartbeat says a step does


class PipelineEngine:
    """Runs one optimizer step's micro-batches through this rank's pipeline stage by the schedule named
    `schedule` (a name of SCHEDULES: Layout.schedule) with `num_chunks` chunks of layers per rank
    (Layout.virtual_stages: 1 except for interleaved_1f1b, zbv and dualpipev); chunk `num_chunks - 1` of the
    head's rank (the last stage) computes the loss. It keeps the per-micro-batch forward and backward steps and their
    bookkeeping: losses, the gradient sync's calls around each backward, `max_in_flight` (most micro-batch
    chunks whose saved tensors were held at once: from F to B, or to W where W is split off), the trace."""

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
        self.stages = stage_map(self.schedule, ctx.pp, self.num_chunks)
        mail = Mailbox(ctx.pp_group, self._global_peer, self._shape, dtype, ctx.device, self.trace)
        # Keyed by compute op ("F" | "B", chunk, mb): tensors it made that are still to be sent, and (input,
        # output) of each forward until its backward.
        outbox, stash, held = {}, {}, set()   # held: micro-batch chunks whose saved tensors are kept
        keep_graph = not forward_only
        try:
            for step in schedule(self.schedule, ctx.pp, self.num_chunks, len(micro_batches), ctx.pp_rank, forward_only):
                if step[0] == "P2P":
                    for tensor, msg in zip(mail.post(step[1], outbox.pop), [m for m in step[1] if m[0] == "send"]):
                        if msg[1] == "F":
                            self._release(tensor, msg[2])   # the next stage holds its copy
                    continue
                if step[0] == "LOCAL":   # zbv's V tip: an output becomes this rank's other chunk's input
                    kind, chunk, mb = step[1][1:]
                    receiver = self.stages.other_end(step[1], ctx.pp_rank)[1]
                    mail.hand_over((kind, receiver, mb), outbox.pop((kind, chunk, mb)).detach())
                    continue
                self._compute(step, mail, outbox, stash, held, keep_graph)
            mail.drain()
        finally:
            self._forward_fn = self._micro_batches = None
        assert not (outbox or stash), "the schedule left messages or activations behind"
        losses, self._losses = self._losses, []
        return losses

    def _compute(self, step, mail, outbox: dict, stash: dict, held: set, keep_graph: bool) -> None:
        """One compute op of the schedule, ("F" | "B" | "W", chunk, mb): its input taken from `mail`, what it makes
        to send put in `outbox`, a forward's (input, output) in `stash` until its backward, `held` updated."""
        kind, chunk, mb = step
        # Marked here, not wrapped from outside as the trainer's phases are: each action is the stall diagnosis'
        # evidence of where a pipeline rank waits (the step and action that posted a collective).
        HEARTBEAT.at(f"{ACTION_NAMES[kind]} of micro-batch {mb}"
                     + (f" (chunk {chunk})" if self.num_chunks > 1 else ""))
        if kind == "F":
            x = mail.take(step)
            if x is not None and keep_graph:
                x.requires_grad_()   # a received activation is this chunk's input: its gradient goes back
            y = self._forward(mb, x, chunk)
            if not self.is_loss_chunk(chunk):
                outbox[step] = y
            if keep_graph:
                stash[chunk, mb] = (x, y)
                held.add((chunk, mb))
                self.max_in_flight = max(self.max_in_flight, len(held))
        elif kind == "B":
            x, y = stash.pop((chunk, mb))
            if not self.splits_backward:
                held.discard((chunk, mb))
            input_grad = self._backward(mb, x, y, mail.take(step), chunk)
            if input_grad is not None:
                outbox[step] = input_grad
        else:
            self._weight_step(mb, chunk)
            held.discard((chunk, mb))   # the linears' inputs and output gradients, kept from B to W

    def _global_peer(self, msg) -> int:
        """The global rank at the other end of a message: the same dp, cp and tp position on the peer's pp rank."""
        ctx = self.ctx
        return ctx.layout.rank_at(self.stages.peer(msg, ctx.pp_rank), ctx.dp_rank, ctx.cp_rank, ctx.tp_rank)

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
        elif self._sync is not None:
            self._sync.before_input_backward(chunk)   # ZeRO-3 gathers the weights B multiplies by
        deferring = self.weight_gradients.deferring((chunk, i)) if self.splits_backward else nullcontext()
        with self.trace.span("backward", mb=i, chunk=chunk), deferring:
            if output_grad is None:  # the loss chunk: output is the loss
                output.backward()
            else:
                torch.autograd.backward(output, output_grad)
        if sync is not None:
            sync.after_backward(chunk, last)
        elif self._sync is not None:
            self._sync.after_input_backward(chunk)
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
