"""What a run reports as it trains: the console's lines, metrics.jsonl (with TensorBoard and W&B) and summary.json.

The trainer hands `StepReporter` each step's record (what the step did: loss, learning rate, norm, progress); the
reporter adds what it measures (the step's time, throughput, model and hardware FLOP/s, MFU against the peak, peak
memory) and logs it when due. It also announces the run, logs the held-out and downstream scores and the published
checkpoints, and at the end writes summary.json. Every rank keeps its own times and memory (summary.json gathers
them); only global rank 0 logs and writes.
"""
from __future__ import annotations

import logging
import os
import socket
import time

import torch
import torch.distributed as dist

from nanoexp.config import batch_accumulation, global_batch_size
from nanoexp.data.loader import eval_rounds
from nanoexp.data.stages import stage_spans
from nanoexp.evaluation.downstream import task_lines
from nanoexp.instruments import timing
from nanoexp.instruments.memory import peak_memory_mb
from nanoexp.instruments.profiling import StepProfiler
from nanoexp.model.llama import count_parameters
from nanoexp.numerics.precision import flushes_denormals, tf32_enabled
from nanoexp.observe.console import StepClock, checkpoint_line, describe_data, memory_line, run_facts, step_line
from nanoexp.observe.metrics import MetricsWriter, flops_per_token, hardware_flops_per_token
from nanoexp.observe.peak import Peak
from nanoexp.observe.summary import memory_fields, whole_run, write_summary
from nanoexp.runtime.recompute import RecomputePolicy

log = logging.getLogger("nanoexp")


