"""The trainer of one replica group (fault_tolerance=torchft): the loop of trainer.py, with each step started by a
quorum of the live groups and committed only when torchft's Manager says so.

What changes against one world (docs/fault-tolerance.md): this rank reads its share of the global batch among all
R x dp readers, so the data of a step is the same whichever groups are live; the loss and the gradients are
averaged over the live groups (the loss over the tokens they trained, runtime/step.py and parallel/gradient_sync.py);
a step that is not committed (a group died in it) is trained again with the same data; a group that is behind
takes a live peer's weights, optimizer state and progress before its next step (`peer_state`); the lowest live
group writes the checkpoints. Every group keeps its own run folder (metrics.jsonl, logs, summary.json).
"""
from __future__ import annotations

import logging
import zlib

import torch
import torch.distributed as dist

from nanoexp.checkpoint.save import persistent_buffers
from nanoexp.checkpoint.manager import Resume
from nanoexp.parallel.replicas import to_safetensors
from nanoexp.parallel.zero.sharded_optimizer import ShardedOptimizer
from nanoexp.runtime.seams import StopSignals
from nanoexp.runtime.trainer import Trainer

log = logging.getLogger("nanoexp")


class ReplicaTrainer(Trainer):
    def __init__(self, cfg, ctx, run_dir: str, peak=None, signals: StopSignals = StopSignals()):
        super().__init__(cfg, ctx, run_dir, peak, signals)
        ft = cfg.fault_tolerance
        ctx.join_replica_groups(ft, self.resume.step if ft.semi_sync == "none" else 0)   # DiLoCo: syncs, from here
        self.groups = ctx.replica_groups
        self.groups.on_heal(self.peer_state, self.load_peer_state)
        self.diloco = (self.groups.semi_synchronous(self.model, self.optimizer, ft)
                       if ft.semi_sync == "diloco" else None)
        self.pending: tuple[int, list] | None = None   # the data of a step not committed yet
        self.done = self.resume.step   # the last step committed
        self.checkpoints.abandon_after = None   # later checkpoints in the shared folder are other groups'
        self.committed, self.retried_steps, self.heals, self.bytes_recorded = False, 0, 0, 0
        if self.diloco is not None:
            self.start_semi_synchronous()

    def data_position(self) -> tuple[int, int]:
        """Group g's dp rank r reads share g x dp + r of the R x dp shares of each global batch."""
        ft = self.cfg.fault_tolerance
        return ft.group * self.ctx.dp + self.ctx.dp_rank, ft.replica_groups * self.ctx.dp

    def run_step(self, step: int) -> bool:
        """The step after the last committed one, once its quorum is formed (under DiLoCo the quorum comes at each
        sync, inside the optimizer's step): a step not committed is trained again, a group that took a live one's
        state goes on from that one's step. The loop goes on from the last committed step."""
        if self.diloco is None and self.groups.start_step():
            log.info("took a live group's state: going on at step %d", self.done + 1)
        stopped = super().run_step(self.done + 1) if self.done < self.cfg.tokens.train_steps else False
        self.step = self.done
        return stopped

    def start_semi_synchronous(self) -> None:
        """DiLoCo's first quorum: the groups that start together commit it (it counts as a sync, so that a group
        started later is always behind and takes a live one's state); a group that takes a live one's state does so
        in that group's sync, and takes part in it."""
        if self.groups.start_step():
            log.info("took a live group's state: going on at step %d", self.done + 1)
            self.groups.join_sync(self.diloco)
        else:
            self.groups.commit()
        self.diloco._local_step = self.done % self.cfg.fault_tolerance.sync_every   # torchft's count of inner steps

    def next_batches(self, step: int) -> list[dict]:
        """The data of `step`: again the same when the step is trained again."""
        if self.pending is None or self.pending[0] != step:
            if self.batches.step != step:
                raise RuntimeError(f"the data is at step {self.batches.step}, the quorum at step {step}")
            self.pending = (step, self.batches.next_step())
        return self.pending[1]

    def step_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The group's loss, averaged over the live groups: the mean over every token they trained."""
        loss = super().step_loss(losses)
        if self.groups.every_step:
            self.groups.average([loss])
        return loss

    def read_scalars(self, loss, grad_norm) -> tuple[float, float]:
        values = super().read_scalars(loss, grad_norm)
        self.committed = self.diloco is not None or self.groups.commit()   # DiLoCo: each group's own step
        if self.committed:
            self.done = self.step
        else:
            self.retried_steps += 1
            log.warning("step %d not committed (a replica group failed in it): training it again", self.step)
        return values

    def optimizer_step(self) -> None:
        if self.committed:
            super().optimizer_step()
        else:
            self.grad_sync.zero_grad()

    def skip_step(self, loss: float, grad_norm: float) -> tuple[float, float]:
        if self.committed:
            return super().skip_step(loss, grad_norm)
        self.grad_sync.zero_grad()
        return loss, grad_norm

    def tokens_trained(self) -> int:
        return self.tokens_per_step * self.groups.live // self.groups.count

    def record_step(self, step, loss, lr, grad_norm, start) -> dict:
        return super().record_step(step, loss, lr, grad_norm, start) if self.committed else {}

    def step_record(self, *args) -> dict:
        """With the live groups (under DiLoCo, at the last sync) and the payload this rank all-reduced across groups
        in the step (summary.json's fault_tolerance.cross_group_bytes: in the run)."""
        sent, self.bytes_recorded = self.groups.bytes_reduced - self.bytes_recorded, self.groups.bytes_reduced
        return {**super().step_record(*args), "replica_groups_live": self.groups.live, "cross_group_bytes": sent}

    def checkpoint_step(self, step: int, stop: bool) -> None:
        if self.committed:
            super().checkpoint_step(step, stop)

    def save_checkpoint(self, step: int, wait: bool) -> None:
        """The lowest live group writes the checkpoints (the others go on at once)."""
        if self.groups.lowest_live:
            super().save_checkpoint(step, wait)

    def evaluate_when_due(self, step: int, stage: dict) -> None:
        if self.committed:
            super().evaluate_when_due(step, stage)

    # -- healing: this rank's state, for the rank at its place in a group that is behind ---------------------
    def peer_state(self) -> dict:
        """What makes a rank of another group this one: its parameters (ZeRO-3: its shards), buffers, optimizer
        state, and the progress of training (data position, tokens, skipped steps)."""
        held = self.grad_sync.held_as_shards()
        p = self.progress
        return {"parameters": {str(i): param for i, param in enumerate(self.params) if id(param) not in held},
                "shards": {str(i): piece.value for i, piece in enumerate(self.grad_sync.shard_pieces())
                           if id(piece.param) in held},
                "buffers": dict(persistent_buffers(self.model)), "optimizer": optimizer_state(self.optimizer),
                "progress": {"step": self.done, "consumed_samples": p.consumed_samples,
                             "consumed_tokens": p.consumed_tokens, "skipped_steps": p.skipped_steps, "stage_consumed_samples": p.stage_consumed_samples,
                             "lr_step_offset": self.resume.lr_step_offset}}

    @torch.no_grad()
    def load_peer_state(self, state: dict) -> None:
        """Take a live peer's `peer_state` (its step is the Manager's now), and read the data from there."""
        for i, param in enumerate(self.params):
            if str(i) in state["parameters"]:
                param.copy_(state["parameters"][str(i)])
        for i, piece in enumerate(self.grad_sync.shard_pieces()):
            if str(i) in state["shards"]:
                piece.value.copy_(state["shards"][str(i)])
        for name, buffer in persistent_buffers(self.model):
            buffer.copy_(state["buffers"][name])
        load_optimizer_state(self.optimizer, state["optimizer"], self.ctx.device)
        p = state["progress"]
        self.done = p["step"]
        self.committed = False   # under DiLoCo this comes inside a step: the peer's state supersedes it
        self.resume = Resume(p["step"], p["consumed_samples"], p["lr_step_offset"], p["skipped_steps"],
                             p["consumed_tokens"], dict(p.get("stage_consumed_samples", {})))
        self.batches.close()
        self.start_data()   # the data and the progress from the peer's position
        self.pending, self.heals = None, self.heals + 1
        self.checkpoints.last_saved, self.checkpoints.abandon_after = None, None   # the peers' checkpoints stay

    def memory_of_every_rank(self) -> dict:
        """With the memory fields (a collective at the end of training), each rank's digests: CRC-32 of its weights
        and of its whole `peer_state` (with the optimizer state and progress), equal in every group that ended in
        the same state (under DiLoCo each group keeps its own inner optimizer: only the weights agree)."""
        state = self.peer_state()
        weights = {key: state[key] for key in ("parameters", "shards", "buffers")}
        mine = [zlib.crc32(to_safetensors(weights)), zlib.crc32(to_safetensors(state))]
        ranks = [mine] * self.ctx.world_size
        if self.ctx.world_size > 1:
            dist.all_gather_object(ranks, mine)
        return {**super().memory_of_every_rank(), "weights_crc32": [r[0] for r in ranks],
                "state_crc32": [r[1] for r in ranks]}

    def finish(self, summary: dict) -> None:
        trained = self.progress.consumed_tokens // self.cfg.tokens.sequence_length
        summary["fault_tolerance"] = {"replica_group": self.groups.index, "replica_groups": self.groups.count,
                                      "retried_steps": self.retried_steps, "heals": self.heals,
                                      "trained_samples": trained, "cross_group_bytes": self.groups.bytes_reduced}
        try:
            super().finish(summary)
        finally:
            self.groups.close()


def optimizer_state(optimizer) -> dict:
    """The torch optimizer's state by parameter index (ZeRO: of this rank's shard pieces), tensors and numbers."""
    inner = optimizer.inner if isinstance(optimizer, ShardedOptimizer) else optimizer
    params = [p for group in inner.param_groups for p in group["params"]]
    return {str(i): dict(inner.state[p]) for i, p in enumerate(params) if p in inner.state}


def load_optimizer_state(optimizer, state: dict, device) -> None:
    inner = optimizer.inner if isinstance(optimizer, ShardedOptimizer) else optimizer
    params = [p for group in inner.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        if str(i) in state:
            inner.state[p] = {key: value.to(device) if torch.is_tensor(value) else value
                              for key, value in state[str(i)].items()}
        else:
            inner.state.pop(p, None)

