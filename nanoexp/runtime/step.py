"""One step's micro-batches through this rank's part of the model: what training, the held-out loss, downstream
scoring and offline evaluation all run.

`StepRunner.prepare` takes a micro-batch as the data gives it ([b, s] tensors on the CPU) to the device, keeps
this cp rank's zig-zag part of every sample and adds the positions of those tokens; `train` and `forward_only`
run the prepared micro-batches through the pipeline engine's schedule, each stage's forward reading them by
`forward`. The loss is normalised on the device: each micro-batch's token-loss sum over `loss_denominator`.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from nanoexp.instruments.memory import saved_activation_bytes
from nanoexp.model.llama import IGNORE_INDEX
from nanoexp.parallel.context_parallel.zigzag import zigzag_indices, zigzag_split


class StepRunner:
    """This rank's model shard, its pipeline engine and autocast, for micro-batches of `micro_batch_size` samples
    of `sequence_length` tokens."""

    def __init__(self, model, ctx, engine, autocast, micro_batch_size: int, sequence_length: int):
        self.model, self.ctx, self.engine, self.autocast = model, ctx, engine, autocast
        self.micro_batch_size, self.sequence_length = micro_batch_size, sequence_length
        self.activation_shape = ctx.layout.activation_shape(micro_batch_size, sequence_length, model.shape.hidden_size)
        self.saved_bytes = None   # what autograd keeps of one micro-batch for backward, measured on the first

    def prepare(self, micro_batch: dict) -> dict:
        """On the device, this cp rank's part of every sample (the whole of it when cp = 1), with `position_ids`:
        the positions of those tokens ([s/cp]; with document masking the batch's own, restarting in each
        document, [b, s/cp])."""
        ctx, length = self.ctx, micro_batch["input_ids"].shape[1]
        # Pinned by the loader on CUDA: the copies run without the host waiting for them.
        batch = {key: value.to(ctx.device, non_blocking=True) for key, value in micro_batch.items()}
        if ctx.cp > 1:
            batch = {key: zigzag_split(value, ctx.cp, ctx.cp_rank) for key, value in batch.items()}
        if "position_ids" not in batch:
            positions = zigzag_indices(length, ctx.cp, ctx.cp_rank) if ctx.cp > 1 else torch.arange(length)
            batch["position_ids"] = positions.to(ctx.device, non_blocking=True)
        return batch

    def forward(self, micro_batch: dict, hidden_states, chunk: int, head):
        """One prepared micro-batch through chunk `chunk` of this stage: hidden states for the next stage, or on
        the loss chunk `head(logits or per-token losses, micro_batch)`. head.labels: whether the model computes
        the per-token losses (else it returns the logits)."""
        model = self.model
        first, last = model.has_embedding(chunk), model.has_head(chunk)
        with self.autocast:
            out = model(input_ids=micro_batch["input_ids"] if first else None, hidden_states=hidden_states,
                        labels=micro_batch["labels"] if last and head.labels else None, chunk=chunk,
                        position_ids=micro_batch["position_ids"], document_ids=micro_batch.get("document_ids"))
        return head(out, micro_batch) if last else out

    def loss_denominator(self, micro_batches: list[dict]) -> torch.Tensor:
        """The real (not IGNORE_INDEX) target tokens of the global batch / (dp * cp), counted in this rank's (cp
        part of its) micro-batches, on the device. Each micro-batch's loss is its token-loss sum over this, so the
        dp x cp average of the ranks' losses (and gradients) is the mean over every real target token of the
        global batch, whatever the layout (with replica groups: of the live groups' part of it). Only the loss stage needs
        it (one dp x cp all-reduce there)."""
        ctx = self.ctx
        if not ctx.is_last_stage:
            return torch.ones((), device=ctx.device)
        # Counted and kept on the device: no host sync in a step (float32 holds the count exactly up to 2^24
        # target tokens a step, to 6e-8 relative beyond).
        count = torch.stack([(mb["labels"] != IGNORE_INDEX).sum() for mb in micro_batches]).sum().float()
        if ctx.dp_cp > 1:
            dist.all_reduce(count, group=ctx.dp_cp_group)
        groups = ctx.replica_groups
        if groups is not None and groups.every_step:   # the tokens of every live replica group, averaged over them
            groups.sum([count])
            return count.clamp_min(1.0) / (ctx.dp_cp * groups.live)
        return count.clamp_min(1.0) / ctx.dp_cp

    def train(self, micro_batches: list[dict], grad_sync) -> list[torch.Tensor]:
        """Forward and backward of prepared micro-batches (one optimizer step's on this rank), gradients left to
        `grad_sync`; returns the detached per-micro-batch losses on the loss stage, [] elsewhere. Without a pipeline
        the step is plain gradient accumulation, written out below; with one, the engine runs the schedule (and
        marks each action in the heartbeat: the stall diagnosis' evidence of where a pipeline rank waits)."""
        head = TrainingLoss(self.loss_denominator(micro_batches))
        if self.pipelined:
            return self.engine.run(lambda mb, hidden, chunk: self.measured_forward(mb, hidden, chunk, head),
                                   micro_batches, self.activation_shape, torch.float32, grad_sync=grad_sync)
        losses, trace = [], self.engine.trace
        for i, micro_batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1   # the gradients are final after its backward
            with trace.span("forward", mb=i, chunk=0):
                loss = self.measured_forward(micro_batch, None, 0, head)
            losses.append(loss.detach())
            grad_sync.before_backward(0, last)
            with trace.span("backward", mb=i, chunk=0):
                loss.backward()
            grad_sync.after_backward(0, last)
        return losses

    @property
    def pipelined(self) -> bool:
        """Whether the step needs the pipeline engine: several stages, chunks, or backwards split in B and W."""
        engine = self.engine
        return self.ctx.pp > 1 or engine.num_chunks > 1 or engine.splits_backward

    @property
    def max_in_flight(self) -> int:
        """Most micro-batches whose saved tensors were held at once in the last step (1 without a pipeline)."""
        return self.engine.max_in_flight if self.pipelined else 1

    def measured_forward(self, micro_batch: dict, hidden_states, chunk: int, head):
        """`forward`, in MoE's training mode; the first call measures what autograd saves of a micro-batch."""
        moe = self.model.moe_losses
        measure = saved_activation_bytes(self.model.parameters()) if self.saved_bytes is None else None
        with measure or contextlib.nullcontext() as saved, moe.training_forward() if moe else contextlib.nullcontext():
            out = self.forward(micro_batch, hidden_states, chunk, head)
        if saved is not None:
            self.saved_bytes = saved.bytes
        return out

    @torch.no_grad()
    def forward_only(self, micro_batches: list[dict], head) -> list[torch.Tensor]:
        """Every prepared micro-batch forward only, in eval mode; the loss stage's `head` outputs, [] elsewhere."""
        was_training = self.model.training
        self.model.eval()
        try:
            return self.engine.forward_only(lambda mb, hidden, chunk: self.forward(mb, hidden, chunk, head),
                                            micro_batches, self.activation_shape, torch.float32)
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def held_out_loss(self, micro_batches: list[dict]) -> float:
        """Mean loss over every real target token of the held-out `micro_batches` (as the data gives them; forward
        only through the pipeline; padding rows of the last batch count nowhere), summed over the replicas."""
        batches = [self.prepare(mb) for mb in micro_batches]
        sums = self.forward_only(batches, TokenLossSum())
        count = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in batches) if sums else 0
        totals = torch.tensor([float(sum(s.item() for s in sums)), float(count)], dtype=torch.float64,
                              device=self.ctx.device)
        total, tokens = self.replica_sum(totals).tolist()
        return total / tokens

    def replica_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum over the pipeline (only the last stage has losses: this broadcasts them) and dp x cp, in place."""
        if self.ctx.pp > 1:
            dist.all_reduce(values, group=self.ctx.pp_group)
        if self.ctx.dp_cp > 1:
            dist.all_reduce(values, group=self.ctx.dp_cp_group)
        return values


class TrainingLoss:
    """A training micro-batch's share of the step loss: its token-loss sum over the step's denominator."""
    labels = True

    def __init__(self, denominator: torch.Tensor):
        self.denominator = denominator

    def __call__(self, losses, micro_batch):
        return losses.sum() / self.denominator


class TokenLossSum:
    """The held-out loss: a micro-batch's token-loss sum."""
    labels = True

    def __call__(self, losses, micro_batch):
        return losses.sum()
