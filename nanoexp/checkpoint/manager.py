"""What the trainer calls: where checkpoints live, what to resume from, when to save.

    checkpoints = CheckpointManager(cfg, ctx, run_dir)   # reads latest.txt once (rank 0, for every rank)
    resume = checkpoints.where_to_start()   # -> Resume(step, consumed_samples, lr_step_offset, ...), from meta.json
    checkpoints.restore(model, optimizer)   # its weights, optimizer state and RNG, from the same checkpoint
    ... after each optimizer step:
    if checkpoints.written_everywhere(nobody_writing): checkpoints.finish_write()   # an asynchronous save
    if checkpoints.due(step, is_last, stop): checkpoints.save(step, model, optimizer, progress)
    ... at the end, a stop signal or a failure every rank raises: checkpoints.finish_write()

Where a run starts: its own checkpoint (latest.txt under checkpoint.checkpoints_path) if there is
one, else checkpoint.resume_checkpoint_path (a seed for the first start only: a warm start), else step 1.
Its own checkpoint must be of this run: the same training keys (nanoexp/checkpoint/identity.py).
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field

import torch.distributed as dist
from omegaconf import OmegaConf

from nanoexp.checkpoint.async_save import HostCopies, InFlight, finish_save, start_save
from nanoexp.checkpoint.identity import new_run_id, run_record, training_differences
from nanoexp.checkpoint.load import CheckpointReader, check_compatible, load_model, load_optimizer, load_rng
from nanoexp.checkpoint.save import CheckpointError, complete_steps, save_checkpoint
from nanoexp.config import ConfigError, global_batch_size
from nanoexp.model.shape import model_shape
from nanoexp.model.llama import count_parameters

log = logging.getLogger("nanoexp")


@dataclass
class Resume:
    step: int = 0                 # completed optimizer steps: training continues at step + 1
    consumed_samples: int = 0     # the data position
    lr_step_offset: int = 0       # subtracted from the step for the LR schedule (load_lr_scheduler=false)
    skipped_steps: int = 0        # updates skipped as non-finite before the checkpoint
    consumed_tokens: int = 0      # tokens trained on before the checkpoint (counted, not derived)
    stage_consumed_samples: dict = field(default_factory=dict)   # data_stages: each stage's own data position


@dataclass
class Start:
    """Where a run starts and why: `folder` (None: step 1), `origin` said in the log, `own`: the run's own latest
    checkpoint (an automatic resume), not a seed."""
    folder: str | None
    origin: str
    own: bool = False


@dataclass
class Progress:
    """How far training has come, as checkpoints record it (the trainer keeps it current)."""
    consumed_samples: int = 0
    consumed_tokens: int = 0
    skipped_steps: int = 0
    stage_consumed_samples: dict = field(default_factory=dict)   # {stage name: its consumed samples}


def latest_checkpoint(root: str) -> str | None:
    """The checkpoint this run's timeline continues from: the folder `latest.txt` names (a rollback is
    an edit of that file). Without latest.txt (a crash between the first rename and its write) the
    newest complete folder. None when `root` holds no checkpoint. Raises CheckpointError when
    latest.txt names a folder that is not a complete checkpoint."""
    steps = complete_steps(root)
    latest = os.path.join(root, "latest.txt")
    if not os.path.isfile(latest):
        return os.path.join(root, str(steps[-1])) if steps else None
    with open(latest) as f:
        name = f.read().strip()
    if not (name.isdigit() and int(name) in steps):
        raise CheckpointError(f"{latest} names {name!r}, which is not a complete checkpoint in {root} "
                              f"(complete steps: {steps or 'none'}): write one of them into latest.txt")
    return os.path.join(root, str(int(name)))   # a step number: "04" is step 4


def inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def checkpoints_root(cfg, run_dir: str) -> str:
    return cfg.checkpoint.checkpoints_path or os.path.join(run_dir, "checkpoints")


def checkpoint_bytes(cfg) -> int:
    """About one checkpoint's size: float32 weights and AdamW's two moments."""
    return 3 * 4 * count_parameters(model_shape(cfg))


def check_checkpoint_folder(cfg, run_dir: str) -> None:
    """Before any work: the checkpoints folder is a folder (or can be made), writable, with room for one
    checkpoint; a ConfigError naming checkpoint.checkpoints_path otherwise."""
    root = checkpoints_root(cfg, run_dir)
    key = f"checkpoint.checkpoints_path={root}"
    existing = root
    while not os.path.exists(existing):
        existing = os.path.dirname(os.path.abspath(existing))
    if not os.path.isdir(existing):
        raise ConfigError(f"{key}: {existing} is a file, not a folder: give a folder for the checkpoints")
    probe = os.path.join(existing, f".nanoexp-write-test-{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as error:
        raise ConfigError(f"{key}: cannot write into {existing} ({error.strerror}): give a writable folder") from None
    free, needed = shutil.disk_usage(existing).free, checkpoint_bytes(cfg)
    if free < needed:
        raise ConfigError(f"{key}: {free / 2**30:.2f} GiB free on its file system, one checkpoint of this model "
                          f"takes about {needed / 2**30:.2f} GiB (float32 weights and AdamW state): free space or "
                          "point checkpoint.checkpoints_path elsewhere")


def check_resume(cfg, run_dir: str) -> str | None:
    """Before any work: the checkpoint this run would resume from is whole (meta.json readable, every shard there
    with its size), is this run's when it is its own (the same training keys), fits the model, and leaves steps to
    train; the seed path is not one of this run's own checkpoints. Each failure a CheckpointError naming the file,
    the keys or the parameter that differ, or the step. Returns the line that says the run is complete when its own
    checkpoint is at tokens.train_steps (nothing to train), else None."""
    manager = CheckpointManager(cfg, None, run_dir)
    seed = cfg.checkpoint.resume_checkpoint_path
    if seed and inside(seed, manager.root):
        raise CheckpointError(
            f"checkpoint.resume_checkpoint_path={seed} is inside this run's own checkpoints folder "
            f"{manager.root}, which the run resumes from by itself (checkpoint.resume=auto follows its "
            f"latest.txt): to roll back, write the step into {os.path.join(manager.root, 'latest.txt')} "
            "and drop checkpoint.resume_checkpoint_path")
    start = manager.start
    if start.folder is None:
        return None
    reader = CheckpointReader(start.folder)
    reader.check_files()
    if start.own:
        check_same_run(reader, cfg)
    check_compatible(reader, model_shape(cfg), cfg.model, cfg.checkpoint.load_strict)
    return steps_left(reader, cfg, start, run_dir)


def check_same_run(reader: CheckpointReader, cfg) -> None:
    """A run resumes by itself only from a checkpoint of the same training (identity.py): else a CheckpointError
    naming the keys that differ and the run that saved it."""
    differ = training_differences(reader.meta["config"], cfg)
    if not differ:
        return
    run = run_record(reader.meta)
    whose = f"run {run.get('id')} in {run.get('folder')}" if run else "a run of an earlier nanoexp"
    shown = "; ".join(differ[:4]) + (f"; and {len(differ) - 4} more" if len(differ) > 4 else "")
    raise CheckpointError(
        f"{reader.folder}, the latest checkpoint in this run's checkpoints folder, belongs to another run ({whose}): "
        f"{shown}. Give this run its own checkpoint.checkpoints_path, or start from that checkpoint on purpose "
        f"with checkpoint.resume_checkpoint_path={reader.folder} and another checkpoint.checkpoints_path "
        "(a warm start)")


def steps_left(reader: CheckpointReader, cfg, start: Start, run_dir: str) -> str | None:
    """None when there are steps to train from the checkpoint; the line saying the run is complete when its own
    checkpoint is at tokens.train_steps; a CheckpointError when it is past it, or a seed at it or past it."""
    step, total = reader.meta["step"], cfg.tokens.train_steps
    if step < total:
        return None
    if not start.own:
        raise CheckpointError(f"checkpoint.resume_checkpoint_path={reader.folder} is at step {step}: "
                              f"tokens.train_steps={total} leaves nothing to train; give more than {step}")
    if step > total:
        latest = os.path.join(os.path.dirname(reader.folder), "latest.txt")
        raise CheckpointError(f"{reader.folder}, this run's latest checkpoint, is at step {step}, past "
                              f"tokens.train_steps={total}: give tokens.train_steps={step} or more (more continues "
                              f"the run), or roll back by writing an earlier step into {latest}")
    saved_in = run_record(reader.meta).get("folder")
    results = ("" if not saved_in or os.path.realpath(saved_in) == os.path.realpath(run_dir)
               else f"; it was saved by the run in {saved_in}, whose summary.json holds the results")
    return (f"the run is complete: its latest checkpoint {reader.folder} is at tokens.train_steps={total}, so "
            f"nothing is trained and summary.json, metrics and checkpoints stay as they are{results} "
            "(a larger tokens.train_steps continues it)")


class CheckpointManager:
    def __init__(self, cfg, ctx, run_dir: str):
        self.cfg, self.ctx, self.run_dir = cfg, ctx, run_dir
        self.root = checkpoints_root(cfg, run_dir)
        # Where this run starts, and why: rank 0's reading is every rank's, so that step, data position, weights
        # and optimizer state all come from one checkpoint (each rank reads too, so that a damaged folder fails
        # on all of them together). The run id goes on from the run's own checkpoint; a fresh or warm start is
        # a new run.
        start = self.resume_folder()
        own_id = run_record(CheckpointReader(start.folder).meta).get("id") if start.own else None
        box = [start, own_id or new_run_id()]
        if ctx is not None and ctx.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        self.start, self.run_id = box
        self.last_saved = None
        self.in_flight: InFlight | None = None   # the checkpoint being written in the background
        self.copies, self.records = HostCopies(), []
        # Checkpoints of this folder after the step this run started from belong to an abandoned
        # timeline (a rollback, or resume=never): the first save moves them to abandoned/.
        self.abandon_after: int | None = 0

    def resume_folder(self) -> Start:
        """Where this run starts and why: its own latest checkpoint (resume=auto), else the seed
        `checkpoint.resume_checkpoint_path` (a warm start), else nowhere (a fresh start)."""
        c = self.cfg.checkpoint
        own = latest_checkpoint(self.root) if c.resume == "auto" else None
        if own is not None:
            return Start(own, f"this run's own latest checkpoint ({os.path.join(self.root, 'latest.txt')})", True)
        if c.resume_checkpoint_path:
            return Start(c.resume_checkpoint_path, "checkpoint.resume_checkpoint_path, a warm start (this run has no "
                         "checkpoint yet)")
        return Start(None, f"no checkpoint in {self.root}" if c.resume == "auto" else "checkpoint.resume=never")

    def where_to_start(self) -> Resume:
        """The step and data position this run continues from, read from the checkpoint's meta.json
        alone (before any model exists: the data can be built first)."""
        if self.start.folder is None:
            return Resume()
        meta, reload_lr = CheckpointReader(self.start.folder).meta, self.cfg.checkpoint.load_lr_scheduler
        return Resume(meta["step"], meta["consumed_samples"], 0 if reload_lr else meta["step"],
                      meta.get("skipped_steps", 0), meta.get("consumed_tokens", 0),
                      meta.get("stage_consumed_samples", {}))

    def restore(self, model, optimizer) -> None:
        """Load the checkpoint to resume from (if any) into this rank's model and optimizer."""
        folder, origin = self.start.folder, self.start.origin
        if folder is None:
            log.info("%s: starting from step 1 as run %s", origin, self.run_id)
            return
        c, ctx = self.cfg.checkpoint, self.ctx
        reader = CheckpointReader(folder)
        unfit, extra = check_compatible(reader, model.shape, self.cfg.model, c.load_strict)
        if unfit or extra:
            log.warning("checkpoint.load_strict=false: %d parameters of the model keep their initial values (%s), "
                        "%d of the checkpoint are dropped (%s)", len(unfit), ", ".join(sorted(unfit)) or "none",
                        len(extra), ", ".join(extra) or "none")
        load_model(reader, model, ctx, optimizer, skip=unfit)
        meta = reader.meta
        loaded_optimizer = c.load_optimizer and load_optimizer(reader, model, optimizer, ctx, skip=unfit,
                                                               name=self.cfg.optimizer.optimizer_factory.name)
        same_layout = {"cp": 1, **meta["layout"]} == self.layout()   # checkpoints before cp have no "cp"
        if same_layout:
            load_rng(reader, ctx)
        step = meta["step"]
        if meta["global_batch_size"] != global_batch_size(self.cfg):
            log.warning("global batch size changes from %d (checkpoint) to %d: continuing from consumed sample %d",
                        meta["global_batch_size"], global_batch_size(self.cfg), meta["consumed_samples"])
        log.info("resuming from %s, %s: step %d, %d consumed samples, saved on %s%s%s", folder, origin, step,
                 meta["consumed_samples"], meta["layout"], "" if loaded_optimizer else ", fresh optimizer state",
                 "" if same_layout else ", re-sliced for this layout")
        self.say_which_run(meta)
        self.last_saved = step
        self.abandon_after = step

    def say_which_run(self, meta: dict) -> None:
        """The start-up line on the run's identity: the run it goes on with, or the warm start and what differs."""
        theirs = run_record(meta).get("id")
        if self.start.own and theirs:
            log.info("run %s continues", self.run_id)
        elif self.start.own:
            log.warning("%s records no run id (saved by an earlier nanoexp): it was judged by its training keys alone; "
                        "this run goes on as run %s", self.start.folder, self.run_id)
        else:
            differ = training_differences(meta["config"], self.cfg)
            log.info("warm start: the new run %s begins from a checkpoint of %s%s", self.run_id,
                     f"run {theirs}" if theirs else "an earlier nanoexp's run",
                     f", with other training keys: {'; '.join(differ)}" if differ else ", with the same training keys")

    def layout(self) -> dict:
        ctx = self.ctx
        return {"dp": ctx.dp, "cp": ctx.cp, "tp": ctx.tp, "pp": ctx.pp, "zero_stage": self.cfg.optimizer.zero_stage}

    def save(self, step: int, model, optimizer, progress: "Progress", before_write=None, wait: bool = False) -> None:
        """Save step `step` (a collective). With checkpoint.async_save and not `wait`, only a host copy is taken now
        and the shards are written in the background, published by a later `finish_write`; a write still in
        flight is waited for first (at most one save in flight). `before_write` runs inside the write, before the
        shard is written (in the writer thread when in the background). A failed write raises CheckpointError on
        every rank; the previous checkpoint stays latest."""
        if self.in_flight is not None:
            self.finish_write(f"checkpoint {step} is due")
        meta = self.meta(progress, optimizer)
        keep, abandon = self.cfg.checkpoint.keep_last_n, self.abandon_after
        self.last_saved, self.abandon_after = step, None
        if self.cfg.checkpoint.async_save and not wait:
            self.in_flight = start_save(self.root, step, model, optimizer, self.ctx, meta, abandon, self.copies,
                                        before_write)
            return
        start = time.perf_counter()
        save_checkpoint(self.root, step, model, optimizer, self.ctx, meta, keep, abandon, before_write)
        seconds = time.perf_counter() - start
        self.records.append({"step": step, "checkpoint/stall_sec": seconds, "checkpoint/write_sec": seconds,
                             "checkpoint/wait_sec": 0.0, "checkpoint/background": False})

    def meta(self, progress: "Progress", optimizer) -> dict:
        """meta.json's fields of a save now (save.py adds the step, format and index)."""
        meta = {"consumed_samples": progress.consumed_samples, "skipped_steps": progress.skipped_steps,
                "consumed_tokens": progress.consumed_tokens,
                "global_batch_size": global_batch_size(self.cfg), "layout": self.layout(),
                "world_size": self.ctx.world_size, "optimizer_steps": optimizer_steps(optimizer),
                "config": OmegaConf.to_container(self.cfg, resolve=True),
                "run": {"id": self.run_id, "folder": os.path.abspath(self.run_dir)}}
        if progress.stage_consumed_samples:
            meta["stage_consumed_samples"] = progress.stage_consumed_samples
        return meta

    def writing(self) -> bool:
        """Whether this rank's background write is still going (the trainer agrees it across ranks each step)."""
        return self.in_flight is not None and not self.in_flight.write.done.is_set()

    def written_everywhere(self, nobody_writing: bool) -> bool:
        """Whether the checkpoint in flight can be published now: `nobody_writing`, agreed by every rank this step."""
        return self.in_flight is not None and nobody_writing

    def finish_write(self, reason: str | None = None) -> None:
        """A collective: wait for the write in flight (if any) on every rank and publish it; `reason` (a save
        due) is logged with the time waited. Raises CheckpointError on every rank if a rank's write failed."""
        in_flight, still_writing = self.in_flight, self.writing()
        if in_flight is None:
            return
        self.in_flight = None
        record = finish_save(in_flight, self.root, self.ctx, self.cfg.checkpoint.keep_last_n)
        if reason and self.ctx.rank == 0 and still_writing:
            log.info("%s while checkpoint %d is still being written: waited %.2f s for its write",
                     reason, in_flight.step, record["checkpoint/wait_sec"])
        self.records.append(record)

    def saved(self) -> list[dict]:
        """The records of the checkpoints published since the last call (for metrics.jsonl): each one's step, the
        training thread's stall, the longest rank's write, the time waited for it, and whether in the background."""
        records, self.records = self.records, []
        return records

    def due(self, step: int, is_last: bool, stop: bool) -> bool:
        """Whether step `step` is saved: the interval or the end of training asks for it, or `stop` (a stop signal
        came), and it is not saved yet."""
        c = self.cfg.checkpoint
        asked = (c.checkpoint_interval and step % c.checkpoint_interval == 0) or (is_last and c.save_final_state)
        return bool(asked or stop) and self.last_saved != step


def optimizer_steps(optimizer) -> int:
    """How many updates the optimizer has applied (what AdamW's bias correction counts)."""
    if hasattr(optimizer, "num_steps"):
        return optimizer.num_steps
    return max((int(s["step"].item()) for s in optimizer.state.values() if "step" in s), default=0)
