"""torch's FSDP2 (`fully_shard`) against nanoexp's ZeRO-3: the same model, data and AdamW, at dp=2 and dp=4.

    python benchmarks/bench_fsdp.py                                   # model=small, dp 2 and 4, 2 warm-up + 4 timed steps
    python benchmarks/bench_fsdp.py --model tiny --dps 2 4 8 --steps 6 --warmup 2 --repeats 3
    python benchmarks/bench_fsdp.py --zero-stage 1 tokens.micro_batch_size=2      # extra Hydra overrides for both sides

Each case is a fresh set of dp local workers (nanoexp's launcher: gloo and torch's threads split between the
processes on CPU; one process per GPU with NCCL when CUDA is present). The cases alternate, `--repeats` times
(fsdp2 dp2, nanoexp dp2, fsdp2 dp4, nanoexp dp4, ...), so background load hits both sides alike.
  fsdp2    nanoexp's `LlamaForCausalLM` (nanoexp.runtime.build: the same seeded init) wrapped with `fully_shard` per
           decoder layer and then on the root, over a 1-D DeviceMesh of the dp ranks; torch AdamW with nanoexp's
           parameter groups and settings, `clip_grad_norm_` at optimizer.clip_grad, nanoexp's learning-rate
           schedule, the loss normalised as nanoexp does (token-loss sum / the global batch's target tokens x dp).
           FSDP2's defaults otherwise: gradients reduce-scattered after every micro-batch's backward.
  nanoexp  the real `Trainer` with optimizer.zero_stage=--zero-stage (3: plus zero3_prefetch and
           zero3_reshard_after_forward, which FSDP2 also gets: reshard_after_forward, and explicit prefetch
           lists when more than one layer is gathered ahead; FSDP2 prefetches one layer by itself).
Both read the same micro-batches (nanoexp's StagedBatches for each dp rank). Reported per case, medians over
the repeats:
  tokens/s      the global batch's tokens over rank 0's median timed step (the repeats' range beside it);
  MFU           model FLOPs (nanoexp.observe.metrics.flops_per_token) over the peak (benchmarks.harness.matmul_peak): on
                CPU the node's 2048x2048 float32 matmul with all cores, measured before every case and at the end, the
                best (load lowers it); on CUDA one GPU's float32 datasheet figure, x dp;
  CPU s/step    process CPU time summed over the ranks: what other load on the machine disturbs least;
  peak MB/rank  the largest rank's peak above its baseline (nanoexp.instruments.memory: CPU peak RSS since
                `start_measuring`, taken before the model is built, with glibc returning freed memory as
                logging.exact_cpu_memory does, unless --no-exact-memory; CUDA max_memory_allocated);
  losses        of the first and of the last step, and nanoexp's difference to FSDP2 (same init and data).
A failing side is reported in its rows (the exception and the line of this script it passed) and the rest runs.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torch.distributed as dist

from nanoexp.config import global_batch_size
from nanoexp.data.loader import IGNORE_INDEX
from nanoexp.data.stages import StagedBatches
from nanoexp.launch.workers import WorkerFailed, spawn_local, start_method
from nanoexp.instruments.memory import peak_memory_mb, return_freed_memory, start_measuring
from nanoexp.observe.peak import peak_dtype
from nanoexp.instruments.timing import synchronize
from nanoexp.observe.metrics import flops_per_token
from nanoexp.runtime.build import build_model
from nanoexp.model.shape import model_shape
from nanoexp.optim.schedule import lr_at, set_lr
from nanoexp.runtime.optim import build_optimizer
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.layout import Layout
from nanoexp.runtime.trainer import Trainer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a file: the repository root
from benchmarks.harness import compose, in_turns, matmul_peak  # noqa: E402

IMPLEMENTATIONS = ("fsdp2", "nanoexp")
# The model returns its per-token losses as a view, on which FSDP2 warns that an in-place op would skip the
# backward all-gather; only .sum() reads them here.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", help="conf/model: tiny (0.5M) or small (20M parameters)")
    parser.add_argument("--dps", type=int, nargs="+", default=[2, 4], help="data-parallel sizes")
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of all cases, alternating")
    parser.add_argument("--zero-stage", type=int, default=3, choices=(0, 1, 2, 3), help="nanoexp's side")
    parser.add_argument("--prefetch", type=int, default=1, help="stage 3: layers gathered ahead (both sides)")
    parser.add_argument("--no-reshard-after-forward", dest="reshard", action="store_false",
                        help="stage 3: keep each layer's gathered parameters from forward to backward (both sides)")
    parser.add_argument("--no-exact-memory", dest="exact_memory", action="store_false",
                        help="CPU: keep glibc's heap (faster; peak RSS then reads 30-50%% above the live tensors)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both sides")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--steps and --repeats must be >= 1, --warmup >= 0")
    return args


def config_for(args, impl: str, dp: int):
    """The resolved config `python train.py` would run with at this dp; FSDP2's side reads it with zero_stage=0
    (it shards by itself), so it runs whatever stages this nanoexp knows."""
    stage = args.zero_stage if impl == "nanoexp" else 0
    overrides = [f"model={args.model}", f"parallelism.dp={dp}", "logging.tensorboard=false", "data.prefetch=false",
                 f"optimizer.zero_stage={stage}"]
    if stage == 3:
        overrides += [f"optimizer.zero3_prefetch={args.prefetch}",
                      f"optimizer.zero3_reshard_after_forward={str(args.reshard).lower()}"]
    return compose(overrides + args.overrides, plain=True)   # plain and picklable for the workers


# -- FSDP2 --------------------------------------------------------------------------------------------------
def shard_with_fsdp2(model, device: torch.device, args) -> None:
    """fully_shard each decoder layer, then the root (embedding, final norm, LM head), over all ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layers = list(model.model.layers.values())
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=args.reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=args.reshard)
    if args.prefetch > 1:   # FSDP2 prefetches the next layer by itself; further ones must be listed
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1:i + 1 + args.prefetch])
            layer.set_modules_to_backward_prefetch(layers[max(0, i - args.prefetch):i][::-1])


