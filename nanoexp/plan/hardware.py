"""What a GPU (or this CPU) can do, per device: the figures the cost model divides FLOPs and bytes by.

Datasheet figures, dense (no 2:4 sparsity: the datasheets' sparse tensor-core figures halved), per GPU:
- H100 SXM, H200 SXM: NVIDIA "H100 Tensor Core GPU" and "H200 Tensor Core GPU" datasheets: bf16 989, fp8 1979
  TFLOP/s; HBM 80 GB at 3.35 TB/s (H200: 141 GB at 4.8 TB/s); NVLink 4 900 GB/s both ways (450 each way).
- A100 80GB SXM: "A100 Tensor Core GPU" datasheet: bf16 312 TFLOP/s, no FP8 (fp8 runs at bf16's rate); HBM2e
  2,039 GB/s; NVLink 3 600 GB/s both ways.
- B200 (DGX B200 datasheet, per GPU of 8): fp8 72 PFLOP/s sparse for 8 GPUs, i.e. 4.5 PF dense each, bf16 2.25 PF
  dense; 1,440 GB of HBM3e in all (180 GB each) at 64 TB/s (8 TB/s each); NVLink 5 1.8 TB/s both ways.
Between nodes every GPU has its own NIC: 400 Gb/s InfiniBand/RoCE (ConnectX-7) = 50 GB/s each way (A100 systems
HDR 200 Gb/s = 25 GB/s). Latencies are typical NCCL small-message figures (a few µs inside a node over NVLink,
~10 µs across InfiniBand), not datasheet numbers. "cpu" is this machine, calibrated (`calibrate_cpu`): the matmul
peak of nanoexp/observe/peak.py and the rates of gloo's all-reduce, reduce-scatter and all-gather between two
local processes, measured by a short micro-benchmark.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    name: str
    bf16_tflops: float         # dense matmul peak (also what MFU divides by)
    fp8_tflops: float
    memory_gb: float           # HBM per GPU (decimal GB, as datasheets print it)
    memory_gbps: float         # HBM bandwidth, GB/s
    intra_gbps: float          # NVLink per GPU, each way, GB/s
    inter_gbps: float          # network per GPU, each way, GB/s
    intra_latency_us: float = 3.0
    inter_latency_us: float = 10.0
    cuda_context_gb: float = 1.0   # per process, fixed: the CUDA context and workspaces (on a CPU: Python and torch)
    cores: int = 0                 # a CPU node of this many cores, shared by its local ranks (0: a GPU, one a rank)
    # A measured device (a CPU) states its own efficiencies; None: the cost model's GPU figures (cost.py)
    gemm_efficiency: float | None = None        # share of the peak its matmuls reach at a model's sizes
    attention_efficiency: float | None = None   # causal SDPA forward and backward's share of the peak
    rates: tuple = ()   # CPU: (threads, matmul TFLOP/s, eager elementwise GB/s, attention TFLOP/s) per thread count
    overlaps_comm: bool = True   # False on a CPU: gloo moves the bytes on the cores that compute, nothing hides
    # CPU only (0 on GPUs): what eager Python and gloo add on a CPU, fitted by benchmarks/bench_plan_cpu.py
    step_overhead_s: float = 0.0          # per optimizer step (the update's and the loop's Python)
    micro_batch_overhead_s: float = 0.0   # per micro-batch and layer a rank runs (module calls, autograd)
    message_us: float = 0.0               # per blocking message: tp's collectives, ring attention's hops, pp's sends
    # (collective, its bytes' rate over the all-reduce's): measured on gloo, whose reduce-scatter runs at a fraction
    # of its all-reduce's rate; empty on GPUs (NCCL's rings move each collective's bytes at one bus bandwidth)
    collective_speed: tuple = ()
    cpu: bool = False              # this machine, calibrated (calibrate_cpu), not a GPU of the table
    # eager PyTorch's host time an op on a GPU's host: its dispatch, 2.5 us measured here for an add_ on a CPU tensor
    # (benchmarks/bench_plan_speed.py --host), plus a CUDA launch's few us (NVIDIA, "Getting Started with CUDA
    # Graphs", 2019); 0 on a CPU, whose host costs are the fitted overheads above
    launch_us: float = 6.0

    def peak_tflops(self, fp8: bool = False) -> float:
        return self.fp8_tflops if fp8 else self.bf16_tflops

    @property
    def fp8_units(self) -> bool:
        """Whether it multiplies FP8 operands faster than bf16 ones (an A100 or a CPU does not: fp8 = bf16)."""
        return self.fp8_tflops > self.bf16_tflops

    def slowdown(self, shares: dict[str, float]) -> float:
        """Time of a group's bytes, sent in these shares by collective, over the time at the all-reduce's rate."""
        speed = dict(self.collective_speed)
        return sum(share / speed.get(kind, 1.0) for kind, share in shares.items()) if shares else 1.0


GPUS = {
    "h100": Hardware("H100 SXM", 989.0, 1979.0, 80.0, 3350.0, 450.0, 50.0),
    "h200": Hardware("H200 SXM", 989.0, 1979.0, 141.0, 4800.0, 450.0, 50.0),
    "a100": Hardware("A100 80GB SXM", 312.0, 312.0, 80.0, 2039.0, 300.0, 25.0),
    "b200": Hardware("B200", 2250.0, 4500.0, 180.0, 8000.0, 900.0, 50.0),
}


def hardware(name: str, dtype: str = "float32") -> Hardware:
    """The table's entry for `name` (h100, h200, a100, b200, or cpu: calibrated on this machine now, for a run in
    `dtype`; a GPU's figures are bf16's, at which its runs compute). KeyError naming the known ones otherwise."""
    key = name.lower()
    if key == "cpu":
        return calibrate_cpu(dtype=dtype)
    if key not in GPUS:
        raise KeyError(f"unknown gpu {name!r}: one of {', '.join([*GPUS, 'cpu'])}")
    return GPUS[key]


def with_network(hw: Hardware, inter_gbps: float) -> Hardware:
    """The same device with another network bandwidth per GPU (what-if studies, tests)."""
    return dataclasses.replace(hw, inter_gbps=inter_gbps)


def cpu_share(hw: Hardware, processes: int, cpus: int) -> Hardware:
    """One of `processes` local ranks of a calibrated CPU node of `cpus` cores: nanoexp gives each rank
    cpus // processes threads, or one thread time-sliced once there are more ranks than cores. Its matmul,
    elementwise and attention rates are the node's measured at that many threads (`rates`; interpolated between
    the thread counts measured), times the share of a core it gets; it holds 1 / processes of the memory, and its
    Python overheads (single-threaded) stretch past one rank a core. The result is one rank's device (cores 0):
    sharing it again changes nothing."""
    threads, time_share = max(1, cpus // max(processes, 1)), min(1.0, cpus / max(processes, 1))
    stretch = max(1.0, processes / cpus)
    matmul, elementwise, attention = (x * time_share for x in rates_at(dataclasses.replace(hw, cores=cpus), threads))
    return dataclasses.replace(hw, bf16_tflops=matmul, fp8_tflops=matmul, memory_gbps=elementwise,
                               attention_efficiency=attention / matmul, memory_gb=hw.memory_gb / max(processes, 1),
                               step_overhead_s=hw.step_overhead_s * stretch,
                               micro_batch_overhead_s=hw.micro_batch_overhead_s * stretch, cores=0)


def rates_at(hw: Hardware, threads: int) -> tuple[float, float, float]:
    """(matmul TFLOP/s, elementwise GB/s, attention TFLOP/s) of `threads` threads: the measured row, linear between
    two, the nearest beyond them; without rates, the node's figures (all its cores) shared evenly by its cores."""
    rows = sorted(hw.rates)
    if not rows:
        share = min(threads, hw.cores or threads) / (hw.cores or threads)
        return hw.bf16_tflops * share, hw.memory_gbps * share, hw.bf16_tflops * (hw.attention_efficiency or 1) * share
    for (t0, *low), (t1, *high) in itertools.pairwise(rows):
        if t0 <= threads <= t1:
            w = (threads - t0) / (t1 - t0)
            return tuple(a + w * (b - a) for a, b in zip(low, high))
    return tuple((rows[0] if threads < rows[0][0] else rows[-1])[1:])


