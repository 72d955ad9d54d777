"""What the trainer calls: where checkpoints live, what to resume from, when to save.

    checkpoints = CheckpointManager(cfg, ctx, run_dir)
    resume = checkpoints.restore(model, optimizer)      # -> Resume(step, consumed_samples, lr_step_offset)
    ... after each optimizer step:
    if checkpoints.after_step(step, is_last, model, optimizer, consumed_samples): stop (a signal came)
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from omegaconf import OmegaConf

from nanoexp import config as C
from nanoexp.checkpoint.load import CheckpointReader, check_compatible, load_model, load_optimizer, load_rng
from nanoexp.checkpoint.save import complete_steps, save_checkpoint
from nanoexp.checkpoint.signals import stop_agreed

log = logging.getLogger("nanoexp")


@dataclass
class Resume:
    step: int = 0                 # completed optimizer steps: training continues at step + 1
    consumed_samples: int = 0     # the data position
    lr_step_offset: int = 0       # subtracted from the step for the LR schedule (load_lr_scheduler=false)
    skipped_steps: int = 0        # updates skipped as non-finite before the checkpoint


def newest_checkpoint(root: str) -> str | None:
    """The folder named by latest.txt, else the newest complete one (latest.txt moves last, so a
    crash between the rename and its update leaves a newer complete folder)."""
    steps = complete_steps(root)
    if not steps:
        return None
    latest = os.path.join(root, "latest.txt")
    if os.path.isfile(latest):
        with open(latest) as f:
            name = f.read().strip()
        if name.isdigit() and int(name) == steps[-1]:
            return os.path.join(root, name)
    return os.path.join(root, str(steps[-1]))


def check_resume(cfg, run_dir: str) -> None:
    """Before any work: the checkpoint this run would resume from is complete and fits the model
    (raises CheckpointError naming the first mismatching parameter)."""
    from nanoexp.trainer import model_shape   # the trainer imports this module
    folder = CheckpointManager(cfg, None, run_dir).resume_folder()
    if folder is not None:
        check_compatible(CheckpointReader(folder), model_shape(cfg))


class CheckpointManager:
    def __init__(self, cfg, ctx, run_dir: str):
        self.cfg, self.ctx = cfg, ctx
        self.root = cfg.checkpoint.checkpoints_path or os.path.join(run_dir, "checkpoints")
        self.last_saved = None

    def resume_folder(self) -> str | None:
        c = self.cfg.checkpoint
        if c.resume_checkpoint_path:
            return c.resume_checkpoint_path
        return newest_checkpoint(self.root) if c.resume == "auto" else None

    def restore(self, model, optimizer) -> Resume:
        """Load the checkpoint to resume from (if any) into this rank's model and optimizer."""
        folder = self.resume_folder()
        if folder is None:
            return Resume()
        c, ctx = self.cfg.checkpoint, self.ctx
        reader = CheckpointReader(folder)
        check_compatible(reader, model.shape)
        load_model(reader, model, ctx)
        meta = reader.meta
        loaded_optimizer = c.load_optimizer and load_optimizer(reader, model, optimizer, ctx)
        same_layout = meta["layout"] == self.layout()
        if same_layout:
            load_rng(reader, ctx)
        step = meta["step"]
        if meta["global_batch_size"] != C.global_batch_size(self.cfg):
            log.warning("global batch size changes from %d (checkpoint) to %d: continuing from consumed sample %d",
                        meta["global_batch_size"], C.global_batch_size(self.cfg), meta["consumed_samples"])
        log.info("resumed from %s: step %d, %d consumed samples, saved on %s%s%s", folder, step,
                 meta["consumed_samples"], meta["layout"], "" if loaded_optimizer else ", fresh optimizer state",
                 "" if same_layout else ", re-sliced for this layout")
        self.last_saved = step
        return Resume(step, meta["consumed_samples"], 0 if c.load_lr_scheduler else step,
                      meta.get("skipped_steps", 0))

    def layout(self) -> dict:
        ctx = self.ctx
        return {"dp": ctx.dp, "tp": ctx.tp, "pp": ctx.pp, "zero_stage": self.cfg.optimizer.zero_stage}

    def save(self, step: int, model, optimizer, consumed_samples: int, skipped_steps: int = 0) -> str:
        meta = {"consumed_samples": consumed_samples, "skipped_steps": skipped_steps,
                "consumed_tokens": consumed_samples * self.cfg.tokens.sequence_length,
                "global_batch_size": C.global_batch_size(self.cfg), "layout": self.layout(),
                "world_size": self.ctx.world_size, "optimizer_steps": optimizer_steps(optimizer),
                "config": OmegaConf.to_container(self.cfg, resolve=True)}
        path = save_checkpoint(self.root, step, model, optimizer, self.ctx, meta, self.cfg.checkpoint.keep_last_n)
        self.last_saved = step
        return path

    def after_step(self, step: int, is_last: bool, model, optimizer, consumed_samples: int,
                   skipped_steps: int = 0) -> bool:
        """Save when the interval, the end of training or a stop signal asks for it; True: stop before the end."""
        c = self.cfg.checkpoint
        stop = stop_agreed(self.ctx)
        due = (c.checkpoint_interval and step % c.checkpoint_interval == 0) or (is_last and c.save_final_state)
        if (due or stop) and self.last_saved != step:
            self.save(step, model, optimizer, consumed_samples, skipped_steps)
        if stop and not is_last:
            log.info("stop signal received: checkpoint saved after step %d, exiting", step)
        return stop and not is_last


def optimizer_steps(optimizer) -> int:
    """How many updates the optimizer has applied (what AdamW's bias correction counts)."""
    if hasattr(optimizer, "num_steps"):
        return optimizer.num_steps
    states = [s for s in optimizer.state.values() if "step" in s]
    return int(states[0]["step"].item()) if states else 0
