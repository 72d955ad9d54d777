"""Context parallelism, checked: the ring attention's messages as a plan for nanoexp.verify.p2p_plan.check, and
the inverse of the zig-zag split (the whole sequence from every cp rank's part)."""
from __future__ import annotations

import torch

from nanoexp.parallel.context_parallel.zigzag import zigzag_indices


def zigzag_gather(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every cp rank's part (parts[r] from rank r): the inverse of zigzag_split."""
    cp = len(parts)
    full = torch.cat(parts, dim)
    order = torch.cat([zigzag_indices(full.shape[dim], cp, r) for r in range(cp)])
    return full.index_select(dim, torch.argsort(order).to(full.device))


def ring_plan(cp: int, kv_nbytes: int = 0, grad_kv_nbytes: int = 0, named: bool = False) -> list:
    """The batches of one ring_attention forward and backward, per cp rank, as a plan for p2p_plan.check:
    ops ("send" | "recv", peer cp rank, nbytes). kv_nbytes is one K/V message (K and V stacked), grad_kv_nbytes
    one dK/dV accumulator (float32 or wider). named: each op carries a fourth item naming its message
    (pass, block owner, step), so that p2p_plan.check also proves every receive gets its intended block."""
    out = []
    for r in range(cp):
        nxt, prev = (r + 1) % cp, (r - 1) % cp

        def batch(step, *kinds, pass_):
            # before `step`, rank r sends what it held at step−1 and receives the block of rank r − step
            sends = [("send", nxt, nbytes, (pass_, kind, (r - step + 1) % cp, step)) for kind, nbytes in kinds]
            recvs = [("recv", prev, nbytes, (pass_, kind, (r - step) % cp, step)) for kind, nbytes in kinds]
            return sends + recvs

        kv, grad_kv = ("kv", kv_nbytes), ("grad_kv", grad_kv_nbytes)
        forward = [batch(t, kv, pass_="forward") for t in range(1, cp)]
        # backward: step 1's block; then per step the accumulator that travels with the block (from step 2), and
        # the next block, posted before this step's block computes; at step cp the accumulator goes home.
        backward = [batch(1, kv, pass_="backward")] if cp > 1 else []
        for t in range(1, cp):
            backward += [batch(t, grad_kv, pass_="backward")] if t > 1 else []
            backward += [batch(t + 1, kv, pass_="backward")] if t < cp - 1 else []
        backward += [batch(cp, grad_kv, pass_="backward")] if cp > 1 else []
        out.append([[op if named else op[:3] for op in b] for b in forward + backward])
    return out
