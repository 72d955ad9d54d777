"""Interleaved 1F1B: each pipeline rank holds v non-adjacent chunks of layers.

With pp ranks and v chunks per rank the model is cut into pp·v virtual stages; chunk c of
pp rank r is virtual stage c·pp + r, so a micro-batch travels the ring of ranks v times
(rank pp-1's chunk c sends to rank 0's chunk c+1). Each chunk is 1/v of a stage's work, so
the pipeline fills and drains v times faster: with m micro-batches the bubble fraction drops
from (p-1)/(m+p-1) for 1F1B to (p-1)/(v·m+p-1), at the price of v times more point-to-point
messages (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", section 2.2.2).

The order of work on one rank (`p2p_plan.interleaved_order`) is that paper's schedule:
forwards walk through the micro-batches in groups of pp, chunk 0 then chunk 1 ... for each
group; backwards do the same with the chunks reversed. A rank runs a warm-up of
2·(pp-r-1) + (v-1)·pp forwards, then alternates one forward and one backward, then drains the
backwards. It needs the number of micro-batches to be a multiple of pp.

Communication (`p2p_plan.schedule`): each steady (forward, backward) pair is one group of
compute, each warm-up forward and cool-down backward a group of its own, and between two
groups ONE batch_isend_irecv carries the sends of the group before and the receives of the
group after -- the batched exchanges of Megatron-LM's interleaved schedule. No tags: on every
channel between two ranks the sender's messages come in the order the receiver asks for them.
Posting one message at a time, as this engine once did, deadlocks under NCCL (whose large
sends wait for the matching receive); tests/test_p2p_plan.py shows that with `p2p_plan.check`
and checks the batched plan for pp 2..8, v 1..4 and every valid m up to 16, and a simulation
there shows that even with such blocking sends the schedule keeps the ideal bubble.
"""
from __future__ import annotations

from nanoexp.parallel.pipeline import PipelineEngine
from nanoexp.parallel.trace import NO_TRACE


class InterleavedOneForwardOneBackward(PipelineEngine):
    """Interleaved 1F1B over ``num_chunks`` chunks per rank (see the module docstring).

    ``forward_step(micro_batch, input_tensor, chunk)`` runs one chunk; chunk 0 of pp rank 0
    reads the micro-batch (``input_tensor`` is None) and chunk v-1 of the last rank returns
    the loss. ``max_in_flight`` counts (micro-batch, chunk) activations held at once.
    """

    name = "interleaved_1f1b"

    def __init__(self, ctx, num_chunks: int, trace=NO_TRACE):
        if num_chunks < 1 or ctx.pp < 2:
            raise ValueError(f"interleaved 1F1B needs at least 2 pipeline ranks (got {ctx.pp}) and at least "
                             f"1 chunk per rank (got {num_chunks})")
        super().__init__(ctx, num_chunks, trace)
