"""Initial weights that do not depend on the layout, each rank drawing only what it keeps.

Every matrix is drawn from normal(0, std) (µP scales std by the parameter's group, mup.py); norm weights are
ones. So that any layout trains the same model, a value must not depend on which rank draws it: the full tensor
is cut along its split dimension (placement.split_dim: the one tensor parallelism divides; dimension 0 for a
replicated one) into slabs of SLAB indices, and slab j is drawn from its own generator, seeded by (seed, the
name of the values the parameter holds, j). A rank draws only the slabs its slice overlaps: 1/tp of the tensor
plus at most one partial slab at each end, never the full tensor. A stacked routed-expert tensor is drawn
expert by expert, each matrix under its own name (placement.expert_values), so an expert's values do not depend on
which rank holds it, nor on how many experts share its tensor.
"""
from __future__ import annotations

import zlib

import torch

from nanoexp.model.mup import STANDARD, Parametrization
from nanoexp.model.placement import expert_values, placement, value_name

SLAB = 64   # indices of the split dimension a generator draws: 64 rows of a 2048-wide matrix are 0.5 MB


def slab_generator(seed: int, name: str, slab: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{name}#{slab}".encode()))


def draw_slab(shape: tuple[int, ...], std: float, generator: torch.Generator) -> torch.Tensor:
    """One slab's normal values, split dimension first."""
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def fill_normal(out: torch.Tensor, dim: int, lo: int, full_size: int, std: float, seed: int, name: str) -> None:
    """Fill `out`, indices [lo, lo + out.shape[dim]) along `dim` of the full tensor `name` (full_size long
    there), slab by slab: only the slabs it overlaps are drawn, and no more than one exists at a time. The same
    indices get the same values whatever the slice they are drawn in."""
    hi = lo + out.shape[dim]
    rest = tuple(size for d, size in enumerate(out.shape) if d != dim)
    # The generators draw on the host: the slabs fill a host copy, which reaches a GPU in one copy per tensor
    # (not one blocking copy per slab: ~60k of them for an 8B model).
    staging = out if out.device.type == "cpu" else torch.empty(out.shape, dtype=out.dtype)
    for j in range(lo // SLAB, (hi - 1) // SLAB + 1):
        start = j * SLAB
        slab = draw_slab((min(SLAB, full_size - start), *rest), std, slab_generator(seed, name, j))
        a, b = max(lo, start), min(hi, start + slab.shape[0])
        staging.narrow(dim, a - lo, b - a).copy_(slab[a - start:b - start].movedim(0, dim))
    if staging is not out:
        out.copy_(staging)


@torch.no_grad()
def init_weights(model, std: float, seed: int, parametrization: Parametrization = STANDARD) -> None:
    """Fill every parameter of this rank's shard: norm weights ones, matrices normal with std `std` (under µP
    scaled by their width), this rank's tensor-parallel slice of each drawn as the module docstring says."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        experts = expert_values(name, param)
        if experts is not None:   # [E, rows, columns]: each expert's matrix as a replicated one of its name
            for matrix, source in zip(param, experts):
                fill_normal(matrix, 0, 0, matrix.shape[0], parametrization.init_std(source, 2, std), seed, source)
            continue
        where, source = placement(param), value_name(name, param)
        dim, parts, part = (0, 1, 0) if where.split_dim is None else (where.split_dim, where.parts, where.part)
        size = param.shape[dim] * parts
        fill_normal(param, dim, part * param.shape[dim], size, parametrization.init_std(source, param.ndim, std),
                    seed, source)
