"""The peak matmul throughput MFU is measured against: a property of the machine, not of the moment.

GPUs: a datasheet table (dense, per model.dtype) times the GPUs, or `logging.peak_tflops`. CPUs have no table:
the node's peak is measured before any worker starts, as the best of a few square matmuls on all its cores.
One measurement on a busy machine reads low (MFU above 100 % followed from it), and a small matmul reads low on
an idle one too (1024² matrices gave 84.5 GFLOP/s where 2048² gave 131 on a 2-core CPU), so:
- the matmuls grow until one takes long enough to be timed well (2048² at most), within a time budget (1 s a
  dtype), so that a CPU that computes a dtype slowly (FP8 at 0.03 GFLOP/s on some) measures it on small products
  instead of for minutes, and the best of a few counts;
- at start-up it runs in a child process: a long matmul is one C call, during which the launcher's signal handlers
  could not run, and the launcher's OpenMP threads stay unstarted (a child forked after them hangs when it uses
  several threads: GNU libgomp);
- each machine keeps its best figure, measured again each start until the day's is stable (`node_peak`).
FP8 on a CPU runs in software, far slower than float32: its peak gives no MFU (`mfu_peak` says why instead).
"""
from __future__ import annotations

import datetime
import json
import math
import multiprocessing as mp
import os
import platform
import time
from dataclasses import dataclass

import torch

# Dense (no 2:4 sparsity) peak TFLOP/s per GPU and matmul format, matched against torch.cuda.get_device_name in
# this order (so "H100 PCIe" and "H100 NVL" win over "H100"). Sources, NVIDIA datasheets: "H200 Tensor Core GPU"
# (H200 SXM), "H100 Tensor Core GPU" (H100 SXM, PCIe and NVL, per GPU), "A100 Tensor Core GPU" (A100 SXM/PCIe).
# The tensor-core figures are printed with sparsity and halved here: bfloat16 from 1979 / 1513 / 1671 / 624,
# tfloat32 (float32 runs with model.allow_tf32, on by default on CUDA) from 989 / 756 / 835 / 312, float8
# (model.fp8) from 3958 / 3026 / 3341; the A100 has no FP8. float32 is the plain FP32 (non-tensor-core) figure,
# for float32 runs with model.allow_tf32=false.
PEAK_TFLOPS = [
    ("H200", "float8", 1979.0), ("H200", "bfloat16", 989.0), ("H200", "tfloat32", 494.5), ("H200", "float32", 67.0),
    ("H100 PCIe", "float8", 1513.0), ("H100 PCIe", "bfloat16", 756.0), ("H100 PCIe", "tfloat32", 378.0),
    ("H100 PCIe", "float32", 51.0),
    ("H100 NVL", "float8", 1670.5), ("H100 NVL", "bfloat16", 835.5), ("H100 NVL", "tfloat32", 417.5),
    ("H100 NVL", "float32", 60.0),
    ("H100", "float8", 1979.0), ("H100", "bfloat16", 989.0), ("H100", "tfloat32", 494.5), ("H100", "float32", 67.0),
    ("A100", "bfloat16", 312.0), ("A100", "tfloat32", 156.0), ("A100", "float32", 19.5),
]
SLOW_DTYPE = 0.25   # a dtype whose CPU peak is below this share of float32's is worth a warning
STABLE = 0.05       # a day's two best measurements this close: its figure is stable, and not measured again
DAILY_MEASUREMENTS = 4   # nor after this many in a day


@dataclass
class Peak:
    """A peak matmul throughput and where it came from."""
    tflops: float | None
    source: str


