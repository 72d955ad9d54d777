"""From a composed config to a finished run: validate, launch, and run the trainer on each rank."""
from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist
from omegaconf import OmegaConf

from nanoexp.checkpoint.save import CheckpointError
from nanoexp.checkpoint.manager import check_resume
from nanoexp.checkpoint.signals import handle_stop_signals
from nanoexp.config import ConfigError, validate
from nanoexp.data.sources import check_data
from nanoexp.data.tokenizer import build_tokenizer
from nanoexp.launch import (WorkerFailed, export_slurm_rendezvous, init_distributed, launcher_env, setup_device,
                            spawn_local)
from nanoexp.sweep import record_failure, stopped_by_signal

log = logging.getLogger("nanoexp")

# Keep the shared console and train.log readable: rank 0 talks, every rank has its own file.
LOG_FORMAT = "[%(asctime)s][rank {rank}][%(levelname)s] %(message)s"


def setup_rank_logging(run_dir: str, rank: int) -> None:
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    root = logging.getLogger()
    for handler in list(root.handlers):
        # Forked workers inherit rank 0's console and train.log handlers; a process that runs
        # several trainings in turn must not keep writing into the earlier runs' files.
        if rank != 0 or handler.get_name() == "nanoexp_rank":
            root.removeHandler(handler)
            if handler.get_name() == "nanoexp_rank":
                handler.close()
    handler = logging.FileHandler(os.path.join(run_dir, "logs", f"rank_{rank}.log"))
    handler.set_name("nanoexp_rank")
    handler.setFormatter(logging.Formatter(LOG_FORMAT.format(rank=rank)))
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def check_config(cfg, world_size: int | None, run_dir: str | None = None) -> None:
    """Every config check, before any process group or training work."""
    vocab = None
    try:
        vocab = build_tokenizer(cfg.tokenizer.tokenizer_name_or_path).vocab_size
    except (FileNotFoundError, OSError, ValueError) as error:
        raise ConfigError(f"tokenizer.tokenizer_name_or_path={cfg.tokenizer.tokenizer_name_or_path}: {error}")
    validate(cfg, world_size=world_size, tokenizer_vocab_size=vocab)
    try:   # the data files against the config: a missing folder, a bad Nanoset, a wrong column, ...
        check_data(cfg, build_tokenizer(cfg.tokenizer.tokenizer_name_or_path))
    except (FileNotFoundError, KeyError, ValueError) as error:
        raise ConfigError(f"data: {error}") from None
    if run_dir is not None:
        try:
            check_resume(cfg, run_dir)
        except CheckpointError as error:
            raise ConfigError(f"checkpoint: {error}") from None


def worker(rank: int, world_size: int, device, cfg, run_dir: str) -> dict:
    """What every rank runs: its context, its model shard, the loop."""
    from nanoexp.parallel.context import ParallelContext
    from nanoexp.trainer import Trainer

    setup_rank_logging(run_dir, rank)
    p = cfg.parallelism
    ctx = ParallelContext(p.dp, p.tp, p.pp, device=device, collective_timeout_s=p.collective_timeout_s)
    return Trainer(cfg, ctx, run_dir).train()


def run(cfg, run_dir: str) -> None:
    """Validate, then train in this process, in the launcher's world, or in local workers."""
    env = launcher_env()
    world = cfg.parallelism.dp * cfg.parallelism.tp * cfg.parallelism.pp
    check_config(cfg, world_size=env["world_size"] if env else None, run_dir=run_dir)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))   # plain, picklable, resolved
    os.makedirs(run_dir, exist_ok=True)
    with handle_stop_signals():   # SIGTERM/SIGUSR2: every rank checkpoints after its step and returns
        launch_and_train(cfg, run_dir, env, world)


def launch_and_train(cfg, run_dir: str, env: dict | None, world: int) -> None:
    if env is not None:   # torchrun or SLURM started us: join their world
        export_slurm_rendezvous()   # MASTER_ADDR/PORT from the SLURM node list (torchrun sets its own)
        device = setup_device(env["local_rank"], int(os.environ.get("LOCAL_WORLD_SIZE", env["world_size"])))
        init_distributed(env["rank"], env["world_size"], device, cfg.parallelism.collective_timeout_s)
        shared = [run_dir]
        dist.broadcast_object_list(shared, src=0)   # every rank writes into rank 0's run folder
        try:
            worker(env["rank"], env["world_size"], device, cfg, shared[0])
        finally:
            dist.destroy_process_group()
    elif world == 1:
        worker(0, 1, setup_device(0, 1), cfg, run_dir)
    else:
        spawn_local(world, worker, (cfg, run_dir), timeout_s=cfg.parallelism.collective_timeout_s,
                    method=cfg.parallelism.start_method)


def main(cfg, run_dir: str, multirun: bool = False) -> None:
    """train.py's body: one readable message and a non-zero exit for a bad config or a failed rank.
    A failed job's summary.json says failed and why; in a multirun the error is raised instead of
    exiting, so Hydra marks this job failed and the sweep goes on with the others. A sweep job stopped
    by SIGTERM/SIGUSR2 exits without a result, so that no launcher takes it for finished."""
    try:
        run(cfg, run_dir)
    except Exception as error:
        if multirun or not isinstance(error, ConfigError):   # a single run's bad config only prints
            record_failure(run_dir, error)
        if multirun or not isinstance(error, (ConfigError, WorkerFailed)):
            raise
        if isinstance(error, WorkerFailed):
            print(f"nanoexp: {error}", file=sys.stderr)
            sys.exit(1)
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"nanoexp: {error}", file=sys.stderr)
        sys.exit(2)
    if multirun and stopped_by_signal(run_dir):   # unfinished: SLURM requeues it, or the sweep reports it
        raise SystemExit("nanoexp: stopped by a signal after checkpointing; this sweep job is not finished")