class StepReporter:
    """The reports of one rank's run of `runtime` (nanoexp/runtime/build.py), from a memory baseline of
    `baseline_mb` (the process before the model) against `peak`."""

    def __init__(self, cfg, ctx, run_dir: str, runtime, baseline_mb: float, peak: Peak | None = None):
        self.cfg, self.ctx, self.run_dir, self.runtime = cfg, ctx, run_dir, runtime
        self.is_writer, self.total = ctx.rank == 0, cfg.tokens.train_steps
        self.shape, t = runtime.model.shape, cfg.tokens
        self.global_batch = global_batch_size(cfg)
        self.tokens_per_step = self.global_batch * t.sequence_length
        self.flops_per_step = flops_per_token(self.shape, t.sequence_length) * self.tokens_per_step
        self.hardware_flops_per_step = self.tokens_per_step * hardware_flops_per_token(   # + recomputed forwards
            self.shape, t.sequence_length, RecomputePolicy.from_config(cfg), ctx.cp)
        self.profiler = StepProfiler(cfg.logging.profiler, run_dir, ctx.rank)
        self.peak, self.peak_refuted = peak or Peak(None, "not measured"), False
        self.baseline_mb, self.memory = baseline_mb, {}   # see memory_breakdown
        self.writer = MetricsWriter(run_dir, cfg) if self.is_writer else None
        self.step_times, self.last_record, self.eval_loss = [], {}, None
        self.downstream_scores: dict[str, float] = {}

    def start(self, batches, run_id: str) -> dict:
        """Announce the run (rank 0) and start its clock; returns summary.json's first fields (status failed until
        the loop ends)."""
        tf32, denormals = tf32_enabled(self.cfg, self.ctx.device), flushes_denormals(self.cfg, self.ctx.device)
        summary = {"status": "failed", "run_id": run_id, "world_size": self.ctx.world_size,
                   "layout": self.ctx.layout.name, "tf32": tf32, "denormals_flushed": denormals,
                   "global_batch_size": self.global_batch, "num_parameters": count_parameters(self.shape)}
        if self.is_writer:
            stage, named = batches.stage, batches.named
            where = f"stage {stage.name!r} of {len(batches.stages)}, from step {stage.start_step}: " if named else ""
            for line in run_facts(self.cfg, self.ctx.layout, self.shape, summary["num_parameters"],
                                  batch_accumulation(self.cfg), where + self.describe_data(batches), self.peak,
                                  len(self.runtime.model.converted_linears), tf32, denormals, self.ctx.device,
                                  int(os.environ.get("LOCAL_WORLD_SIZE", self.ctx.world_size))):
                log.info(line)
        self.clock = StepClock()
        return summary

    def announce_stage(self, stage, batches) -> None:
        if self.is_writer:
            log.info("data stage %r starts at step %d: %s", stage.name, batches.step, self.describe_data(batches))

    def describe_data(self, batches) -> str:
        t, train_set, val_set = self.cfg.tokens, batches.train_set, batches.val_set
        try:
            train_samples = len(train_set)
        except TypeError:   # a stream has no length
            train_samples = None
        return describe_data(batches.stage.cfg.data.name, train_samples, t.sequence_length, len(val_set),
                             eval_rounds(len(val_set), self.global_batch, t.limit_val_batches), self.global_batch)

    # -- each step ---------------------------------------------------------------------------
    def record_step(self, record: dict, start: float, first: bool) -> None:
        """Step `record["step"]` ended (started at perf_counter `start`): its record with what it measured, logged
        on the `first` of this start, every logging.iteration_step_info_interval-th and the last step."""
        self.profiler.step()
        if not self.memory:
            self.memory = self.memory_breakdown()
        timing.synchronize(self.ctx.device)   # the window ends when the device has run the step's last kernel
        seconds = time.perf_counter() - start
        self.clock.record(seconds)
        self.step_times.append(seconds)
        tflops = self.flops_per_step / seconds / 1e12
        self.last_record = {**record, "tokens_per_sec": self.tokens_per_step / seconds, "step_time_sec": seconds,
                            "peak_memory_mb": peak_memory_mb(self.ctx.device), "model_tflops_per_sec": tflops,
                            "hardware_tflops_per_sec": self.hardware_flops_per_step / seconds / 1e12,
                            "mfu": self.mfu(tflops)}
        step = record["step"]
        if first or step % self.cfg.logging.iteration_step_info_interval == 0 or step == self.total:
            self.log(self.last_record)

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

    def evaluated(self, step: int, eval_loss: float, stage: dict) -> None:
        self.eval_loss = eval_loss
        self.log({"step": step, "eval_loss": eval_loss, **stage})

    def downstream(self, step: int, scores: dict[str, float], seconds: float) -> None:
        self.downstream_scores.update(scores)
        self.log({"step": step, **scores, "eval/seconds": seconds})

    def stopped(self, step: int, signal: str | None) -> None:
        """A stop signal ends the run after `step` (logged on every rank: whether the signal reached it)."""
        log.info("stop signal received: checkpoint saved after step %d, exiting (%s)", step,
                 f"{signal} reached this rank" if signal else "it reached another rank")

    def log_checkpoints(self, checkpoints, step: int) -> None:
        """The checkpoints published since the last call, after step `step`."""
        for record in checkpoints.saved():
            self.log({**record, "checkpoint/published_after_step": step}, checkpoints.root)

    def log(self, record: dict, checkpoints_root: str = "") -> None:
        """Rank 0 writes `record` into metrics.jsonl and logs it: a step, a held-out loss, a checkpoint or the
        downstream tasks (one line each)."""
        if not self.is_writer:
            return
        self.writer.write(record)
        if "eval_loss" in record:
            log.info("step %d/%d | eval_loss %.4f", record["step"], self.total, record["eval_loss"])
        elif "checkpoint/stall_sec" in record:
            log.info(checkpoint_line(record, checkpoints_root))
        elif "eval/seconds" in record:
            for line in task_lines({k: v for k, v in record.items() if k.count("/") == 2}):
                log.info("step %d/%d | %s", record["step"], self.total, line)
        else:
            log.info(step_line(record, self.total, self.clock))

    # -- memory ------------------------------------------------------------------------------
    def memory_breakdown(self) -> dict:
        """This rank's memory by kind (MB), counted from the tensors after the first step, and rank 0
        logs it: parameters and gradients (the flat buffers), optimizer state, and the activations
        of one micro-batch (measured on the first forward) times those the engine held at once."""
        r = self.runtime
        state = [t for s in r.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        parameter_bytes, gradient_bytes = r.grad_sync.buffer_bytes()
        per_micro_batch, in_flight = (r.runner.saved_bytes or 0) / 2**20, r.runner.max_in_flight
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

    # -- the end -----------------------------------------------------------------------------
    def finish(self, summary: dict, progress, resume, batches) -> None:
        """summary.json (rank 0): `summary` with the run's results, throughput after the first two steps, and this
        leg (one start of the run, from `resume`) among the run's legs."""
        self.profiler.close()
        timed = self.step_times[2:] or self.step_times
        record, seconds = self.last_record, sum(timed) / len(timed) if timed else None
        summary.update(self.downstream_scores)
        mfu = self.mfu(self.flops_per_step / seconds / 1e12) if seconds else None   # of the mean below
        first, last = resume.step + 1, record.get("step", resume.step)
        summary.update(final_loss=record.get("loss"), eval_loss=self.eval_loss, train_steps=last,
                       tokens_per_sec=self.tokens_per_step / seconds if seconds else None,   # after the first two
                       tokens_per_sec_steps=[last - len(timed) + 1, last] if timed else None,
                       consumed_tokens=progress.consumed_tokens, mfu=mfu, peak_refuted=self.peak_refuted,
                       peak_tflops=self.peak.tflops, peak_source=self.peak.source)
        leg = {"steps": [first, last], "wall_seconds": self.clock.elapsed(),
               "tokens": progress.consumed_tokens - resume.consumed_tokens, "tokens_per_sec": summary["tokens_per_sec"]}
        summary.setdefault("peak_memory_mb", peak_memory_mb(self.ctx.device))   # this rank's, after a failure
        if batches.named:
            summary["stages"] = stage_spans(batches.stages, summary["train_steps"])
        if self.is_writer:
            write_summary(self.run_dir, whole_run(self.run_dir, summary, leg, resumed=resume.step > 0))
            self.writer.close()
