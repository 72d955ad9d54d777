"""Peak memory of one attention forward and backward with a document mask and grouped K/V heads, three ways:
SDPA with the mask and enable_gqa=True on the fused kernel (what CPU runs, before and after); the same call on
the math kernel (what CUDA fell back to before: no CUDA fused kernel takes a mask with enable_gqa); and K/V
repeated with the mask (what nanoexp's SDPA kernel gives CUDA now, for its memory-efficient kernel; fused here).

    python benchmarks/bench_attention_memory.py                       # llama_1b's heads, sequence 4096, CPU
    python benchmarks/bench_attention_memory.py --sequence 8192 --dtype bfloat16

Each case runs in a fresh process; the figure is that process's peak RSS above its RSS after building the inputs
(CPU) or torch's peak allocated above the inputs (CUDA). Documents of 512 tokens; batch 1.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import resource

import torch
import torch.nn.functional as F

from torch.nn.attention import SDPBackend, sdpa_kernel

from nanoexp.model.attention import Documents, document_mask

CASES = ("enable_gqa with the mask, fused kernel (CPU)", "enable_gqa with the mask, math kernel (CUDA before)",
         "K/V repeated with the mask (CUDA now)")


def inputs(args, device):
    torch.manual_seed(0)   # every case's process draws the same inputs
    shape = (1, args.heads, args.sequence, args.head_dim)
    dtype = getattr(torch, args.dtype)
    q = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, args.kv_heads, args.sequence, args.head_dim, device=device, dtype=dtype,
                        requires_grad=True) for _ in range(2))
    positions = torch.arange(args.sequence, device=device)
    documents = Documents((positions // 512)[None], (positions % 512)[None])
    return q, k, v, documents


def case(name: str, args, results) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    q, k, v, documents = inputs(args, device)
    before_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before_mb = torch.cuda.memory_allocated() / 2**20
    mask = document_mask(documents.document_ids, documents.position_ids)
    if name == CASES[0]:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    elif name == CASES[1]:
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    else:
        group = args.heads // args.kv_heads
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                             attn_mask=mask)
    out.float().square().sum().backward()
    peak_mb = (torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda"
               else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    # numpy arrays travel by value (a tensor would travel as shared memory that dies with this process)
    results.put((name, peak_mb - before_mb, out.detach().float().cpu().numpy(), q.grad.float().cpu().numpy()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequence", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)       # llama_1b: 32 query heads, 8 KV heads, 64 wide
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    context = mp.get_context("spawn")
    results, outputs = context.Queue(), {}
    print(f"document mask (512-token documents), {args.heads} heads / {args.kv_heads} KV heads of {args.head_dim}, "
          f"sequence {args.sequence}, {args.dtype}, forward + backward")
    for name in CASES:
        process = context.Process(target=case, args=(name, args, results))
        process.start()
        name, peak_mb, out, grad = results.get()
        process.join()
        outputs[name] = (out, grad)
        print(f"| {name} | {peak_mb:,.0f} MB |")
    (out_a, grad_a), *others = outputs.values()
    print("largest difference from the first: " + "; ".join(
        f"output {abs(out_a - out).max():.2e}, q gradient {abs(grad_a - grad).max():.2e}" for out, grad in others))

if __name__ == "__main__":
    main()
