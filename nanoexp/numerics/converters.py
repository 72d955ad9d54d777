"""Number formats for the linears: each is a converter that replaces `Linear.matmul` on the layers it selects.

A format registers a `Converter` in `CONVERTERS`: a test of the config (is it on?) and a function that converts
each Linear of this rank's part of the model after the parallel dimensions were applied. It sees the sharded layers
as they will run (a tensor-parallel layer's `axis`; the context, for the groups a tensor's elements are spread over,
e.g. to agree on a scale) and never needs to know how a layer communicates. A format is its own file in
nanoexp/numerics/, imported by nanoexp/numerics/__init__.py, and its config keys."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from nanoexp.model.linear import Linear


@dataclass(frozen=True)
class Converter:
    enabled: Callable[[object], bool]                # cfg -> whether this run uses the format
    convert: Callable[[str, Linear, object, object], None]   # (module name, layer, cfg, ParallelContext):
    #                                                            replace layer.matmul or leave it
    gather_format: Callable[[nn.Module, object], object] | None = None   # (converted model, cfg) -> how ZeRO-3
    #                                                 gathers the converted weights (parallel/zero/units.GatherFormat)
    product_dtype: Callable[[object, object], str] | None = None   # (cfg, device or None: the CPU) -> the dtype its
    #                                                 products run in, whose peak MFU is measured against
    gathered_bytes: Callable[[object], int | None] | None = None   # cfg -> bytes an element of ZeRO-3's gathers of
    #                                                 the layers' matrices (None: float32's 4), for the memory estimate
    console_line: Callable[[object, int, object, int], str] | None = None   # (cfg, linears converted on rank 0,
    #                                                 device, pp) -> the line the run's start prints about the format
    problems: Callable[[object], list[str]] | None = None   # cfg -> why its keys cannot run, one line each naming
    #                                                 the key (asked on or off: a key set for it while off is its own)
    planned_dtype: Callable[[object, bool], str] | None = None   # (cfg, whether the device has FP8 units) -> the
    #                                                 dtype its products run in on a device not here (the planner's)


CONVERTERS: dict[str, Converter] = {}


def convert_linears(model: nn.Module, cfg, ctx) -> list[str]:
    """Apply every enabled format to the model's Linear layers in registration order; the names it converted."""
    converted = []
    for converter in CONVERTERS.values():
        if not converter.enabled(cfg):
            continue
        for name, module in model.named_modules():
            if isinstance(module, Linear):
                before = module.matmul
                converter.convert(name, module, cfg, ctx)
                if module.matmul is not before:
                    converted.append(name)
    return converted


def gather_format(model: nn.Module, cfg):
    """The GatherFormat an enabled format offers for ZeRO-3's gathers of its weights, or None (float32)."""
    for converter in CONVERTERS.values():
        made = converter.gather_format(model, cfg) if converter.enabled(cfg) and converter.gather_format else None
        if made is not None:
            return made
    return None


def product_dtype(cfg, device=None) -> str | None:
    """The dtype the converted linears' products run in on `device` (they hold nearly all of the FLOPs), or None
    when no enabled format says (the products run in model.dtype)."""
    for converter in CONVERTERS.values():
        if converter.enabled(cfg) and converter.product_dtype:
            return converter.product_dtype(cfg, device)
    return None


def planned_product_dtype(cfg, fp8_units: bool) -> str | None:
    """product_dtype on a device that is not here, which has FP8 units or not (nanoexp/plan/cost.py prices a
    GPU from its datasheet), or None when no enabled format says (the products run in model.dtype)."""
    for converter in CONVERTERS.values():
        if converter.enabled(cfg) and converter.planned_dtype:
            return converter.planned_dtype(cfg, fp8_units)
    return None


def gathered_bytes(cfg) -> int | None:
    """Bytes an element of ZeRO-3's gathers of the decoder layers' matrices under an enabled format that gathers
    them narrower than float32, else None."""
    for converter in CONVERTERS.values():
        made = converter.gathered_bytes(cfg) if converter.enabled(cfg) and converter.gathered_bytes else None
        if made is not None:
            return made
    return None


def console_lines(cfg, converted: int, device=None, pp: int = 1) -> list[str]:
    """What each enabled format says at the start of a run (`converted`: linears it converted on rank 0)."""
    return [c.console_line(cfg, converted, device, pp) for c in CONVERTERS.values() if c.enabled(cfg) and c.console_line]


def format_problems(cfg) -> list[str]:
    """Why each format's keys cannot run this config (validation.py), one line each naming the key."""
    return [problem for c in CONVERTERS.values() if c.problems for problem in c.problems(cfg)]
