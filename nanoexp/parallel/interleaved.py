"""Interleaved 1F1B: each pipeline rank holds v non-adjacent chunks of layers.

With pp ranks and v chunks per rank the model is cut into pp·v virtual stages; chunk c of
pp rank r is virtual stage c·pp + r, so a micro-batch travels the ring of ranks v times
(rank pp-1's chunk c sends to rank 0's chunk c+1). Each chunk is 1/v of a stage's work, so
the pipeline fills and drains v times faster: with m micro-batches the bubble fraction drops
from (p-1)/(m+p-1) for 1F1B to (p-1)/(v·m+p-1), at the price of v times more point-to-point
messages (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", section 2.2.2).

The order of work on one rank (`interleaved_order`) is that paper's schedule: forwards walk
through the micro-batches in groups of pp, chunk 0 then chunk 1 ... for each group; backwards
do the same with the chunks reversed. A rank runs a warm-up of 2·(pp-r-1) + (v-1)·pp forwards,
then alternates one forward and one backward, then drains the backwards. It needs the number
of micro-batches to be a multiple of pp.

Communication: sends are posted asynchronously and receives block where the data is needed.
Every message carries a tag naming (direction, receiving virtual stage, micro-batch), so the
order in which a rank posts its sends never has to match the order its neighbour receives
them. That this order cannot deadlock is checked for many (pp, v, m) in
tests/test_pipeline.py by simulating the dependencies.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nanoexp.parallel.pipeline import PipelineEngine
from nanoexp.parallel.trace import NO_TRACE


def interleaved_order(pp: int, num_chunks: int, num_micro: int, pp_rank: int) -> list[tuple[str, int, int]]:
    """This rank's work for one step: ("F" | "B", chunk, micro_batch) in execution order.
    Each (chunk, micro-batch) appears once as "F" and later once as "B"; every chunk's
    backwards come in micro-batch order. Needs num_micro % pp == 0."""
    if num_micro % pp:
        raise ValueError(f"interleaved 1F1B needs the micro-batches per step ({num_micro}) to be a multiple "
                         f"of parallelism.pp ({pp})")
    group = pp * num_chunks   # micro-batch groups of pp, each through every chunk

    def forward_id(k):   # the k-th forward on this rank
        rounds, within = divmod(k, group)
        return within // pp, rounds * pp + within % pp

    def backward_id(k):  # the k-th backward: the same walk with the chunks reversed
        chunk, mb = forward_id(k)
        return num_chunks - 1 - chunk, mb

    total = num_micro * num_chunks
    num_warmup = min(2 * (pp - pp_rank - 1) + (num_chunks - 1) * pp, total)
    order = [("F", *forward_id(k)) for k in range(num_warmup)]
    for k in range(total - num_warmup):
        order += [("F", *forward_id(num_warmup + k)), ("B", *backward_id(k))]
    order += [("B", *backward_id(k)) for k in range(total - num_warmup, total)]
    return order


class InterleavedOneForwardOneBackward(PipelineEngine):
    """Interleaved 1F1B over ``num_chunks`` chunks per rank (see the module docstring).

    ``forward_step(micro_batch, input_tensor, chunk)`` runs one chunk; chunk 0 of pp rank 0
    reads the micro-batch (``input_tensor`` is None) and chunk v-1 of the last rank returns
    the loss. ``max_in_flight`` counts (micro-batch, chunk) activations held at once.
    """

    name = "interleaved_1f1b"

    def __init__(self, ctx, num_chunks: int, trace=NO_TRACE):
        if num_chunks < 1 or ctx.pp < 2:
            raise ValueError(f"interleaved 1F1B needs parallelism.pp >= 2 (got {ctx.pp}) and "
                             f"parallelism.pp_virtual_stages >= 1 (got {num_chunks})")
        super().__init__(ctx, num_chunks, trace)
        self._sends: list = []   # (work, tensor) of sends not yet known to be complete

    # -- who talks to whom ----------------------------------------------------------------
    def _stage(self, chunk: int) -> int:
        return chunk * self.ctx.pp + self.ctx.pp_rank

    def _peer(self, stage: int) -> int | None:
        """Global rank holding virtual stage `stage` in this rank's pipeline (None: off the end)."""
        if stage < 0 or stage >= self.ctx.pp * self.num_chunks:
            return None
        ctx = self.ctx
        return ctx.global_rank(stage % ctx.pp, ctx.dp_rank, ctx.tp_rank)

    def _tag(self, direction: int, to_stage: int, mb: int) -> int:
        return (direction * self.ctx.pp * self.num_chunks + to_stage) * self._num_micro + mb

    def _send(self, tensor, chunk: int, mb: int, forward: bool) -> None:
        """Post the activation (forward) or input gradient (backward) of (chunk, mb) to the
        neighbouring virtual stage, without waiting; no-op at either end of the pipeline."""
        to_stage = self._stage(chunk) + (1 if forward else -1)
        peer = self._peer(to_stage)
        if peer is None:
            return
        # gloo: sending a non-contiguous tensor fails on the sender and hangs the receiver.
        buf = tensor.detach().contiguous()
        with self.trace.span("send_forward" if forward else "send_backward", mb=mb, chunk=chunk):
            work = dist.isend(buf, peer, group=self.ctx.pp_group, tag=self._tag(int(forward), to_stage, mb))
        self._sends.append((work, buf))

    def _recv(self, chunk: int, mb: int, forward: bool) -> torch.Tensor | None:
        """Block until the input activation (forward) or output gradient (backward) of
        (chunk, mb) arrives; None where the pipeline starts (forward) or ends (backward)."""
        stage = self._stage(chunk)
        peer = self._peer(stage - 1 if forward else stage + 1)
        if peer is None:
            return None
        buf = torch.empty(self._shape, dtype=self._dtype, device=self.ctx.device)
        with self.trace.span("recv_forward" if forward else "recv_backward", mb=mb, chunk=chunk):
            dist.irecv(buf, peer, group=self.ctx.pp_group, tag=self._tag(int(forward), stage, mb)).wait()
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]   # free delivered buffers
        return buf.requires_grad_() if forward else buf

    def _wait_sends(self) -> None:
        with self.trace.span("wait_sends"):
            for work, _ in self._sends:
                work.wait()
        self._sends = []

    # -- the schedules --------------------------------------------------------------------
    def _schedule(self):
        stash = {}   # (chunk, mb) -> (input, output) until its backward
        for op, chunk, mb in interleaved_order(self.ctx.pp, self.num_chunks, self._num_micro, self.ctx.pp_rank):
            if op == "F":
                x = self._recv(chunk, mb, forward=True)
                y = self._forward(mb, x, chunk)
                self._send(y, chunk, mb, forward=True)
                self._release(y, chunk)
                stash[chunk, mb] = (x, y)
            else:
                x, y = stash.pop((chunk, mb))
                g = self._recv(chunk, mb, forward=False)
                self._send(self._backward(mb, x, y, g, chunk), chunk, mb, forward=False)
        self._wait_sends()

    @torch.no_grad()
    def forward_only(self, forward_step, micro_batches: list, tensor_shape: tuple, dtype) -> list[torch.Tensor]:
        """Evaluation: every micro-batch through every chunk in (micro-batch, chunk) order,
        keeping no graph. Returns the per-micro-batch losses on the last rank, [] elsewhere.
        Not traced: the timeline shows training steps only."""
        self._shape, self._dtype, self._num_micro = tuple(tensor_shape), dtype, len(micro_batches)
        trace, self.trace, losses = self.trace, NO_TRACE, []
        try:
            for mb, batch in enumerate(micro_batches):
                for chunk in range(self.num_chunks):
                    output = forward_step(batch, self._recv(chunk, mb, forward=True), chunk)
                    if self.is_loss_chunk(chunk):
                        losses.append(output.detach())
                    else:
                        self._send(output, chunk, mb, forward=True)
            self._wait_sends()
        finally:
            self.trace = trace
        return losses
