"""model.dtype as a context: float32 runs as written; bfloat16 runs the forward under autocast (weights, gradients
and optimizer state stay float32), so matmuls and attention take bf16 inputs and norms, softmax and the loss keep
float32. On CUDA, float32 matmuls use TF32 tensor cores (10-bit mantissa inputs, float32 accumulation) unless
model.allow_tf32=false: without them a float32 run takes the GPU's plain FP32 path, several times slower.

On a CPU, denormals (values below float32's smallest normal, 1.2e-38) are flushed to zero (model.flush_denormals):
training makes them (values decaying towards 0), and many CPUs compute them tens of times slower than normal
numbers, so a run slowed down as it trained (docs/performance.md)."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os

import torch


def autocast(cfg, device: torch.device):
    """The context every forward runs in."""
    if cfg.model.dtype == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def tf32_enabled(cfg, device: torch.device) -> bool:
    """Whether float32 matmuls run in TF32: model.allow_tf32, whose null means on CUDA."""
    allowed = cfg.model.allow_tf32
    return device.type == "cuda" and (allowed is None or bool(allowed))


def set_tf32(cfg, device: torch.device) -> bool:
    """Apply model.allow_tf32 to this process's CUDA matmuls and convolutions; returns whether TF32 is on."""
    enabled = tf32_enabled(cfg, device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled
    return enabled


def flushes_denormals(cfg, device: torch.device) -> bool:
    """Whether a run on `device` flushes denormals to zero: model.flush_denormals, on a CPU (a GPU's kernels keep
    their own rules)."""
    return device.type == "cpu" and bool(cfg.model.get("flush_denormals", True))


@contextlib.contextmanager
def denormals_flushed(cfg, device: torch.device):
    """The block computes with denormals flushed to zero where `flushes_denormals` says so, on every thread of this
    process; the mode the process had before comes back after."""
    if not flushes_denormals(cfg, device):
        yield
        return
    before = flushing_now()
    set_flush_denormal_everywhere(True)
    try:
        yield
    finally:
        set_flush_denormal_everywhere(before)


def flushing_now() -> bool:
    """Whether this thread flushes denormals: 1e-30 x 1e-10 (1e-40, a float32 denormal) comes out 0."""
    return (torch.tensor([1e-30]) * 1e-10).item() == 0.0


_PARALLEL_BODY = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def set_flush_denormal_everywhere(on: bool) -> None:
    """torch.set_flush_denormal(on) on this thread and on each of torch's OpenMP threads. The mode is each thread's
    own (the x86 MXCSR register) and torch sets the calling thread's only, so the OpenMP threads that compute half
    of every parallel op would keep theirs; OpenMP's own entry point (GOMP_parallel, what `#pragma omp parallel`
    compiles to) runs the call on each of them. Threads started later copy the mode of the thread starting them."""
    torch.set_flush_denormal(on)
    openmp = _openmp_runtime()
    if openmp is None or torch.get_num_threads() == 1:
        return
    body = _PARALLEL_BODY(lambda _: torch.set_flush_denormal(on))   # runs on each thread, holding the GIL briefly
    openmp.GOMP_parallel(body, None, torch.get_num_threads(), 0)


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (GNU libgomp; LLVM's and Intel's offer the same GOMP_parallel), found in this
    process's memory map (Linux), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "/" in line})
    except OSError:
        return None
    for path in paths:
        if os.path.basename(path).startswith(("libgomp", "libomp", "libiomp5")):
            library = ctypes.CDLL(path)
            if hasattr(library, "GOMP_parallel"):
                library.GOMP_parallel.argtypes = [_PARALLEL_BODY, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
                library.GOMP_parallel.restype = None
                return library
    return None
