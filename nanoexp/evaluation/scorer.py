"""Scoring token rows with the model as it is sharded, in any layout: what downstream evaluation asks of a model.

A row is a sequence of at most `tokens.sequence_length` input ids and, at the positions to score, the target
id (IGNORE_INDEX elsewhere). `ShardedScorer.score(rows)` returns, for every row and on every rank:
    logprob      the sum of log p(target) over the scored positions (a continuation's log-likelihood)
    mismatches   how many scored positions' greedy (argmax) token is not the target (0: greedy would produce it)
    argmax       the sum of the greedy tokens at the scored positions (one scored position: the greedy next token)
Every rank takes part. The dp replicas split the rows (each takes a contiguous block, padded with empty rows);
each block goes through the pipeline in micro-batches of `tokens.micro_batch_size` rows of `sequence_length`
tokens (right-padded: causal attention keeps the padding out of every real position), cut into zig-zag parts
under cp as training does. The last stage turns its logits into per-row sums: the log-probabilities come from
the vocab-parallel cross-entropy and the argmax from each tp rank's shard (max over tp, the lowest index among
equal maxima, as torch's argmax), so no rank holds full-vocabulary logits. The sums are then added over cp (each
rank holds part of the positions), sent from the last stage to the others (a sum over pp), and gathered over dp.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanoexp.data.loader import IGNORE_INDEX
from nanoexp.parallel.collectives import all_gather_into

SCORES = ("logprob", "mismatches", "argmax")


@dataclass
class Row:
    input_ids: list[int]
    labels: list[int]   # the target at each position, IGNORE_INDEX where not scored


class ShardedScorer:
    """Scores rows with a step runner's model shard (nanoexp/runtime/step.py), padding with `pad_id`."""

    def __init__(self, runner, pad_id: int):
        self.runner, self.ctx, self.pad_id = runner, runner.ctx, pad_id
        self.micro_batch_size, self.sequence_length = runner.micro_batch_size, runner.sequence_length

    @torch.no_grad()
    def score(self, rows: list[Row]) -> torch.Tensor:
        """[len(rows), 3] float64 on the CPU, columns SCORES, identical on every rank."""
        ctx = self.ctx
        per_rank, micro_batches = self.layout_rows(len(rows))
        mine = rows[ctx.dp_rank * per_rank:(ctx.dp_rank + 1) * per_rank]
        batches = [self.runner.prepare(self.micro_batch(mine[i:i + self.micro_batch_size]))
                   for i in range(0, micro_batches * self.micro_batch_size, self.micro_batch_size)]
        out = self.runner.forward_only(batches, RowScores(self.runner.model, ctx))
        scores = (torch.cat(out) if out else
                  torch.zeros(micro_batches * self.micro_batch_size, len(SCORES), dtype=torch.float64,
                              device=ctx.device))
        for group, size in ((ctx.cp_group, ctx.cp), (ctx.pp_group, ctx.pp)):   # positions over cp, stages over pp
            if size > 1:
                dist.all_reduce(scores, group=group)
        if ctx.dp > 1:   # in dp rank order, each rank's block of per_rank rows (then its padding rows)
            gathered = torch.empty((ctx.dp * scores.shape[0], scores.shape[1]), dtype=scores.dtype,
                                   device=scores.device)
            all_gather_into(gathered, scores, ctx.dp_group)
            scores = gathered.view(ctx.dp, -1, scores.shape[1])[:, :per_rank].flatten(0, 1)
        return scores[:len(rows)].cpu()

    def layout_rows(self, count: int) -> tuple[int, int]:
        """(rows each dp rank takes, micro-batches that makes: forward only, any schedule runs any number)."""
        per_rank = -(-count // self.ctx.dp)
        return per_rank, max(1, -(-per_rank // self.micro_batch_size))

    def micro_batch(self, rows: list[Row]) -> dict:
        """[micro_batch_size, sequence_length] ids and labels (padding: empty rows, ids past a row's end)."""
        shape = (self.micro_batch_size, self.sequence_length)
        ids, labels = torch.full(shape, self.pad_id), torch.full(shape, IGNORE_INDEX)
        for i, row in enumerate(rows):
            if len(row.input_ids) > self.sequence_length:
                raise ValueError(f"a row of {len(row.input_ids)} tokens is longer than tokens.sequence_length="
                                 f"{self.sequence_length}")
            ids[i, :len(row.input_ids)] = torch.tensor(row.input_ids)
            labels[i, :len(row.labels)] = torch.tensor(row.labels)
        return {"input_ids": ids, "labels": labels}


class RowScores:
    """The loss stage's head for scoring: the logits' row sums (`row_scores`)."""
    labels = False   # the model returns its logits

    def __init__(self, model, ctx):
        self.model, self.ctx = model, ctx

    def __call__(self, logits, micro_batch):
        return row_scores(logits.float(), micro_batch["labels"], self.model.cross_entropy, self.ctx)


def row_scores(logits: torch.Tensor, labels: torch.Tensor, cross_entropy, ctx) -> torch.Tensor:
    """[b, 3] float64 sums over this rank's scored positions of `logits` [b, s, V/tp] (module docstring);
    `cross_entropy`: the model's loss of its logits (vocab-parallel under tp)."""
    scored = labels != IGNORE_INDEX
    logprob = -cross_entropy(logits, labels)   # 0 where not scored
    local_max, local_argmax = logits.max(dim=-1)
    if ctx.tp > 1:   # the argmax over the vocabulary shards: the lowest index holding the largest value
        best = local_max.clone()
        dist.all_reduce(best, op=dist.ReduceOp.MAX, group=ctx.tp_group)
        shard = logits.shape[-1]
        candidate = torch.where(local_max == best, local_argmax + ctx.tp_rank * shard,
                                torch.full_like(local_argmax, shard * ctx.tp))
        dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=ctx.tp_group)
        local_argmax = candidate
    return torch.stack([logprob.double().masked_fill(~scored, 0).sum(1),
                        (scored & (local_argmax != labels)).sum(1).double(),
                        (local_argmax * scored).sum(1).double()], dim=1)