def job_peak(device: torch.device, dtype: str, override: float | None, world_size: int, nodes: int,
             measured: Peak | None = None) -> Peak:
    """The whole job's peak, which MFU divides the job's model FLOP/s by. On CUDA: per GPU (the override, else
    the datasheet table) times the GPUs. On CPU, where a node's ranks share its cores: the override per node
    times the nodes, else `measured`, every node's own peak summed (sum_of_node_peaks)."""
    if device.type == "cuda":
        per_gpu, source = (override, "logging.peak_tflops") if override else gpu_table_peak(device, dtype)
        return Peak(per_gpu * world_size if per_gpu else None, f"{source}, x {world_size} GPU(s)")
    if override:
        return Peak(override * nodes, f"logging.peak_tflops, x {nodes} node(s)")
    return measured or Peak(None, "not measured")


def sum_of_node_peaks(peaks: list[Peak | None]) -> Peak | None:
    """The job's CPU peak from each node's (None for ranks that did not measure): their sum."""
    measured = [peak for peak in peaks if peak is not None and peak.tflops]
    if not measured:   # none, or a peak withheld with its reason (mfu_peak)
        return next((peak for peak in peaks if peak is not None), None)
    if len(measured) == 1:
        return Peak(measured[0].tflops, f"{measured[0].source}, x 1 node(s)")
    return Peak(sum(peak.tflops for peak in measured),
                f"the sum of {len(measured)} nodes' peaks ({', '.join(f'{p.tflops:.3g}' for p in measured)} TFLOP/s), "
                f"node 0's: {measured[0].source}")


def gpu_table_peak(device: torch.device, dtype: str) -> tuple[float | None, str]:
    name = torch.cuda.get_device_name(device)
    for gpu, table_dtype, value in PEAK_TFLOPS:
        if gpu in name and table_dtype == dtype:
            return value, f"datasheet: {gpu} {dtype} dense"
    return None, f"{name} is not in PEAK_TFLOPS: set logging.peak_tflops"


def peak_dtype(cfg, device: torch.device | None = None) -> str:
    """The number format of the matmuls MFU is measured against (on `device`, default the CPU): that of the
    products of a number format that converts the linears (its Converter's product_dtype: model.fp8's float8, or
    float32 where emulated; attention and the LM head stay in model.dtype), else model.dtype; float32 on `device`
    with TF32 on (nanoexp/numerics/precision.py) is tfloat32."""
    from nanoexp.numerics.converters import product_dtype
    from nanoexp.numerics.precision import tf32_enabled
    dtype = product_dtype(cfg, device) or cfg.model.dtype
    if dtype == "float32" and device is not None and tf32_enabled(cfg, device):
        return "tfloat32"
    return dtype