def fsdp2_step(cfg, model, optimizer, micro_batches, lr: float, device) -> float:
    """One optimizer step; returns the global batch's mean token loss, as Trainer.train_step does."""
    dp = dist.get_world_size()
    set_lr(optimizer, lr)
    # nanoexp's normalisation: each rank divides its token-loss sum by the global target tokens / dp, and
    # FSDP2 averages the gradients over dp: the gradient of the mean over every target token of the batch.
    targets = torch.tensor(float(sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches)),
                           device=device)
    dist.all_reduce(targets)
    denominator = max(targets.item(), 1.0) / dp
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.model.dtype == "bfloat16")
    total = torch.zeros((), device=device)
    for mb in micro_batches:
        with autocast:
            losses = model(input_ids=mb["input_ids"].to(device), labels=mb["labels"].to(device))
        loss = losses.sum() / denominator
        loss.backward()
        total += loss.detach().float()
    if cfg.optimizer.clip_grad is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.clip_grad)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(total)
    return total.item() / dp


def run_fsdp2(cfg, device, args) -> dict:
    rank, dp = dist.get_rank(), dist.get_world_size()
    batches = StagedBatches(cfg, global_batch_size(cfg), rank, dp, first_step=1)   # the Trainer's order
    baseline = start_measuring(device, cfg.model.dtype)   # as the Trainer: after the data, before the model
    model = build_model(cfg, ParallelContext(Layout.from_config(cfg), device))   # the whole model (tp = pp = 1)
    shard_with_fsdp2(model, device, args)
    optimizer = build_optimizer(cfg, model)   # zero_stage=0: torch AdamW with nanoexp's groups, over the shards
    step = lambda i, mbs: fsdp2_step(cfg, model, optimizer, mbs, lr_at(i, cfg), device)   # noqa: E731
    return timed_steps(step, batches, args, device) | {"baseline_mb": baseline}


# -- nanoexp ------------------------------------------------------------------------------------------------
def run_nanoexp(cfg, device, args) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, ParallelContext(Layout.from_config(cfg), device, args.timeout), run_dir)
        step = lambda i, mbs: trainer.train_step(mbs, lr_at(i, cfg))[0]   # noqa: E731
        return timed_steps(step, trainer.batches, args, device) | {"baseline_mb": trainer.reporter.baseline_mb}


# -- both -----------------------------------------------------------------------------------------------------
def timed_steps(step, batches, args, device) -> dict:
    """Run warm-up + timed steps (the batches read beforehand, outside the timing); the step times and last loss."""
    steps = [batches.next_step() for _ in range(args.warmup + args.steps)]
    batches.close()
    times, cpu_times, losses = [], [], []
    for i, micro_batches in enumerate(steps, start=1):
        dist.barrier()   # every rank starts the step together: rank 0's time is the step's
        start, cpu_start = time.perf_counter(), time.process_time()
        losses.append(step(i, micro_batches))
        synchronize(device)   # the optimizer's kernels (and ZeRO's gathers) queued after the loss's .item() too
        if i > args.warmup:
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)   # all this process's threads, not the waits
    return {"times": times, "cpu_times": cpu_times, "first_loss": losses[0], "loss": losses[-1],
            "peak_mb": peak_memory_mb(device)}


def where_it_failed(error: BaseException) -> str:
    """The error, the line of this script it came through last and the innermost call (file:line)."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = ([f for f in frames if os.path.abspath(f.filename) == os.path.abspath(__file__)] or frames)[-1]
    deepest, message = frames[-1], (str(error).strip().splitlines() or [""])[0]
    return (f"{type(error).__name__}: {message} [at {os.path.basename(ours.filename)}:{ours.lineno} `{ours.line}`; "
            f"raised in {os.path.basename(deepest.filename)}:{deepest.lineno} {deepest.name}]")


def worker(rank, world_size, device, impl, cfg, args, results) -> None:
    """One rank of one case (nanoexp.launch.workers.spawn_local runs it); hands its result or its failure to the parent."""
    if device.type == "cpu" and args.exact_memory:
        return_freed_memory()   # as run.py does for logging.exact_cpu_memory=true
    try:
        results.put((rank, "ok", (run_fsdp2 if impl == "fsdp2" else run_nanoexp)(cfg, device, args)))
    except BaseException as error:
        results.put((rank, "error", where_it_failed(error)))
        raise
    finally:   # the launcher ends workers with os._exit: let the queue's data through first
        results.close()
        results.join_thread()


def run_case(impl: str, dp: int, args) -> dict:
    """One case in fresh workers: tokens/s, losses, the largest rank's peak above its baseline; or {"error"}."""
    try:
        cfg = config_for(args, impl, dp)
    except Exception as error:  # noqa: BLE001 - e.g. a zero stage this nanoexp does not know yet
        return {"error": f"config: {type(error).__name__}: {str(error).splitlines()[0]}"}
    results = mp.get_context(start_method()).Queue()
    failure = None
    try:
        spawn_local(dp, worker, (impl, cfg, args, results), timeout_s=args.timeout)
    except WorkerFailed as error:
        failure = str(error)
    reports = {}
    while not results.empty():
        rank, status, payload = results.get()
        reports.setdefault(status, {})[rank] = payload
    if failure or "error" in reports:
        errors = reports.get("error", {})
        return {"error": f"rank {min(errors)}: {errors[min(errors)]}" if errors else failure}
    ranks = [reports["ok"][r] for r in range(dp)]
    tokens = global_batch_size(cfg) * cfg.tokens.sequence_length
    return {"tokens_s": tokens / statistics.median(ranks[0]["times"]), "loss": ranks[0]["loss"],
            "first_loss": ranks[0]["first_loss"], "peak_mb": max(r["peak_mb"] - r["baseline_mb"] for r in ranks),
            "cpu_s": statistics.median(sum(step) for step in zip(*(r["cpu_times"] for r in ranks))),
            "flops_per_token": flops_per_token(model_shape(cfg), cfg.tokens.sequence_length)}


def summarize(runs: list[dict], peak_tflops: float | None, gpus: bool, dp: int) -> dict:
    """Medians over a case's repeats; any failure is reported instead (the first one). No peak (a GPU the
    datasheet table lacks): no MFU."""
    failed = [r["error"] for r in runs if "error" in r]
    if failed:
        return {"error": failed[0]}
    tokens_s = [r["tokens_s"] for r in runs]
    job_peak = peak_tflops * (dp if gpus else 1) if peak_tflops else None   # CPU: the ranks share the node's cores
    return {"tokens_s": statistics.median(tokens_s), "range": (min(tokens_s), max(tokens_s)),
            "mfu": runs[0]["flops_per_token"] * statistics.median(tokens_s) / (job_peak * 1e12) if job_peak else None,
            "cpu_s": statistics.median(r["cpu_s"] for r in runs),
            "peak_mb": statistics.median(r["peak_mb"] for r in runs), "loss": runs[-1]["loss"],
            "first_loss": runs[-1]["first_loss"]}