def per_rank(hw: Hardware, processes: int) -> Hardware:
    """What one of a layout's `processes` ranks has: a GPU its own, a CPU node (cores > 0) its share (cpu_share)."""
    return cpu_share(hw, processes, hw.cores) if hw.cores else hw


COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def gloo_rates(numel: int = 1 << 22, repeats: int = 5) -> dict[str, float]:
    """{collective: GB/s of what each rank sends (comm_counter's ring rule)} of float32 all-reduce, reduce-scatter
    and all-gather over a tensor of `numel` (16 MB: a small model's layer or ZeRO unit) between two local gloo
    processes, one thread each: the best of `repeats`."""
    import multiprocessing as mp
    import tempfile

    context = mp.get_context("fork")
    queue, folder = context.Queue(), tempfile.TemporaryDirectory()   # a file store: no port to find
    store = os.path.join(folder.name, "store")
    procs = [context.Process(target=_gloo_worker, args=(r, store, numel, repeats, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=10)
    folder.cleanup()
    sent = {"all_reduce": 4 * numel, "reduce_scatter": 2 * numel, "all_gather": 2 * numel}   # n = 2
    return {kind: sent[kind] / min(r[kind] for r in results) / GB for kind in COLLECTIVES}


def _gloo_worker(rank: int, store: str, numel: int, repeats: int, queue) -> None:
    import time

    import torch
    import torch.distributed as dist

    from nanoexp.parallel.collectives import all_gather_into, reduce_scatter_into
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    full, half = torch.ones(numel), torch.ones(numel // 2)
    calls = {"all_reduce": lambda: dist.all_reduce(full), "reduce_scatter": lambda: reduce_scatter_into(half, full, None),
             "all_gather": lambda: all_gather_into(full, half, None)}
    best = {}
    for kind, call in calls.items():
        best[kind] = float("inf")
        for _ in range(repeats + 1):   # the first call sets up the connection
            dist.barrier()
            start = time.perf_counter()
            call()
            best[kind] = min(best[kind], time.perf_counter() - start)
    dist.destroy_process_group()
    queue.put(best)


# Fitted by `python -m benchmarks.bench_plan_cpu --calibrate --idle` on an idle 2-core Intel Xeon VM, 2026-12-05
# 16:58-17:08 UTC (docs/planning.md, "This CPU"): eager Python's and gloo's costs on a CPU, which no datasheet gives
# (the message term fitted to zero once gloo's collectives got their measured rates). RUNTIME_GB: one process's
# Python, torch and warmed-up runtime (summary.json's baseline_memory_mb of that pass's one-process run).
CPU_OVERHEADS = dict(step_overhead_s=0.026, micro_batch_overhead_s=0.045, message_us=0.0)
CPU_RUNTIME_GB = 0.344


def calibrate_cpu(threads: int | None = None, dtype: str = "float32") -> Hardware:
    """This machine as a device for a run in `dtype`: the matmul peak of that dtype (peak.node_peak, cached a day),
    eager elementwise and attention rates (`measure_rates`), each at one thread and at all `threads`, and gloo's
    all-reduce bandwidth between two local processes (a ~1 s micro-benchmark, which also gives reduce-scatter's and
    all-gather's rates beside it: `collective_speed`), used for links inside and between 'nodes';
    the fitted overheads above. A layout's ranks share it (`per_rank`)."""
    import psutil

    from nanoexp.observe.peak import node_peak

    threads = threads or os.cpu_count() or 1
    gloo = gloo_rates()   # first: it forks, which a process that ran parallel ops cannot do safely
    link = gloo["all_reduce"]
    rates = tuple((t, node_peak(dtype, t).tflops, *best_rates(t, dtype)) for t in sorted({1, threads}))
    peak, elementwise, attention = rates[-1][1:]
    memory = psutil.virtual_memory().total / GB
    return Hardware("this CPU", peak, peak, memory, elementwise, link, link, intra_latency_us=50.0,
                    inter_latency_us=50.0, cuda_context_gb=CPU_RUNTIME_GB, cores=threads, gemm_efficiency=1.0,
                    overlaps_comm=False, cpu=True, launch_us=0.0,
                    attention_efficiency=attention / peak, rates=rates,
                    collective_speed=tuple((kind, gloo[kind] / link) for kind in COLLECTIVES[1:]), **CPU_OVERHEADS)


def best_rates(threads: int, dtype: str) -> tuple[float, float]:
    """measure_rates' figures, the best this machine has measured (kept in the matmul peak's cache,
    nanoexp/observe/peak.py): other load only slows a micro-benchmark, so the best is the machine's, and a
    prediction made beside other work does not drift with it."""
    import platform

    from nanoexp.observe.peak import cpu_model, default_cache_path, read_cache, write_cache

    path = default_cache_path()
    key = f"{platform.node()} | {cpu_model()} | {threads} threads | {dtype} | elementwise GB/s, attention TFLOP/s"
    cache = read_cache(path)
    now = measure_rates(threads, dtype)
    kept = cache.get(key, {}).get("rates", now)
    best = [max(a, b) for a, b in zip(now, kept)]
    cache[key] = {"rates": best}
    write_cache(path, cache)
    return tuple(best)


def measure_rates(threads: int, dtype: str = "float32", repeats: int = 10) -> tuple[float, float]:
    """(GB/s, TFLOP/s) on `threads` threads, best of `repeats`: an eager SwiGLU-like product, silu(x) * x at a
    small layer's width (counted as four tensors' bytes: x read twice, silu(x) written and read back), and causal
    SDPA's forward and backward at a small model's shape (batch 4, 8 heads, sequence 128, head 64; FLOPs counted
    as cost.py counts them: the causal half, the backward 2.5 forwards). The sizes of nanoexp's CPU runs, where
    eager overheads count."""
    import time

    import torch
    import torch.nn.functional as F

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kind = getattr(torch, dtype)
        x = torch.randn(4, 128, 1536, dtype=kind)
        elementwise = 4 * x.numel() * x.element_size() / best(lambda: F.silu(x) * x) / GB
        q = torch.randn(4, 8, 128, 64, dtype=kind, requires_grad=True)
        flops = 3.5 * 2 * 4 * 128 * 128 * 8 * 64
        attention = flops / best(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward())
    finally:
        torch.set_num_threads(before)
    return elementwise, attention / 1e12
