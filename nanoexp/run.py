"""From a composed config to a finished run: validate, launch, and run the trainer on each rank."""
from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist
from omegaconf import OmegaConf

from nanoexp.config import ConfigError, validate
from nanoexp.data.tokenizer import build_tokenizer
from nanoexp.launch import WorkerFailed, init_distributed, launcher_env, setup_device, spawn_local

log = logging.getLogger("nanoexp")

# Keep the shared console and train.log readable: rank 0 talks, every rank has its own file.
LOG_FORMAT = "[%(asctime)s][rank {rank}][%(levelname)s] %(message)s"


def setup_rank_logging(run_dir: str, rank: int) -> None:
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    root = logging.getLogger()
    if rank != 0:   # forked workers inherit rank 0's console and train.log handlers
        for handler in list(root.handlers):
            root.removeHandler(handler)
    handler = logging.FileHandler(os.path.join(run_dir, "logs", f"rank_{rank}.log"))
    handler.setFormatter(logging.Formatter(LOG_FORMAT.format(rank=rank)))
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def check_config(cfg, world_size: int | None) -> None:
    """Every config check, before any process group or training work."""
    vocab = None
    try:
        vocab = build_tokenizer(cfg.tokenizer.tokenizer_name_or_path).vocab_size
    except (FileNotFoundError, OSError, ValueError) as error:
        raise ConfigError(f"tokenizer.tokenizer_name_or_path={cfg.tokenizer.tokenizer_name_or_path}: {error}")
    validate(cfg, world_size=world_size, tokenizer_vocab_size=vocab)


def worker(rank: int, world_size: int, device, cfg, run_dir: str) -> dict:
    """What every rank runs: its context, its model shard, the loop."""
    from nanoexp.parallel.context import ParallelContext
    from nanoexp.trainer import Trainer

    setup_rank_logging(run_dir, rank)
    p = cfg.parallelism
    ctx = ParallelContext(p.dp, p.tp, p.pp, device=device)
    return Trainer(cfg, ctx, run_dir).train()


def run(cfg, run_dir: str) -> None:
    """Validate, then train in this process, in the launcher's world, or in local workers."""
    env = launcher_env()
    world = cfg.parallelism.dp * cfg.parallelism.tp * cfg.parallelism.pp
    check_config(cfg, world_size=env["world_size"] if env else None)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))   # plain, picklable, resolved
    os.makedirs(run_dir, exist_ok=True)
    if env is not None:   # torchrun or SLURM started us: join their world
        device = setup_device(env["local_rank"], int(os.environ.get("LOCAL_WORLD_SIZE", env["world_size"])))
        init_distributed(env["rank"], env["world_size"], device)
        shared = [run_dir]
        dist.broadcast_object_list(shared, src=0)   # every rank writes into rank 0's run folder
        try:
            worker(env["rank"], env["world_size"], device, cfg, shared[0])
        finally:
            dist.destroy_process_group()
    elif world == 1:
        worker(0, 1, setup_device(0, 1), cfg, run_dir)
    else:
        spawn_local(world, worker, (cfg, run_dir))


def main(cfg, run_dir: str) -> None:
    """train.py's body: one readable message and a non-zero exit for a bad config or a failed rank."""
    try:
        run(cfg, run_dir)
    except ConfigError as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"nanoexp: {error}", file=sys.stderr)
        sys.exit(2)
    except WorkerFailed as error:
        print(f"nanoexp: {error}", file=sys.stderr)
        sys.exit(1)
