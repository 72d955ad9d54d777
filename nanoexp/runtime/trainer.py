"""The training loop on every rank: batch -> forward and backward -> gradient sync -> clip -> optimizer -> metrics ->
checkpoint. Each phase is a short method (train_step lists them) and a seam (runtime/seams.py): what watches or
disturbs the loop (heartbeat marks, faults, health/) wraps it at start-up, only when on. Each step's record goes to
the reporter (observe/reporter.py); run.py hands in how the loop hears of stop signals (`StopSignals`)."""
from __future__ import annotations

import logging
import math
import time

import torch

from nanoexp.checkpoint import CheckpointError, CheckpointManager, Progress
from nanoexp.config import batch_accumulation, global_batch_size
from nanoexp.data.loader import eval_batches
from nanoexp.data.stages import StagedBatches
from nanoexp.evaluation.downstream import sharded_downstream
from nanoexp.instruments.memory import start_measuring
from nanoexp.instruments.moe_metrics import moe_step_values
from nanoexp.observe.reporter import StepReporter
from nanoexp.optim.schedule import lr_at, set_lr
from nanoexp.parallel.layout import Layout
from nanoexp.runtime.build import build_runtime
from nanoexp.runtime.optim import clip_gradients
from nanoexp.runtime.seams import StopSignals, agreed_flags

log = logging.getLogger("nanoexp")