def measure_cpu_peak(dtype: str, threads: int, max_size: int = 2048, repeats: int = 3, min_seconds: float = 0.05,
                     budget_s: float = 1.0) -> Peak:
    """This node's matmul peak now: square matmuls in `dtype` on `threads` threads (float8: torch._scaled_mm
    of e4m3 operands into float32, as model.fp8 runs them on FP8 units), in about `budget_s` seconds on any CPU.
    The size doubles from 64 while the next size's `repeats` products are predicted (8x the last time) to fit
    in what is left of the budget, until one product takes `min_seconds` (long enough to time well; float8 grows
    as far as the budget allows: a CPU converts FP8 in software, so a small product reads far low) or the size
    reaches max_size; the best of the last size's products counts. The operands are built without any random
    generator, so the training RNG is untouched; nothing is written."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    start, size = time.perf_counter(), 64
    try:
        while True:
            a, b = _operands(size, dtype)
            times = []
            for _ in range(repeats):   # the first product at a size warms up (thread pool, caches): the best counts
                times.append(_timed_mm(a, b))
                if time.perf_counter() - start > budget_s:
                    break
            left = budget_s - (time.perf_counter() - start)
            timed_well = min(times) >= min_seconds and dtype != "float8"
            if size >= max_size or timed_well or 8 * min(times) * repeats > left:
                break
            size *= 2
    finally:
        torch.set_num_threads(previous)
    tflops = 2.0 * size ** 3 / min(times) / 1e12
    return Peak(tflops, f"measured: best of {len(times)} {size}x{size} {dtype} matmuls on {threads} threads")


def _operands(size: int, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    torch_dtype = {"bfloat16": torch.bfloat16, "float8": torch.float8_e4m3fn}.get(dtype, torch.float32)
    a = torch.linspace(-1.0, 1.0, size * size).reshape(size, size).to(torch_dtype)
    return a, (a.t().contiguous().t() if dtype == "float8" else a.t().contiguous())   # _scaled_mm: b column-major


def _timed_mm(a: torch.Tensor, b: torch.Tensor) -> float:
    one = torch.ones((), dtype=torch.float32)   # float8's scales, made outside the timing
    start = time.perf_counter()
    if a.dtype == torch.float8_e4m3fn:
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
    else:
        torch.mm(a, b)
    return time.perf_counter() - start


_FORK = {"safe": True}   # False once a forked child hung in its first parallel op: measured here from then on
READY_S = 3.0   # a forked child answers its first parallel op within this, or it hangs


def measure_apart(dtype: str, threads: int) -> Peak:
    """measure_cpu_peak in a forked child process, so that this one answers signals throughout and starts no
    OpenMP threads (see the module docstring); the figure comes back as JSON over a pipe. A process that has run
    parallel ops already (a test session, a notebook) would hang that child: the child proves its first parallel
    op within READY_S, and otherwise the measurement is made here (so too where fork is not offered)."""
    if not _FORK["safe"] or "fork" not in mp.get_all_start_methods():
        return measure_cpu_peak(dtype, threads)
    context = mp.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_measure_and_send, args=(send, dtype, threads), daemon=True)
    child.start()
    send.close()
    try:
        if _receive(receive, child, READY_S) is None:
            _FORK["safe"] = False
            return measure_cpu_peak(dtype, threads)
        measured = _receive(receive, child, None)
        if measured is None:
            raise RuntimeError(f"the {dtype} peak measurement's process ended with code {child.exitcode}")
        return Peak(measured["tflops"], measured["source"])
    finally:
        receive.close()
        if child.is_alive():
            child.kill()
        child.join()


def _receive(receive, child, timeout_s: float | None) -> dict | None:
    """The child's next message, waited for in short polls (a signal's handler runs between them); None when it
    does not come within `timeout_s` or the child has ended."""
    deadline = None if timeout_s is None else time.perf_counter() + timeout_s
    while not receive.poll(0.05):
        if not child.is_alive() and not receive.poll(0):
            return None
        if deadline is not None and time.perf_counter() > deadline:
            return None
    return json.loads(receive.recv_bytes())


def _measure_and_send(send, dtype: str, threads: int) -> None:
    code = 1
    try:
        torch.set_num_threads(threads)
        torch.ones(1 << 20).sum()   # a parallel op: where this process's parent had run some, it hangs here
        send.send_bytes(b"{}")
        peak = measure_cpu_peak(dtype, threads)
        send.send_bytes(json.dumps({"tflops": peak.tflops, "source": peak.source}).encode())
        code = 0
    except BaseException:   # noqa: BLE001 - a stop signal or a failure: the parent sees the exit
        pass
    os._exit(code)


def node_peak(dtype: str, threads: int, cache_path: str | None = None) -> Peak:
    """The node's CPU peak: the best this machine ever measured for the same CPU, threads and dtype, measured again
    now (in a child process) unless today's figure is stable already. Each machine keeps the best figure it ever
    measured, per (host, CPU model, threads, dtype), in `$XDG_CACHE_HOME/nanoexp/peaks.json` (~/.cache by default),
    refreshed when a new measurement beats it; the peak is the better of the cached and the new figure, and its
    source says which. Each start measures again until today's figure is stable, its two best measurements of the
    day within STABLE of each other (or DAILY_MEASUREMENTS made: a machine always busy settles no better); from then
    on that day's starts take the best without measuring (a second sooner). A first start on a busy machine reads
    low, and the next idle start replaces it: a busy minute does not spoil the day's MFU."""
    path = cache_path or default_cache_path()
    key = f"{platform.node()} | {cpu_model()} | {threads} threads | {dtype}"
    cache, today = read_cache(path), datetime.date.today().isoformat()
    best = cache.get(key)
    figures = best.get("figures", []) if best is not None and best.get("measured") == today else []
    if best is not None and is_stable(figures):
        return Peak(best["tflops"], f"this machine's best {dtype} measurement on {threads} threads ({best['date']}, "
                    f"kept in {path}; today's figure is stable, not measured again today)")
    now = measure_apart(dtype, threads)
    if best is None or now.tflops > best["tflops"]:
        best = {"tflops": now.tflops, "date": today}
    cache[key] = {"tflops": best["tflops"], "date": best["date"], "measured": today,
                  "figures": sorted(figures + [now.tflops], reverse=True)}   # today's, best first
    write_cache(path, cache)
    if math.isclose(best["tflops"], now.tflops):
        return Peak(now.tflops, f"{now.source} (this machine's best so far, kept in {path})")
    return Peak(best["tflops"], f"this machine's best {dtype} measurement on {threads} threads ({best['date']}, "
                f"kept in {path}); now {now.tflops:.3g} TFLOP/s ({now.source.removeprefix('measured: ')})")


