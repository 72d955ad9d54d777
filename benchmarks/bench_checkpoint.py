"""Save and load time and size of a checkpoint of the `small` model (weights + AdamW state), nanoexp's
format against torch.distributed.checkpoint (DCP) saving the same state, one process.

    python benchmarks/bench_checkpoint.py [--model small] [--repeats 3]
Prints one JSON object: median seconds and bytes on disk for each format.
"""
import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

from nanoexp.checkpoint import CheckpointManager, CheckpointReader, Progress
from nanoexp.checkpoint.load import load_model, load_optimizer
from nanoexp.config import compose
from nanoexp.runtime.build import build_model
from nanoexp.runtime.optim import build_optimizer
from nanoexp.parallel.context import ParallelContext


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cfg = compose([f"model={args.model}"])
    ctx = ParallelContext()
    model = build_model(cfg, ctx)
    optimizer = build_optimizer(cfg, model)
    for p in model.parameters():   # one update, so AdamW holds its moments
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    work = tempfile.mkdtemp()
    cfg.checkpoint.checkpoints_path = os.path.join(work, "nanoexp")
    manager = CheckpointManager(cfg, ctx, work)
    results = {"model": args.model, "parameters": sum(p.numel() for p in model.parameters())}

    ours_save, ours_load, dcp_save, dcp_load = [], [], [], []
    for i in range(args.repeats):
        ours_save.append(timed(lambda: manager.save(i + 1, model, optimizer, Progress())))
        folder = os.path.join(work, "nanoexp", str(i + 1))

        def load_ours():
            reader = CheckpointReader(folder)
            load_model(reader, model, ctx)
            load_optimizer(reader, model, optimizer, ctx)
        ours_load.append(timed(load_ours))
        results["nanoexp_bytes"] = folder_bytes(folder)

        target = os.path.join(work, f"dcp_{i}")
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        dcp_save.append(timed(lambda: dcp.save(state, checkpoint_id=target)))
        dcp_load.append(timed(lambda: dcp.load(state, checkpoint_id=target)))
        results["dcp_bytes"] = folder_bytes(target)
    for key, values in (("nanoexp_save_s", ours_save), ("nanoexp_load_s", ours_load),
                        ("dcp_save_s", dcp_save), ("dcp_load_s", dcp_load)):
        results[key] = statistics.median(values)
    shutil.rmtree(work)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
