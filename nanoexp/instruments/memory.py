"""Per-rank memory as measured: the baseline a rank holds before its model, its peak (VmHWM on CPU,
`max_memory_allocated` on CUDA), the bytes autograd saves for backward, and the peak of the tensors a block
creates (LiveTensorPeak). How each is taken and why:
docs/memory.md."""
from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re

import psutil
import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

MB = 2**20
CUDA_CONTEXT_MB = 1024   # CUDA context + library workspaces: a nominal allowance (no GPU here to measure)


def _vm_hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            match = re.search(r"VmHWM:\s+(\d+) kB", f.read())
        return int(match.group(1)) * 1024 if match else None
    except OSError:
        return None


def return_freed_memory() -> None:
    """On CPU (glibc): allocate tensors of 128 KiB and more with mmap, so that freed memory goes back
    to the system. glibc otherwise raises that threshold as large blocks are freed and serves later
    ones from its heap, which keeps each step's freed activations: the peak RSS of `model=small`
    was 30-50 % above the live tensors that way (benchmarks/bench_memory.py). The price: every large
    tensor's pages are faulted in afresh, ~1.5x the step time of `model=small` on a 2-core VM."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)   # M_MMAP_THRESHOLD, fixed from now on
    except (OSError, AttributeError):   # not glibc: nothing to set
        pass


def warm_up_runtime(dtype: str = "float32") -> None:
    """One tiny training step of plain tensors (embedding, linear layers, attention, a norm, cross-entropy,
    backward, a foreach AdamW update, under bf16 autocast when `dtype` says so), so that what the compute
    runtime keeps once it has run (the kernels' code pages, thread pools, kernel caches: 26 MB a CPU rank after
    a step of a 0.7 MB model, 17 MB of it file-backed code, measured 2026-12-01) is resident when the baseline
    is taken: the baseline holds the runtime, the estimate the run's tensors. Draws no random numbers."""
    import torch.nn.functional as F

    def values(*shape):
        return torch.linspace(-0.1, 0.1, math.prod(shape)).reshape(shape).requires_grad_()

    embedding, weight, head = values(320, 64), values(64, 64), values(320, 64)
    ids = torch.arange(4 * 32).reshape(4, 32) % 320
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    with autocast:
        x = F.embedding(ids, embedding)
        x = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype)
        q = F.linear(x, weight).view(4, 32, 4, 16).transpose(1, 2)
        x = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(4, 32, 64)
        loss = F.cross_entropy(F.linear(F.silu(x), head).float().flatten(0, 1), ids.flatten())
    loss.backward()
    torch.optim.AdamW([embedding, weight, head], foreach=True).step()


def start_measuring(device: torch.device, dtype: str = "float32") -> float:
    """Reset this process's peak and return its current memory (MB): the runtime baseline, taken after a
    warm-up of the compute runtime on CPU (warm_up_runtime). It includes torch._dynamo, which torch imports on
    the first optimizer it builds (~70 MB)."""
    import torch._dynamo  # noqa: F401
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / MB
    warm_up_runtime(dtype)
    try:   # Linux: "5" resets the peak resident set size (VmHWM) to the current one
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return psutil.Process().memory_info().rss / MB


def peak_memory_mb(device: torch.device) -> float:
    """The peak since `start_measuring`: max allocated on CUDA; the high-water RSS on CPU (the
    current RSS where the system does not report one)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MB
    hwm = _vm_hwm_bytes()
    return (hwm if hwm is not None else psutil.Process().memory_info().rss) / MB


class _ByteCounter:
    def __init__(self):
        self.bytes = 0


@contextlib.contextmanager
def saved_activation_bytes(params):
    """Count the bytes of distinct storages that autograd saves for backward inside the block,
    leaving out the parameters' own storages (weights are kept anyway; only activations count).

        with saved_activation_bytes(model.parameters()) as saved:
            loss = model(...)
        saved.bytes   # activations held until backward

    Under activation recomputation (torch.utils.checkpoint, non-reentrant) only what the
    checkpoints keep is seen: the inner recomputed tensors are saved by checkpoint's own hooks.
    """
    params = list(params)
    seen: set[int] = set()
    counter = _ByteCounter()

    def pack(tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        # Asked at each save: ZeRO-3 gathers a layer's weights into fresh storage just before it runs.
        param_storages = {p.untyped_storage().data_ptr() for p in params}
        if ptr not in param_storages and ptr not in seen and storage.nbytes() > 0:
            seen.add(ptr)
            counter.bytes += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield counter

def runtime_baseline_mb(device_type: str, dtype: str = "float32") -> float:
    """The memory a rank holds before its model: this process's own RSS (Python, torch and
    nanoexp imported, the compute runtime warmed up as a rank's is), plus the nominal CUDA context on GPUs."""
    import torch._dynamo  # noqa: F401  (loaded by every run's first optimizer)
    warm_up_runtime(dtype)
    rss = psutil.Process(os.getpid()).memory_info().rss / MB
    return rss + (CUDA_CONTEXT_MB if device_type == "cuda" else 0)


class LiveTensorPeak(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among those the ops run inside the block create (counted after
    each op): what a forward and backward hold beyond what existed before (parameters, their gradients if already
    allocated). Counted from the tensors, not the allocator: the same number on any CPU (docs/memory.md).

        with LiveTensorPeak() as live:
            model(input_ids=ids, labels=ids).mean().backward()
        live.peak   # bytes
    """

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}   # a storage's address -> (weak reference, bytes)
        self.bytes = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for key in [key for key, (ref, _) in self.live.items() if ref.expired()]:
            self.bytes -= self.live.pop(key)[1]
        given = {t.untyped_storage()._cdata for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in (t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.device.type != "meta"):
            storage = tensor.untyped_storage()   # a view's, an in-place op's: its input's, not a new one
            if storage._cdata not in given and storage._cdata not in self.live and storage.nbytes() > 0:
                self.live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())   # its address kept
                self.bytes += storage.nbytes()
        self.peak = max(self.peak, self.bytes)
        return out
