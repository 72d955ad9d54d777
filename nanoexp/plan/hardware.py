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
~10 µs across InfiniBand), not datasheet numbers.

"cpu" is this machine, calibrated (`calibrate_cpu`): the matmul peak of nanoexp/observe/peak.py and the bandwidth of
a gloo all-reduce between two local processes, measured by a short micro-benchmark.
"""
from __future__ import annotations

import dataclasses
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
    cuda_context_gb: float = 1.0   # CUDA context and library workspaces (memory.CUDA_CONTEXT_MB)
    # CPU only (0 on GPUs): what eager Python and gloo add on a CPU, fitted by benchmarks/bench_plan_cpu.py
    step_overhead_s: float = 0.0          # per optimizer step (the update's and the loop's Python)
    micro_batch_overhead_s: float = 0.0   # per micro-batch and layer a rank runs (module calls, autograd)
    message_us: float = 0.0               # per blocking message: tp's collectives, ring attention's hops, pp's sends

    def peak_tflops(self, fp8: bool = False) -> float:
        return self.fp8_tflops if fp8 else self.bf16_tflops


GPUS = {
    "h100": Hardware("H100 SXM", 989.0, 1979.0, 80.0, 3350.0, 450.0, 50.0),
    "h200": Hardware("H200 SXM", 989.0, 1979.0, 141.0, 4800.0, 450.0, 50.0),
    "a100": Hardware("A100 80GB SXM", 312.0, 312.0, 80.0, 2039.0, 300.0, 25.0),
    "b200": Hardware("B200", 2250.0, 4500.0, 180.0, 8000.0, 900.0, 50.0),
}


def hardware(name: str) -> Hardware:
    """The table's entry for `name` (h100, h200, a100, b200, or cpu: calibrated on this machine now).
    KeyError naming the known ones otherwise."""
    key = name.lower()
    if key == "cpu":
        return calibrate_cpu()
    if key not in GPUS:
        raise KeyError(f"unknown gpu {name!r}: one of {', '.join([*GPUS, 'cpu'])}")
    return GPUS[key]


def with_network(hw: Hardware, inter_gbps: float) -> Hardware:
    """The same device with another network bandwidth per GPU (what-if studies, tests)."""
    return dataclasses.replace(hw, inter_gbps=inter_gbps)


def cpu_share(hw: Hardware, processes: int, cpus: int) -> Hardware:
    """One of `processes` local ranks of a calibrated CPU: they share its `cpus` cores, so each gets
    min(1, cpus / processes) of the node's compute and memory bandwidth (calibrate_cpu measures the whole node),
    and its Python overheads (single-threaded) stretch once there are more ranks than cores."""
    share, stretch = min(1.0, cpus / max(processes, 1)), max(1.0, processes / cpus)
    return dataclasses.replace(hw, bf16_tflops=hw.bf16_tflops * share, fp8_tflops=hw.fp8_tflops * share,
                               memory_gbps=hw.memory_gbps * share, step_overhead_s=hw.step_overhead_s * stretch,
                               micro_batch_overhead_s=hw.micro_batch_overhead_s * stretch)


def gloo_all_reduce_gbps(numel: int = 1 << 20, repeats: int = 5) -> float:
    """Bus bandwidth (GB/s of what each rank sends, comm_counter's ring rule) of a float32 all-reduce between two
    local gloo processes: the best of `repeats`."""
    import multiprocessing as mp

    from nanoexp.launch.workers import free_port

    context = mp.get_context("fork")
    queue, port = context.Queue(), free_port()
    procs = [context.Process(target=_gloo_worker, args=(r, port, numel, repeats, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    seconds = min(queue.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=10)
    sent = 2 * (2 - 1) / 2 * 4 * numel   # all-reduce of n=2: (n-1)/n x 2 x the tensor
    return sent / seconds / GB


def _gloo_worker(rank: int, port: int, numel: int, repeats: int, queue) -> None:
    import os
    import time

    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x, best = torch.ones(numel), float("inf")
    for _ in range(repeats + 1):   # the first call sets up the connection
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        best = min(best, time.perf_counter() - start)
    dist.destroy_process_group()
    queue.put(best)


def calibrate_cpu(threads: int | None = None) -> Hardware:
    """This machine as a device: float32 and bfloat16 matmul peaks (peak.node_peak, cached a day) and the gloo
    bandwidth between two local processes (a ~1 s micro-benchmark), used for links inside and between 'nodes'."""
    import os

    import psutil

    from nanoexp.observe.peak import node_peak

    threads = threads or os.cpu_count() or 1
    bf16 = node_peak("bfloat16", threads).tflops
    fp32 = node_peak("float32", threads).tflops
    link = gloo_all_reduce_gbps()
    memory = psutil.virtual_memory().total / GB
    return Hardware("this CPU", max(bf16, fp32), max(bf16, fp32), memory, 10.0, link, link,
                    intra_latency_us=50.0, inter_latency_us=50.0, cuda_context_gb=0.0)
