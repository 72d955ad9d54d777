"""model.fp8.gather_in_fp8: ZeRO-3 gathers a layer's FP8 weights in FP8, one byte per element instead of four (the
idea of torchao's float8 all-gather under FSDP2).

Each rank casts its shard of a unit with the scale one process would use: the amax of the whole weight, which is
the MAX of the amaxes of its pieces over the sharding group and then over the groups that split the weight (tp).
The cast is elementwise, so the gathered bytes are the bytes a cast of the whole weight gives, and the layer's
matmul takes them as its weight operand (`Fp8Matmul.precast`) instead of casting the float32 weight, which is
never gathered. Tensorwise only: a rowwise recipe casts the weight twice, with a scale per row for the forward
and per column for backward, so no single FP8 copy serves both. The unit's other parameters (the norms) are kept
whole (gradient_sync.py): a unit travels in one format.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nanoexp.parallel.zero.units import Unit


class Fp8Gather:
    """The GatherFormat (parallel/zero/units.py) of the weights of FP8 layers: `matmuls` maps id(weight) to its layer's
    Fp8Matmul (fp8.py), whose config and tp split give the cast and the groups its amax is reduced over."""
    dtype = torch.uint8   # FP8 bytes: every backend gathers uint8

    def __init__(self, matmuls: dict):
        self.matmuls = matmuls
        self.scales: dict[int, torch.Tensor] = {}   # id(unit) -> its weights' scales, from encode to decode

    def takes(self, param) -> bool:
        return id(param) in self.matmuls

    @torch.no_grad()
    def encode(self, unit: Unit, group) -> torch.Tensor:
        """This rank's shard of `unit` as FP8 bytes, each weight's elements cast with its whole scale (padding: 0)."""
        from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

        index = {id(p): i for i, p in enumerate(unit.params)}
        amax = torch.zeros(len(unit.params), dtype=torch.float32, device=unit.shard.device)
        for piece in unit.pieces():
            amax[index[id(piece.param)]] = tensor_to_amax(piece.value).float()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        for groups, members in self._by_split_groups(unit).items():
            for axis in groups:   # the groups splitting the weight: its shards' amaxes, as Fp8Matmul.scale reduces
                part = amax[members]
                dist.all_reduce(part, op=dist.ReduceOp.MAX, group=axis.group)
                amax[members] = part
        mm = self.matmuls[id(unit.params[0])]
        fp8_dtype = mm.config.cast_config_weight.target_dtype
        scales = self.scales[id(unit)] = amax_to_scale(amax, fp8_dtype, mm.config.round_scales_to_power_of_2)
        shard = torch.zeros(unit.shard_size, dtype=self.dtype, device=unit.shard.device)
        for piece in unit.pieces():
            start = unit.offsets[id(piece.param)] + piece.start - unit.shard_lo
            cast = hp_tensor_and_scale_to_float8(piece.value, scales[index[id(piece.param)]], fp8_dtype)
            shard[start:start + piece.end - piece.start] = cast._data.view(self.dtype)
        return shard

    def _by_split_groups(self, unit: Unit) -> dict[tuple, torch.Tensor]:
        """The unit's weights (their indices) by the groups (Axis) that split them, in the order of its parameters:
        every rank of a group posts the same all-reduces in the same order."""
        members: dict[tuple[str, ...], list[int]] = {}
        for i, p in enumerate(unit.params):
            names = tuple(dict.fromkeys(name for dim in self.matmuls[id(p)].dims["w"] for name in dim))
            if names:
                members.setdefault(names, []).append(i)
        return {tuple(self.matmuls[id(unit.params[ids[0]])].split.axes[name] for name in names): torch.tensor(ids)
                for names, ids in members.items()}

    def decode(self, unit: Unit) -> None:
        """Each layer's weight operand from the gathered bytes (unit.wire_values) and the scales encode agreed."""
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        scales = self.scales[id(unit)]
        for i, p in enumerate(unit.params):
            mm = self.matmuls[id(p)]
            data = unit.view(unit.wire_values, p).view(mm.config.cast_config_weight.target_dtype)
            mm.precast = Float8TrainingTensor(data, scales[i], p.dtype, mm.mm_config, GemmInputRole.WEIGHT)

    def release(self, unit: Unit) -> None:
        for p in unit.params:
            self.matmuls[id(p)].precast = None
