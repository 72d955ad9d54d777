"""The training loop: batch -> forward and backward -> gradient sync -> clip -> optimizer -> metrics -> checkpoint.

The trainer does not know which engine, data source or logger it drives; it asks for a batch, runs a step,
and records what happened. It runs on every rank; only global rank 0 writes the run folder's shared files.
Each phase of a step is a short method (train_step reads as the list of them), and the phases are the loop's seams:
what watches or disturbs the loop wraps them on the instance from outside, installed once at start-up by the entry
point (nanoexp/run.py) and only when it is on — the stall watchdog's heartbeat marks (nanoexp/launch/seams.py), the
robustness tests' faults (nanoexp/launch/fault_injection.py) and the health checks (nanoexp/health/). With all off
the loop runs as written here.
"""
from __future__ import annotations

import logging
import os
import math
import socket
import time

import torch
import torch.distributed as dist

from nanoexp.checkpoint import CheckpointError, CheckpointManager, Progress
from nanoexp.config import batch_accumulation, global_batch_size
from nanoexp.observe.console import StepClock, checkpoint_line, describe_data, memory_line, run_facts, step_line
from nanoexp.data.loader import IGNORE_INDEX, eval_batches, eval_rounds
from nanoexp.data.stages import StagedBatches, stage_spans
from nanoexp.data.tokenizer import build_tokenizer
from nanoexp.evaluation.downstream import task_lines
from nanoexp.failures import KnownFailure
from nanoexp.numerics.precision import flushes_denormals, tf32_enabled
from nanoexp.instruments import timing
from nanoexp.instruments.memory import peak_memory_mb, start_measuring
from nanoexp.observe.metrics import MetricsWriter, flops_per_token, hardware_flops_per_token
from nanoexp.runtime.build import build_runtime
from nanoexp.runtime.recompute import RecomputePolicy
from nanoexp.model.shape import model_shape
from nanoexp.model.llama import count_parameters
from nanoexp.runtime.optim import clip_gradients
from nanoexp.optim.schedule import lr_at, set_lr
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.instruments.trace import NO_TRACE, PipelineTrace
from nanoexp.observe.peak import Peak
from nanoexp.instruments.profiling import StepProfiler
from nanoexp.instruments.moe_metrics import moe_step_values
from nanoexp.model.moe import update_expert_biases
from nanoexp.runtime.step import TokenLossSum
from nanoexp.launch.signals import received_signal_name, stop_flag, training_started
from nanoexp.observe.summary import memory_fields, whole_run, write_summary

log = logging.getLogger("nanoexp")