def format_table(rows: dict[tuple[str, int], dict]) -> str:
    """One line per (dp, implementation); nanoexp's lines carry its tokens/s ratio and loss difference to FSDP2."""
    lines = [f"{'impl':<8} {'dp':>3} {'tokens/s':>10} {'(min-max)':>15} {'MFU':>7} {'CPU s/step':>10} "
             f"{'peak MB/rank':>12} {'step-1 loss':>11} {'last loss':>10} {'tok/s vs fsdp2':>14} {'Δ last loss':>11}"]
    for dp in sorted({dp for _, dp in rows}):
        for impl in IMPLEMENTATIONS:
            r, ref = rows.get((impl, dp), {"error": "not run"}), rows.get(("fsdp2", dp), {"error": ""})
            if "error" in r:
                lines.append(f"{impl:<8} {dp:>3} FAILED: {r['error']}")
                continue
            compare = impl != "fsdp2" and "error" not in ref
            ratio = f"{r['tokens_s'] / ref['tokens_s']:.2f}x" if compare else "-"
            delta = f"{r['loss'] - ref['loss']:+.2e}" if compare else "-"
            spread = f"({r['range'][0]:,.0f}-{r['range'][1]:,.0f})"
            mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.2f}%"
            lines.append(f"{impl:<8} {dp:>3} {r['tokens_s']:>10,.0f} {spread:>15} {mfu:>7} "
                         f"{r['cpu_s']:>10.2f} {r['peak_mb']:>12.1f} {r['first_loss']:>11.6f} {r['loss']:>10.6f} "
                         f"{ratio:>14} {delta:>11}")
    return "\n".join(lines)


def main() -> None:
    args, gpus, load = parse_args(), torch.cuda.is_available(), os.getloadavg()[0]
    print(f"torch {torch.__version__}, {'NCCL, one GPU a rank' if gpus else f'gloo on {os.cpu_count()} CPUs'}, "
          f"model={args.model}, nanoexp optimizer.zero_stage={args.zero_stage}, {args.warmup} warm-up + "
          f"{args.steps} timed steps, {args.repeats} repeat(s)", flush=True)
    runs: dict[tuple[str, int], list[dict]] = {}
    peaks = []
    dtype = peak_dtype(config_for(args, "nanoexp", args.dps[0]))   # MFU against the peak of the run's matmuls
    cases = [(dp, impl) for dp in args.dps for impl in IMPLEMENTATIONS]
    for repeat, (dp, impl) in in_turns(cases, args.repeats, alternate=False):
        peaks.append(matmul_peak(dtype))   # before every case: the best of them is the least loaded
        result = run_case(impl, dp, args)
        runs.setdefault((impl, dp), []).append(result)
        shown = result.get("error") or (f"{result['tokens_s']:,.0f} tokens/s, {result['cpu_s']:.2f} CPU s/step, "
                                        f"peak {result['peak_mb']:.1f} MB/rank, last loss {result['loss']:.6f}")
        print(f"  repeat {repeat + 1}: {impl} dp{dp}: {shown}", flush=True)
    peaks.append(matmul_peak(dtype))
    measured = [p.tflops for p in peaks if p.tflops]
    peak = max(measured, default=None)
    rows = {case: summarize(case_runs, peak, gpus, case[1]) for case, case_runs in runs.items()}
    where = (f"{dtype} peak: {f'{peak * 1e3:.1f} GFLOP/s' if peak else 'unknown'} per GPU ({peaks[-1].source})"
             if gpus else f"2048² {dtype} matmul peak: {peak * 1e3:.1f} GFLOP/s (the node), the best of {len(peaks)} "
             f"(lowest {min(measured) * 1e3:.1f})")
    print(f"\n{where}; load average {load:.2f} -> {os.getloadavg()[0]:.2f}; medians over repeats (see the docstring)")
    print(format_table(rows))


if __name__ == "__main__":
    main()