class Trainer:
    def __init__(self, cfg, ctx, run_dir: str, peak=None, signals: StopSignals = StopSignals()):
        if ctx.layout != Layout.from_config(cfg):
            raise ValueError(f"the context's layout {ctx.layout} is not the config's {Layout.from_config(cfg)}")
        self.cfg, self.ctx, self.run_dir, self.signals = cfg, ctx, run_dir, signals
        self.is_writer, self.step = ctx.rank == 0, 0   # step: the optimizer step being run
        torch.manual_seed(cfg.general.seed)
        self.checkpoints = CheckpointManager(cfg, ctx, run_dir)
        self.resume = self.checkpoints.where_to_start()   # step and data position; the weights load below
        self.global_batch, self.accumulation = global_batch_size(cfg), batch_accumulation(cfg)
        self.tokens_per_step = self.global_batch * cfg.tokens.sequence_length
        self.start_data()
        baseline_mb = start_measuring(ctx.device, cfg.model.dtype)   # the runtime and the data, before the model
        self.build_model_and_optimizer()
        self.reporter = StepReporter(cfg, ctx, run_dir, self.runtime, baseline_mb, peak)
        self.downstream = sharded_downstream(cfg, self.runner) if cfg.eval.tasks else None

    def start_data(self) -> None:
        """The data (of the stage being trained) and the progress at self.resume (the start, or a rollback's)."""
        r = self.resume
        self.batches = StagedBatches(self.cfg, self.global_batch, *self.data_position(), r.step + 1,
                                     r.consumed_samples, r.stage_consumed_samples,
                                     on_stage_start=lambda stage: self.reporter.announce_stage(stage, self.batches))
        self.progress = Progress(r.consumed_samples, r.consumed_tokens, r.skipped_steps)

    def data_position(self) -> tuple[int, int]:
        """Which share of each global batch this rank reads, of how many: its dp rank of dp."""
        return self.ctx.dp_rank, self.ctx.dp

    def build_model_and_optimizer(self) -> None:
        """This rank's runtime (nanoexp/runtime/build.py), and the checkpoint's state if resuming."""
        self.runtime = runtime = build_runtime(self.cfg, self.ctx, run_dir=self.run_dir)
        self.model, self.runner, self.grad_sync, self.optimizer = (runtime.model, runtime.runner, runtime.grad_sync,
                                                                   runtime.optimizer)
        self.shape, self.trace, self.params = self.model.shape, runtime.trace, list(self.model.parameters())
        self.checkpoints.restore(self.model, self.optimizer)
        self.moe_metrics, self.stop_after_step, self.checkpoint_writing = {}, False, False

    def train_step(self, micro_batches: list[dict], lr: float) -> tuple[float, float]:
        """One optimizer step; returns the loss and the gradient norm, read by the host once (read_scalars)."""
        set_lr(self.optimizer, lr)
        losses = self.forward_backward([self.runner.prepare(mb) for mb in micro_batches])
        self.sync_gradients()
        loss = self.step_loss(losses)
        grad_norm = self.clip_gradients()
        loss, grad_norm = self.read_scalars(loss, grad_norm)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):   # identical on every rank: all take this branch
            return self.skip_step(loss, grad_norm)
        self.optimizer_step()
        return loss, grad_norm

    def forward_backward(self, micro_batches: list[dict]) -> list[torch.Tensor]:
        """Forward and backward of this rank's prepared micro-batches; the loss stage's detached losses."""
        return self.runner.train(micro_batches, self.grad_sync)

    def sync_gradients(self) -> None:
        """Wait for the gradient reductions the backward started: the gradients are final."""
        self.grad_sync.finish()
        self.trace.end_step()   # writes this step's pipeline timeline (logging.pipeline_trace)

    def step_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Mean token loss of the global batch, identical on every rank (on the device)."""
        loss = torch.stack(losses).sum().float() if losses else torch.zeros((), device=self.ctx.device)
        return self.all_reduce_loss(loss).sum() / self.ctx.dp_cp

    def all_reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """This rank's part of the step loss summed over the pipeline and dp x cp (in place)."""
        return self.runner.replica_sum(loss)

    def clip_gradients(self) -> torch.Tensor:
        """The global gradient norm before clipping, on the device; the gradients scaled to optimizer.clip_grad."""
        return clip_gradients(self.grad_sync.norm_inputs(self.params), self.cfg.optimizer.clip_grad, self.ctx.device)

    def read_scalars(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[float, float]:
        """Loss and norm on the host in one read, with the MoE metrics, step_maxima and the ranks' agreed flags."""
        moe, micro_batches = self.model.moe_losses, self.ctx.dp * self.accumulation
        names, moe_values = moe_step_values(moe, self.ctx, micro_batches) if moe else ([], loss.new_zeros(0))
        flags = agreed_flags(self.ctx, [self.signals.requested(), self.checkpoints.writing()], self.step_maxima())
        values = torch.cat([torch.stack([loss, grad_norm.float()]).float(), flags, moe_values.float()]).tolist()
        self.stop_after_step, self.checkpoint_writing = bool(values[2]), bool(values[3])
        self.maxima, self.moe_metrics = values[4:2 + len(flags)], dict(zip(names, values[2 + len(flags):]))
        return values[0], values[1]

    def step_maxima(self) -> torch.Tensor:
        """Values whose maximum over the ranks read_scalars puts in self.maxima: none here (nanoexp/health/'s)."""
        return torch.zeros(0, device=self.ctx.device)

    def skip_step(self, loss: float, grad_norm: float) -> tuple[float, float]:
        """A non-finite loss or gradient norm: no update; the run stops unless optimizer.skip_nonfinite_steps."""
        if not self.cfg.optimizer.skip_nonfinite_steps:
            self.grad_sync.zero_grad()
            error = FloatingPointError(f"non-finite loss {loss} or gradient norm {grad_norm} at step {self.step} "
                                       "(set optimizer.skip_nonfinite_steps=true to skip such steps)")
            raise self.raised_together(error)
        self.drop_update("non-finite loss or gradient")
        return loss, grad_norm

    def drop_update(self, why: str) -> None:
        """No update this step (counted in skipped_steps): its gradients are dropped."""
        self.grad_sync.zero_grad()
        self.progress.skipped_steps += 1
        log.warning("step %d: %s, update skipped", self.step, why)

    def optimizer_step(self) -> None:
        """The update, then the runtime's post-step hooks (model.moe.balance=bias: the routing biases move)."""
        self.optimizer.step()
        for hook in self.runtime.after_step:
            hook()
        self.grad_sync.zero_grad()

    def evaluate(self) -> float:
        """Mean loss over every real target token of the held-out batches (StepRunner.held_out_loss)."""
        t, b = self.cfg.tokens, self.batches
        return self.runner.held_out_loss(eval_batches(b.val_set, self.global_batch, t.micro_batch_size,
                                                      t.limit_val_batches, self.ctx.dp_rank, self.ctx.dp,
                                                      t.sequence_length, b.eod_id))

    def train(self) -> dict:
        """Train from the resumed step to tokens.train_steps; rank 0 writes summary.json (also on an error)."""
        summary = self.reporter.start(self.batches, self.checkpoints.run_id)
        self.signals.training_started()   # a stop signal from here on ends the run after a step, with its checkpoint
        try:
            stopped, self.step = False, self.resume.step
            while self.step < self.cfg.tokens.train_steps and not stopped:   # SIGTERM/SIGUSR2: checkpoint written
                stopped = self.run_step(self.step + 1)   # a rollback (nanoexp/health/) sets self.step back
            self.finish_checkpoint_write("the run ends")   # checkpoint.async_save: the last write
            summary["status"] = "stopped" if stopped else "completed"
            summary.update(self.memory_of_every_rank())
        except Exception as error:
            summary["error"] = f"{type(error).__name__}: {error}"
            raise
        finally:
            self.batches.close()
            self.finish(summary)
        return summary

    def run_step(self, step: int) -> bool:
        """Step `step`: train, record, checkpoint and evaluate when due. True: a stop signal came."""
        start = time.perf_counter()
        micro_batches = self.next_batches(step)
        self.step, lr = step, lr_at(step - self.resume.lr_step_offset, self.cfg)
        loss, grad_norm = self.train_step(micro_batches, lr)
        stage = self.record_step(step, loss, lr, grad_norm, start)
        self.checkpoint_step(step, self.stop_after_step)   # before anything optional: no evaluation can lose it
        if self.stop_after_step and step != self.cfg.tokens.train_steps:
            self.reporter.stopped(step, self.signals.received_name())
            return True
        self.evaluate_when_due(step, stage)
        return False

    def next_batches(self, step: int) -> list[dict]:
        """This rank's micro-batches of step `step` (the next of the data)."""
        return self.batches.next_step()

    def record_step(self, step: int, loss: float, lr: float, grad_norm: float, start: float) -> dict:
        """The step's progress, and its record handed to the reporter; returns its data stage ({} without)."""
        b, p = self.batches, self.progress
        p.consumed_samples, p.stage_consumed_samples = b.consumed_samples, dict(b.stage_consumed_samples)
        p.consumed_tokens += self.tokens_trained()
        stage = {"stage": b.stage.name} if b.named else {}
        record = {**self.step_record(step, loss, lr, grad_norm), **stage, **self.moe_metrics}
        self.reporter.record_step(record, start, first=step == self.resume.step + 1)
        return stage

    def step_record(self, step: int, loss: float, lr: float, grad_norm: float) -> dict:
        """What the step did (the reporter adds what it measured: time, throughput, memory)."""
        p = self.progress
        return {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "consumed_tokens": p.consumed_tokens,
                "data_wait_sec": self.batches.last_wait_sec, "skipped_steps": p.skipped_steps}

    def tokens_trained(self) -> int:
        """Tokens the step just taken trained on: the global batch's."""
        return self.tokens_per_step

    def checkpoint_step(self, step: int, stop: bool) -> None:
        """Publish the background write all ranks finished; save this step when due (waited for at the end/a stop)."""
        if self.checkpoints.written_everywhere(not self.checkpoint_writing):
            self.finish_checkpoint_write()
        last = step == self.cfg.tokens.train_steps
        if self.checkpoints.due(step, last, stop):
            self.save_checkpoint(step, wait=last or stop)
        self.reporter.log_checkpoints(self.checkpoints, self.step)

    def save_checkpoint(self, step: int, wait: bool) -> None:
        """Save step `step` (a collective): in the background under checkpoint.async_save, unless `wait`."""
        self.checkpoints.save(step, self.model, self.optimizer, self.progress, wait=wait)

    def finish_checkpoint_write(self, reason: str | None = None) -> None:
        """A collective: wait for the background write in flight (if any) on every rank, publish and log it."""
        self.checkpoints.finish_write(reason)
        self.reporter.log_checkpoints(self.checkpoints, self.step)

    def raised_together(self, error: Exception) -> Exception:
        """`error`, raised by every rank together once the background write is published (or its failure logged)."""
        try:
            self.finish_checkpoint_write(f"the run stops ({type(error).__name__})")
        except CheckpointError as failed:
            log.error("%s", failed)
        return error

    def evaluate_when_due(self, step: int, stage: dict) -> None:
        """The held-out loss and the downstream tasks, when their intervals (or the end of training) say so."""
        interval, total = self.cfg.tokens.val_check_interval, self.cfg.tokens.train_steps
        if (interval and step % interval == 0) or step == total:
            self.reporter.evaluated(step, self.evaluate(), stage)
        if self.downstream and self.downstream.due(step, total):
            failure = self.downstream.failure(step, self.run_downstream(step))   # eval.on_error
            if failure:
                raise self.raised_together(failure)

    def run_downstream(self, step: int) -> dict[str, str]:
        """The eval.tasks harness tasks on this model, their scores logged; returns the failed tasks' errors."""
        start = time.perf_counter()
        scores, _, errors = self.downstream.run()
        self.reporter.downstream(step, scores, time.perf_counter() - start)
        return errors

    def memory_of_every_rank(self) -> dict:
        """summary.json's memory fields and hosts, from every rank (a collective: call it on all ranks)."""
        return self.reporter.memory_of_every_rank()

    def finish(self, summary: dict) -> None:
        """rank 0 writes summary.json (the reporter's), also when a step raised."""
        self.trace.close()
        self.reporter.finish(summary, self.progress, self.resume, self.batches)