class Trainer:
    def __init__(self, cfg, ctx: ParallelContext, run_dir: str, peak: Peak | None = None):
        if ctx.layout != Layout.from_config(cfg):
            raise ValueError(f"the context's layout {ctx.layout} is not the config's {Layout.from_config(cfg)}")
        self.cfg, self.ctx, self.run_dir = cfg, ctx, run_dir
        self.is_writer = ctx.rank == 0
        self.step = 0   # the optimizer step being run
        torch.manual_seed(cfg.general.seed)
        self.checkpoints = CheckpointManager(cfg, ctx, run_dir)
        self.resume = self.checkpoints.where_to_start()   # step and data position; the weights load below
        self.global_batch, self.accumulation = global_batch_size(cfg), batch_accumulation(cfg)
        self.start_data()
        self.baseline_mb = start_measuring(ctx.device, cfg.model.dtype)   # the runtime and the data, before the model
        self.build_model_and_optimizer()
        t = cfg.tokens
        self.tokens_per_step = self.global_batch * t.sequence_length
        self.flops_per_step = flops_per_token(self.shape, t.sequence_length) * self.tokens_per_step
        self.hardware_flops_per_step = self.tokens_per_step * hardware_flops_per_token(   # + recomputed forwards
            self.shape, t.sequence_length, RecomputePolicy.from_config(cfg), ctx.cp)
        self.profiler = StepProfiler(cfg.logging.profiler, run_dir, ctx.rank)
        self.peak, self.peak_refuted = peak or Peak(None, "not measured"), False
        self.memory = {}   # see memory_breakdown
        self.writer = MetricsWriter(run_dir, cfg) if self.is_writer else None
        self.downstream = self.downstream_eval() if cfg.eval.tasks else None
        self.downstream_scores: dict[str, float] = {}

    def start_data(self) -> None:
        """The data (of the stage being trained; data_stages switch it by step) and the progress at self.resume:
        the start, or a rollback's checkpoint (nanoexp/health/)."""
        r = self.resume
        self.batches = StagedBatches(self.cfg, self.global_batch, *self.data_position(), r.step + 1,
                                     r.consumed_samples, r.stage_consumed_samples, on_stage_start=self.announce_stage)
        self.progress = Progress(r.consumed_samples, r.consumed_tokens, r.skipped_steps)

    def data_position(self) -> tuple[int, int]:
        """Which share of each global batch this rank reads, of how many: its dp rank of dp."""
        return self.ctx.dp_rank, self.ctx.dp

    def downstream_eval(self):
        """The eval group's harness tasks, on this model as it is sharded (nanoexp/evaluation/)."""
        from nanoexp.evaluation.downstream import DownstreamEval
        from nanoexp.evaluation.scorer import ShardedScorer
        tokenizer = build_tokenizer(self.cfg.tokenizer.tokenizer_name_or_path)
        return DownstreamEval(self.cfg.eval, ShardedScorer(self.runner, tokenizer.eod_id), tokenizer)

    def build_model_and_optimizer(self) -> None:
        """This rank's runtime (nanoexp/runtime/build.py), and the checkpoint's state if resuming."""
        cfg, ctx = self.cfg, self.ctx
        self.shape = model_shape(cfg)
        self.trace = PipelineTrace.for_run(self.run_dir, ctx) if cfg.logging.pipeline_trace else NO_TRACE
        runtime = build_runtime(cfg, ctx, trace=self.trace)
        self.model, self.runner, self.grad_sync, self.optimizer = (runtime.model, runtime.runner, runtime.grad_sync,
                                                                   runtime.optimizer)
        self.params = list(self.model.parameters())
        self.checkpoints.restore(self.model, self.optimizer)
        self.moe_metrics, self.moe_loads, self.stop_after_step, self.checkpoint_writing = {}, None, False, False

    # -- one optimizer step, phase by phase --------------------------------------------------
    def train_step(self, micro_batches: list[dict], lr: float) -> tuple[float, float]:
        """One optimizer step; returns the loss and the gradient norm. The step's scalars (loss, norm, MoE metrics,
        the stop-signal flag) reach the host in one read, the step's only one outside its layers."""
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
        """The step's loss and norm on the host, in one read with the MoE metrics and the flags every rank agrees
        on: a stop signal (every rank stops after the same step), a background checkpoint write to publish
        (once no rank is writing) and step_maxima's values."""
        moe = self.model.moe_losses
        names, moe_values, self.moe_loads = (moe_step_values(moe, self.ctx, self.ctx.dp * self.accumulation) if moe
                                             else ([], loss.new_zeros(0), None))
        flags = stop_flag(self.ctx, self.checkpoints.writing(), maxima=self.step_maxima())   # a collective
        values = torch.cat([torch.stack([loss, grad_norm.float()]).float(), flags, moe_values.float()]).tolist()
        self.stop_after_step, self.checkpoint_writing = bool(values[2]), bool(values[3])
        moe_start = 2 + len(flags)
        self.maxima, self.moe_metrics = values[4:moe_start], dict(zip(names, values[moe_start:]))
        return values[0], values[1]

    def step_maxima(self) -> torch.Tensor:
        """Values each rank adds to read_scalars' all-reduce (their maximum over the ranks lands in self.maxima):
        none here; what watches the loop (nanoexp/health/) wraps this phase to add its own."""
        return torch.zeros(0, device=self.ctx.device)

    def skip_step(self, loss: float, grad_norm: float) -> tuple[float, float]:
        """A non-finite loss or gradient norm: no update; the run stops unless optimizer.skip_nonfinite_steps."""
        if not self.cfg.optimizer.skip_nonfinite_steps:
            self.grad_sync.zero_grad()
            raise self.raised_together(FloatingPointError(
                f"non-finite loss {loss} or gradient norm {grad_norm} at step {self.step} "
                "(set optimizer.skip_nonfinite_steps=true to skip such steps)"))
        self.drop_update("non-finite loss or gradient")
        return loss, grad_norm

    def drop_update(self, why: str) -> None:
        """No update this step (counted in skipped_steps): its gradients are dropped."""
        self.grad_sync.zero_grad()
        self.progress.skipped_steps += 1
        log.warning("step %d: %s, update skipped", self.step, why)

    def optimizer_step(self) -> None:
        self.optimizer.step()
        if self.moe_loads is not None:   # balance=bias: every replica moves its routing bias by the same global loads
            update_expert_biases(self.model, self.moe_loads)
        self.grad_sync.zero_grad()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over every real target token of the held-out batches (forward only through
        the pipeline; padding rows of the last batch count nowhere)."""
        t = self.cfg.tokens
        batches = eval_batches(self.batches.val_set, self.global_batch, t.micro_batch_size, t.limit_val_batches,
                               self.ctx.dp_rank, self.ctx.dp, t.sequence_length, self.batches.eod_id)
        batches = [self.runner.prepare(mb) for mb in batches]
        sums = self.runner.forward_only(batches, TokenLossSum())
        count = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in batches) if sums else 0
        return self.all_reduce_eval_loss(sums, count)

    def all_reduce_eval_loss(self, sums: list[torch.Tensor], count: int) -> float:
        """The held-out loss from this rank's token-loss sums and real target tokens, summed over the replicas."""
        totals = torch.tensor([float(sum(s.item() for s in sums)), float(count)], dtype=torch.float64,
                              device=self.ctx.device)
        total, tokens = self.runner.replica_sum(totals).tolist()
        return total / tokens

    # -- the loop ------------------------------------------------------------------------
    def train(self) -> dict:
        """Train from the resumed step to tokens.train_steps, evaluating and checkpointing when due;
        rank 0 writes summary.json (also when a step raises)."""
        summary = {"status": "failed", "run_id": self.checkpoints.run_id, "world_size": self.ctx.world_size,
                   "layout": self.ctx.layout.name, "tf32": tf32_enabled(self.cfg, self.ctx.device),
                   "denormals_flushed": flushes_denormals(self.cfg, self.ctx.device),
                   "global_batch_size": self.global_batch, "num_parameters": count_parameters(self.shape)}
        self.announce(summary["num_parameters"])
        self.clock, self.step_times, self.last_record, self.eval_loss = StepClock(), [], {}, None
        training_started()   # a stop signal from here on ends the run after a step, with its checkpoint
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
            self.profiler.close()
            self.finish(summary)
        return summary

    def run_step(self, step: int) -> bool:
        """Step `step`: train, record, checkpoint and evaluate when due. True: a stop signal came."""
        start = time.perf_counter()
        micro_batches = self.next_batches(step)
        self.step, lr = step, lr_at(step - self.resume.lr_step_offset, self.cfg)
        loss, grad_norm = self.train_step(micro_batches, lr)
        stage = self.record_step(step, loss, lr, grad_norm, start)
        # The step's checkpoint comes before anything optional, so that no evaluation can lose it.
        stop = self.stop_after_step   # agreed by every rank in train_step
        self.checkpoint_step(step, stop)
        if stop and step != self.cfg.tokens.train_steps:   # each rank's log says whether the signal reached it
            name = received_signal_name()
            log.info("stop signal received: checkpoint saved after step %d, exiting (%s)", step,
                     f"{name} reached this rank" if name else "it reached another rank")
            return True
        self.evaluate_when_due(step, stage)
        return False

    def next_batches(self, step: int) -> list[dict]:
        """This rank's micro-batches of step `step` (the next of the data)."""
        return self.batches.next_step()

    def record_step(self, step: int, loss: float, lr: float, grad_norm: float, start: float) -> dict:
        """The step's progress, time and metrics record (logged when due); returns its data stage ({} without)."""
        self.profiler.step()
        if not self.memory:
            self.memory = self.memory_breakdown()
        self.progress.consumed_samples = self.batches.consumed_samples
        self.progress.stage_consumed_samples = dict(self.batches.stage_consumed_samples)
        self.progress.consumed_tokens += self.tokens_trained()
        timing.synchronize(self.ctx.device)   # the window ends when the device has run the step's last kernel
        step_time = time.perf_counter() - start
        self.clock.record(step_time)
        self.step_times.append(step_time)
        self.last_record = self.step_record(step, loss, lr, grad_norm, step_time, self.batches.last_wait_sec)
        stage = {"stage": self.batches.stage.name} if self.batches.named else {}
        self.last_record.update(**stage, **self.moe_metrics)
        total = self.cfg.tokens.train_steps
        if step == self.resume.step + 1 or step % self.cfg.logging.iteration_step_info_interval == 0 or step == total:
            self.log_record(self.last_record)
        return stage

    def tokens_trained(self) -> int:
        """Tokens the step just taken trained on: the global batch's."""
        return self.tokens_per_step

    def checkpoint_step(self, step: int, stop: bool) -> None:
        """Publish the background write every rank has finished (checkpoint.async_save), then save this step when
        due: in the background, except at the end and at a stop signal (the run waits for those)."""
        if self.checkpoints.written_everywhere(not self.checkpoint_writing):
            self.finish_checkpoint_write()
        last = step == self.cfg.tokens.train_steps
        if self.checkpoints.due(step, last, stop):
            self.save_checkpoint(step, wait=last or stop)
        self.log_checkpoints()

    def save_checkpoint(self, step: int, wait: bool) -> None:
        """Save step `step` (a collective): in the background under checkpoint.async_save, unless `wait`."""
        self.checkpoints.save(step, self.model, self.optimizer, self.progress, wait=wait)

    def finish_checkpoint_write(self, reason: str | None = None) -> None:
        """A collective: wait for the background write in flight (if any) on every rank, publish and log it."""
        self.checkpoints.finish_write(reason)
        self.log_checkpoints()

    def log_checkpoints(self) -> None:
        for record in self.checkpoints.saved():   # those published since the last call
            self.log_record({**record, "checkpoint/published_after_step": self.step})

    def raised_together(self, error: Exception) -> Exception:
        """`error`, which every rank raises here together: the background write is published first (its own
        failure is logged, and `error` raised still)."""
        try:
            self.finish_checkpoint_write(f"the run stops ({type(error).__name__})")
        except CheckpointError as failed:
            log.error("%s", failed)
        return error

    def evaluate_when_due(self, step: int, stage: dict) -> None:
        """The held-out loss and the downstream tasks, when their intervals (or the end of training) say so."""
        interval, total = self.cfg.tokens.val_check_interval, self.cfg.tokens.train_steps
        if (interval and step % interval == 0) or step == total:
            self.eval_loss = self.evaluate()
            self.log_record({"step": step, "eval_loss": self.eval_loss, **stage})
        if self.downstream and self.downstream.due(step, total):
            for task, error in self.run_downstream(step).items():
                message = f"step {step}: downstream task {task} failed: {error}"
                if self.cfg.eval.on_error == "stop":   # the same on every rank
                    raise self.raised_together(
                        KnownFailure(f"{message} (eval.on_error=stop; the step's checkpoint is written)"))
                log.error("%s; training goes on (eval.on_error=stop ends the run instead)", message)

    def run_downstream(self, step: int) -> dict[str, str]:
        """The eval.tasks harness tasks on this model, their scores logged; returns the failed tasks' errors."""
        start = time.perf_counter()
        scores, _, errors = self.downstream.run()
        self.downstream_scores.update(scores)
        self.log_record({"step": step, **scores, "eval/seconds": time.perf_counter() - start})
        return errors

    def step_record(self, step, loss, lr, grad_norm, step_time, data_wait) -> dict:
        tflops = self.flops_per_step / step_time / 1e12
        return {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                "tokens_per_sec": self.tokens_per_step / step_time,
                "consumed_tokens": self.progress.consumed_tokens, "step_time_sec": step_time,
                "data_wait_sec": data_wait, "peak_memory_mb": peak_memory_mb(self.ctx.device),
                "skipped_steps": self.progress.skipped_steps, "model_tflops_per_sec": tflops,
                "hardware_tflops_per_sec": self.hardware_flops_per_step / step_time / 1e12, "mfu": self.mfu(tflops)}

    def mfu(self, tflops: float) -> float | None:
        """Model FLOP/s over the peak; None without a peak, and from the first rate above it on: the machine cannot
        beat its peak, so the peak is wrong (said once in the log), and no MFU of this run is reported after it,
        the summary's included (summary.json says `peak_refuted`)."""
        if not self.peak.tflops or self.peak_refuted:
            return None
        if tflops <= self.peak.tflops:
            return tflops / self.peak.tflops
        if self.is_writer:
            log.warning("the model runs at %.3g TFLOP/s, above the peak of %.3g TFLOP/s (%s): that peak is wrong "
                        "(measured on a busy machine?), so this run reports no MFU from here on, its summary "
                        "included; set logging.peak_tflops", tflops, self.peak.tflops, self.peak.source)
        self.peak_refuted = True
        return None

    def log_record(self, record: dict) -> None:
        if not self.is_writer:
            return
        self.writer.write(record)
        if "eval_loss" in record:
            log.info("step %d/%d | eval_loss %.4f", record["step"], self.cfg.tokens.train_steps, record["eval_loss"])
        elif "checkpoint/stall_sec" in record:
            log.info(checkpoint_line(record, self.checkpoints.root))
        elif "eval/seconds" in record:   # downstream tasks: one line each
            for line in task_lines({k: v for k, v in record.items() if k.count("/") == 2}):
                log.info("step %d/%d | %s", record["step"], self.cfg.tokens.train_steps, line)
        else:
            log.info(step_line(record, self.cfg.tokens.train_steps, self.clock))

    # -- what rank 0 reports -------------------------------------------------------------
    def memory_breakdown(self) -> dict:
        """This rank's memory by kind (MB), counted from the tensors after the first step, and rank 0
        logs it: parameters and gradients (the flat buffers), optimizer state, and the activations
        of one micro-batch (measured on the first forward) times those the engine held at once."""
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        parameter_bytes, gradient_bytes = self.grad_sync.buffer_bytes()
        per_micro_batch, in_flight = (self.runner.saved_bytes or 0) / 2**20, self.runner.max_in_flight
        memory = {"parameters_mb": parameter_bytes / 2**20, "gradients_mb": gradient_bytes / 2**20,
                  "optimizer_mb": sum(t.numel() * t.element_size() for t in state) / 2**20,
                  "activations_mb": per_micro_batch * in_flight, "activations_per_micro_batch_mb": per_micro_batch,
                  "micro_batches_in_flight": in_flight}
        if self.is_writer:
            log.info(memory_line(memory, self.baseline_mb, peak_memory_mb(self.ctx.device)))
        return memory

    def memory_of_every_rank(self) -> dict:
        """summary.json's memory fields and hosts, from every rank (a collective: call it on all ranks)."""
        mine = {"peak": peak_memory_mb(self.ctx.device), "baseline": self.baseline_mb, "memory": self.memory,
                "host": socket.gethostname()}
        ranks = [mine] * self.ctx.world_size
        if self.ctx.world_size > 1:
            dist.all_gather_object(ranks, mine)
        return memory_fields(ranks)

    def announce(self, num_parameters: int) -> None:
        """Rank 0 logs what this run is: which model, layout, batch, data and peak."""
        if not self.is_writer:
            return
        stage, stages = self.batches.stage, self.batches.stages
        named = f"stage {stage.name!r} of {len(stages)}, from step {stage.start_step}: " if self.batches.named else ""
        for line in run_facts(self.cfg, self.ctx.layout, self.shape, num_parameters, self.accumulation,
                              named + self.describe_data(), self.peak, len(self.model.converted_linears),
                              tf32_enabled(self.cfg, self.ctx.device), flushes_denormals(self.cfg, self.ctx.device),
                              self.ctx.device,
                              int(os.environ.get("LOCAL_WORLD_SIZE", self.ctx.world_size))):
            log.info(line)

    def announce_stage(self, stage) -> None:
        if self.is_writer:
            log.info("data stage %r starts at step %d: %s", stage.name, self.batches.step, self.describe_data())

    def describe_data(self) -> str:
        t, train_set, val_set = self.cfg.tokens, self.batches.train_set, self.batches.val_set
        try:
            train_samples = len(train_set)
        except TypeError:   # a stream has no length
            train_samples = None
        return describe_data(self.batches.stage.cfg.data.name, train_samples, t.sequence_length, len(val_set),
                             eval_rounds(len(val_set), self.global_batch, t.limit_val_batches), self.global_batch)

    def finish(self, summary: dict) -> None:
        timed = self.step_times[2:] or self.step_times
        record, seconds = self.last_record, sum(timed) / len(timed) if timed else None
        summary.update(self.downstream_scores)
        mfu = self.mfu(self.flops_per_step / seconds / 1e12) if seconds else None   # of the mean below
        first, last = self.resume.step + 1, record.get("step", self.resume.step)
        summary.update(final_loss=record.get("loss"), eval_loss=self.eval_loss, train_steps=last,
                       tokens_per_sec=self.tokens_per_step / seconds if seconds else None,   # after the first two
                       tokens_per_sec_steps=[last - len(timed) + 1, last] if timed else None,
                       consumed_tokens=self.progress.consumed_tokens, mfu=mfu, peak_refuted=self.peak_refuted,
                       peak_tflops=self.peak.tflops, peak_source=self.peak.source)
        leg = {"steps": [first, last], "wall_seconds": self.clock.elapsed(),
               "tokens": self.progress.consumed_tokens - self.resume.consumed_tokens,
               "tokens_per_sec": summary["tokens_per_sec"]}
        summary.setdefault("peak_memory_mb", peak_memory_mb(self.ctx.device))   # this rank's, after a failure
        if self.batches.named:
            summary["stages"] = stage_spans(self.batches.stages, summary["train_steps"])
        self.trace.close()
        if self.is_writer:
            write_summary(self.run_dir, whole_run(self.run_dir, summary, leg, resumed=self.resume.step > 0))
            self.writer.close()