def is_stable(figures: list[float]) -> bool:
    """Whether a day's measurements (best first) settle its figure: the two best within STABLE of each other, or
    DAILY_MEASUREMENTS of them."""
    return len(figures) >= DAILY_MEASUREMENTS or (len(figures) >= 2 and figures[1] >= (1 - STABLE) * figures[0])


def mfu_peak(dtype: str, peak: Peak, float32: Peak) -> Peak:
    """The CPU peak MFU divides by: `peak`, except for FP8 products slower than SLOW_DTYPE of `float32`'s (a CPU has
    no FP8 units: torch._scaled_mm runs in software there), against which an MFU means nothing; that peak is
    withheld (tflops None) and its source says why."""
    if dtype != "float8" or not peak.tflops or peak.tflops >= SLOW_DTYPE * float32.tflops:
        return peak
    return Peak(None, f"none: this CPU's float8 matmuls run in software at {peak.tflops * 1e3:.3g} GFLOP/s, "
                f"{float32.tflops / peak.tflops:.0f}x slower than float32's, so no MFU is reported (it would measure "
                "against no FP8 units); model.fp8.emulate=null computes in float32 and reports it")


def slow_dtype_warning(dtype: str, peak: Peak, float32: Peak) -> str | None:
    """A warning when `dtype`'s CPU peak is far below `float32`'s on this machine (no native bf16), else None."""
    if dtype == "float32" or not peak.tflops or peak.tflops >= SLOW_DTYPE * float32.tflops:
        return None
    key, fix = ("model.fp8.emulate=false", "model.fp8.emulate=null") if dtype == "float8" else \
        (f"model.dtype={dtype}", "model.dtype=float32")
    return (f"{key}: this CPU's {dtype} matmuls run at {peak.tflops * 1e3:.3g} GFLOP/s, "
            f"{float32.tflops / peak.tflops:.0f}x slower than float32's {float32.tflops * 1e3:.3g} (no native "
            f"{dtype} here): training will be that much slower; {fix} is faster on this machine")


def cpu_model() -> str:
    """The CPU's model name (Linux), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def default_cache_path() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "nanoexp", "peaks.json")


def read_cache(path: str) -> dict:
    try:
        with open(path) as f:
            cache = json.load(f)
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        return {}


def write_cache(path: str, cache: dict) -> None:
    """Atomically (concurrent runs on one machine), and never fatal: a read-only home only loses the cache."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(cache, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass
