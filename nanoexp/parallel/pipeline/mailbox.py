"""A pp rank's messages of one step: each of the schedule's batches is posted with one batch_isend_irecv and
not waited for as a whole. A received tensor is waited for when the op that needs it runs, so a rank computes
(a W, a forward) while its next input is still on the way; a sent tensor is kept until a later wait proves it
delivered. Under NCCL a group's batches run in order on one stream, so once a receive of batch k has come,
every send of batches up to k has too; gloo's sends are buffered and return at once.

No tags: as under NCCL, the k-th send to a peer meets the peer's k-th receive from us (schedules.py orders
them so, and nanoexp.verify.p2p_plan checks it)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from nanoexp.instruments.heartbeat import HEARTBEAT
from nanoexp.instruments.trace import NO_TRACE


class Mailbox:
    """Posts batches of messages ("send" | "recv", "F" | "B", chunk, micro_batch) to the ranks `peer_rank(msg)`
    names; hands received tensors to the ops keyed ("F" | "B", chunk, micro_batch)."""

    def __init__(self, group, peer_rank, shape: tuple, dtype, device, trace=NO_TRACE):
        self.group, self.peer_rank, self.shape, self.dtype, self.device = group, peer_rank, shape, dtype, device
        self.trace = trace
        self.arriving: dict[tuple, tuple] = {}   # op -> (its batch's number, the receive buffer, the sender)
        self.in_hand: dict[tuple, torch.Tensor] = {}   # op -> a tensor handed over in memory (zbv's V tip)
        self.in_flight: list[tuple] = []         # (number, works, sent tensors) of the batches not yet waited for
        self.posted = 0

    def post(self, batch, take_outgoing) -> list[torch.Tensor]:
        """Post one batch; `take_outgoing(op)` gives each send's tensor. Returns the sent tensors."""
        ops, labels, sent = [], [], []
        self.posted += 1
        for msg in batch:
            verb, op = msg[0], msg[1:]
            if verb == "send":
                sent.append(take_outgoing(op))
                # gloo: sending a non-contiguous tensor fails on the sender and hangs the receiver.
                ops.append(dist.P2POp(dist.isend, sent[-1].detach().contiguous(), self.peer_rank(msg), self.group))
            else:
                buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buffer, self.peer_rank(msg), self.group))
                self.arriving[op] = (self.posted, buffer, self.peer_rank(msg))
            labels.append(f"{verb}_{'forward' if op[0] == 'F' else 'backward'}")
        with self.trace.span("post " + " ".join(labels)):
            works = dist.batch_isend_irecv(ops)   # NCCL: one work for the batch; gloo: one per op
        self.in_flight.append((self.posted, works, [op.tensor for op in ops]))   # buffers live until waited
        return sent

    def hand_over(self, op, tensor: torch.Tensor) -> None:
        self.in_hand[op] = tensor

    def take(self, op) -> torch.Tensor | None:
        """The tensor received for `op` (waiting for its batch if it is still on the way), or None if none comes."""
        if op in self.in_hand:
            return self.in_hand.pop(op)
        if op not in self.arriving:
            return None
        number, buffer, sender = self.arriving.pop(op)
        if self.in_flight and self.in_flight[0][0] <= number:
            what = "activation" if op[0] == "F" else "gradient"
            # The stall diagnosis names the sender a rank waits for from this mark (gloo records no p2p message).
            HEARTBEAT.at(f"receive of micro-batch {op[2]}'s {what} (chunk {op[1]})", waiting_on=sender)
            with self.trace.span(f"wait recv_{'forward' if op[0] == 'F' else 'backward'}", mb=op[2], chunk=op[1]):
                self._wait(up_to=number)
        return buffer

    def drain(self) -> None:
        """The end of the step: wait for every batch (a receive nobody took is a schedule's bug)."""
        assert not self.arriving and not self.in_hand, "the schedule left messages behind"
        if self.in_flight:
            with self.trace.span("wait sends"):
                self._wait(up_to=self.posted)

    def _wait(self, up_to: int) -> None:
        """Wait for the batches up to number `up_to`, in posting order (their stream's order under NCCL)."""
        while self.in_flight and self.in_flight[0][0] <= up_to:
            for work in self.in_flight.pop(0)[1]:
                work.wait()
