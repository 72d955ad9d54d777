"""What a checkpoint costs training: the training thread's stall per save, synchronous against asynchronous
(checkpoint.async_save), the background write's length, and the step time while a write runs against without.
With --formats: one process's save and load time and size, nanoexp's format against torch.distributed.checkpoint.

    python benchmarks/bench_checkpoint.py                          # small and medium (114M), dp2, ZeRO-1 and ZeRO-3
    python benchmarks/bench_checkpoint.py --models small --zero-stages 1 --steps 9 --interval 4 --repeats 2
    python benchmarks/bench_checkpoint.py --formats [--model small]

Each case is a real run (`nanoexp.run.run`, as `python train.py` runs it: local workers, gloo on CPU, NCCL on GPUs)
with a save every --interval steps and none at the end; the sync and async runs of a case alternate, --repeats
times, so that background load hits both alike. From each run's metrics.jsonl (checkpoint records: see
docs/checkpoints.md):
  stall      the training thread's time per save (rank 0): the whole save when synchronous; when asynchronous the
             host copy and the folder's preparation, the wait for the write at publication, and the publication
  write      the longest rank's write of its shard (serialise, CRC-32, write, fsync)
  step       the median step time of the synchronous runs after two warm-up steps (no write runs during a step),
             and of the asynchronous runs' steps during which a write ran (from the save's step to its publication)
  MFU        the runs' model FLOP/s over the matmul peak the run measured (summary.json), for scale
Medians over the saves and the repeats. The machine's load average (1 min) at start and end of each run is printed:
a busy machine stretches every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a file: the repository root

from benchmarks.harness import compose, in_turns  # noqa: E402
from nanoexp.observe.metrics import read_metrics  # noqa: E402

SETTINGS = ["parallelism=dp2tp1pp1", "tokens.val_check_interval=0", "checkpoint.save_final_state=false",
            "logging.tensorboard=false", "tokens.sequence_length=128", "tokens.global_batch_size=8",
            "tokens.micro_batch_size=4", "optimizer.learning_rate_scheduler.lr_warmup_steps=2"]


def run_case(model: str, zero: int, background: bool, args, extra: list[str]) -> dict:
    """One training run; its checkpoint records, step times and summary."""
    from nanoexp.run import run
    folder = tempfile.mkdtemp(prefix="bench_checkpoint_")
    overrides = SETTINGS + [f"model={model}", f"optimizer.zero_stage={zero}", f"tokens.train_steps={args.steps}",
                            f"checkpoint.checkpoint_interval={args.interval}",
                            f"checkpoint.async_save={str(background).lower()}"] + extra
    try:
        run(compose(overrides), folder)
        records = read_metrics(folder)
        with open(os.path.join(folder, "summary.json")) as f:
            summary = json.load(f)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"saves": [r for r in records if "checkpoint/stall_sec" in r],
            "steps": {r["step"]: r["step_time_sec"] for r in records if "loss" in r}, "summary": summary}


def steps_while_writing(result: dict) -> list[float]:
    """Step times of the steps an asynchronous write ran during: from the one after its save to the one after which
    it was published (the last of them only partly)."""
    during = set()
    for save in result["saves"]:
        during.update(range(save["step"] + 1, save["checkpoint/published_after_step"] + 1))
    return [seconds for step, seconds in result["steps"].items() if step in during]


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(results: list[dict], background: bool) -> dict:
    saves = [s for r in results for s in r["saves"] if s["checkpoint/background"] == background]
    steps = ([t for r in results for t in steps_while_writing(r)] if background else
             [t for r in results for step, t in r["steps"].items() if step > 2])
    loads = [r["summary"]["machine_load"] for r in results]
    return {"stall": median([s["checkpoint/stall_sec"] for s in saves]),
            "write": median([s["checkpoint/write_sec"] for s in saves]), "step": median(steps),
            "mfu": median([r["summary"]["mfu"] for r in results if r["summary"].get("mfu")]),
            "load": f"{min(x['start'] for x in loads):.1f}-{max(x['end'] for x in loads):.1f}", "saves": len(saves)}


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def main_stall(args, extra: list[str]) -> None:
    cases = [(model, zero, background) for model in args.models for zero in args.zero_stages
             for background in (False, True)]
    results = {case: [] for case in cases}
    for _, case in in_turns(cases, args.repeats):
        start = time.perf_counter()
        results[case].append(run_case(*case, args, extra))
        print(f"# {case[0]} ZeRO-{case[1]} {'async' if case[2] else 'sync'}: {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)
    print(f"dp2, {args.steps} steps, a save every {args.interval}, {args.repeats} repeat(s); load = 1-min load "
          f"average at start-end of the runs on {os.cpu_count()} CPUs")
    print("| model | ZeRO | save | stall s | write s | step s | stall / sync stall | stall / step | MFU | saves | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for zero in args.zero_stages:
            sync, background = (summarise(results[model, zero, b], b) for b in (False, True))
            for name, row in (("sync", sync), ("async", background)):
                ratio = row["stall"] / sync["stall"] if row["stall"] is not None and sync["stall"] else None
                per_step = row["stall"] / sync["step"] if row["stall"] is not None and sync["step"] else None
                print(f"| {model} | {zero} | {name} | {fmt(row['stall'])} | {fmt(row['write'])} | {fmt(row['step'])} "
                      f"| {fmt(ratio, '.1%')} | {fmt(per_step, '.1%')} | {fmt(row['mfu'], '.1%')} | {row['saves']} "
                      f"| {row['load']} |")


def main_formats(args) -> None:
    """One process: nanoexp's save and load against DCP's, of the same weights and AdamW state."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from nanoexp.checkpoint import CheckpointManager, Progress
    from nanoexp.interop.dcp import read_dcp
    from nanoexp.parallel.context import ParallelContext
    from nanoexp.runtime.build import build_model
    from nanoexp.runtime.optim import build_optimizer

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")   # one process, as meant
    cfg = compose([f"model={args.model}"], world_size=1)
    ctx = ParallelContext()
    model = build_model(cfg, ctx)
    optimizer = build_optimizer(cfg, model)
    for p in model.parameters():   # one update, so AdamW holds its moments
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    work = tempfile.mkdtemp()   # private: the DCP folder read back below is the one written here
    cfg.checkpoint.checkpoints_path = os.path.join(work, "nanoexp")
    manager = CheckpointManager(cfg, ctx, work)
    timings = {key: [] for key in ("nanoexp_save_s", "nanoexp_load_s", "dcp_save_s", "dcp_load_s")}
    results = {"model": args.model, "parameters": sum(p.numel() for p in model.parameters())}
    for i in range(args.repeats):
        folder, target = os.path.join(work, "nanoexp", str(i + 1)), os.path.join(work, f"dcp_{i}")
        state = {"model": model.state_dict(),   # the tensors nanoexp saves (DCP would pickle the parameter groups)
                 "optimizer": {"state": {name: optimizer.state[p] for name, p in model.named_parameters()}}}
        steps = [("nanoexp_save_s", lambda: manager.save(i + 1, model, optimizer, Progress(), wait=True)),
                 ("nanoexp_load_s", lambda: load_nanoexp(folder, model, optimizer, ctx)),
                 ("dcp_save_s", lambda: dcp.save(state, checkpoint_id=target, no_dist=True)),   # one process
                 ("dcp_load_s", lambda: read_dcp(target))]
        for key, step in steps:
            start = time.perf_counter()
            step()
            timings[key].append(time.perf_counter() - start)
        results["nanoexp_bytes"], results["dcp_bytes"] = folder_bytes(folder), folder_bytes(target)
    results.update({key: statistics.median(values) for key, values in timings.items()})
    shutil.rmtree(work)
    print(json.dumps(results, indent=1))


def load_nanoexp(folder: str, model, optimizer, ctx) -> None:
    from nanoexp.checkpoint import CheckpointReader
    from nanoexp.checkpoint.load import load_model, load_optimizer
    reader = CheckpointReader(folder)
    load_model(reader, model, ctx)
    load_optimizer(reader, model, optimizer, ctx)


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["small", "medium"])
    parser.add_argument("--zero-stages", nargs="+", type=int, default=[1, 3])
    parser.add_argument("--steps", type=int, default=13, help="not a multiple of --interval: the last step's save "
                        "would be synchronous (the run waits for it)")
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--formats", action="store_true", help="one process: nanoexp's format against DCP's")
    parser.add_argument("--model", default="small", help="with --formats")
    args, extra = parser.parse_known_args()
    if args.formats:
        main_formats(args)
    else:
        main_stall(args, extra)


if __name__ == "__main__":
    main()
