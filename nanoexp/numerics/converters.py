"""Number formats for the linears: each is a converter that replaces `Linear.matmul` on the layers it selects.

A format registers itself here with a test of the config (is it on?) and a function that converts a built model:
this rank's part, after the parallel dimensions were applied, so that it sees the sharded layers as they will run
and never needs to know how they communicate. Adding a format is its own file in nanoexp/numerics/ and its config
keys; nothing else changes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from nanoexp.model.linear import Linear


@dataclass(frozen=True)
class Converter:
    enabled: Callable[[object], bool]                # cfg -> whether this run uses the format
    convert: Callable[[str, Linear, object], None]   # (module name, layer, cfg): replace layer.matmul or leave it


CONVERTERS: dict[str, Converter] = {}


def convert_linears(model: nn.Module, cfg) -> list[str]:
    """Apply every enabled format to the model's Linear layers in registration order; the names it converted."""
    converted = []
    for converter in CONVERTERS.values():
        if not converter.enabled(cfg):
            continue
        for name, module in model.named_modules():
            if isinstance(module, Linear):
                before = module.matmul
                converter.convert(name, module, cfg)
                if module.matmul is not before:
                    converted.append(name)
    return converted
