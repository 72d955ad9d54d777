"""FP8 linears (model.fp8): torchao's casts, scales and scaled matmuls in an autograd function of nanoexp's own,
so that every layout computes what one process computes.

A dynamic scale is the amax of the tensor one process would see: the whole tensor (tensorwise) or each row or
column along the matmul's inner dimension (rowwise). A rank holds a shard of some of those tensors, so each
amax is computed locally and all-reduced with MAX over exactly the groups that split the dimensions it spans
(`Split`, read from how the layer is placed). Data and pipeline parallelism need none: one process runs the
same micro-batches one at a time. The table of which group reduces which amax is in docs/fp8.md.

Where the device has no FP8 units (a CPU; a GPU below compute capability 8.9) the products are emulated by default
(model.fp8.emulate): torchao's `emulate` setting multiplies the same FP8 operands, with the same scales, in float32
instead of calling `torch._scaled_mm`, whose CPU speed depends on the CPU (docs/fp8.md).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanoexp.config import ConfigError
from nanoexp.numerics.converters import CONVERTERS, Converter
from nanoexp.parallel.context import Axis
from nanoexp.model.placement import placement

RECIPES = ("tensorwise", "rowwise")   # torchao's recipe names (Float8LinearConfig.from_recipe_name)


def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def import_float8() -> None:
    """Import torchao.float8 and the modules of it nanoexp uses (on first use only: seconds), without their
    import-time warnings (optional kernels float8 training does not use, a deprecation inside torchao). The
    submodules are imported here too: float8_training_tensor pulls in torchao.quantization, which warns."""
    logs = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        for module in ("torchao.float8", "torchao.float8.float8_training_tensor", "torchao.float8.float8_utils",
                       "torchao.float8.config"):
            importlib.import_module(module)
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


FP8_UNITS = (8, 9)   # the CUDA compute capability from which GPUs multiply FP8 in hardware (Ada, Hopper and later)


def has_fp8_units(device: torch.device) -> bool:
    """Whether `device` multiplies FP8 operands in hardware: a CUDA GPU of compute capability >= 8.9."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_UNITS


def emulated(cfg, device: torch.device | None = None) -> bool:
    """Whether the FP8 products are emulated in float32: model.fp8.emulate, whose null means wherever `device`
    (default: the CPU) has no FP8 units. A GPU without them cannot run torch._scaled_mm: forcing it there is a
    ConfigError (known only where the GPU is)."""
    device = device or torch.device("cpu")
    forced = getattr(cfg.model.fp8, "emulate", None)   # absent from configs saved before the key existed
    if forced is None:
        return emulates(cfg, has_fp8_units(device))
    if not forced and device.type == "cuda" and not has_fp8_units(device):
        capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ConfigError(f"model.fp8.emulate=false needs FP8 units, which {torch.cuda.get_device_name(device)} "
                          f"(compute capability {capability}, below 8.9) lacks: set model.fp8.emulate=null")
    return bool(forced)


def emulates(cfg, fp8_units: bool) -> bool:
    """Whether the products are emulated on a device with (or without) FP8 units: model.fp8.emulate, whose null
    means where there are none."""
    forced = getattr(cfg.model.fp8, "emulate", None)
    return not fp8_units if forced is None else bool(forced)


def planned_dtype(cfg, fp8_units: bool) -> str:
    """product_dtype on a device that is not here (the planner's): float8 on FP8 units, else emulated in float32."""
    return "float32" if emulates(cfg, fp8_units) else "float8"


def float8_config(recipe: str, emulate: bool):
    """torchao's Float8LinearConfig of `recipe`, its products emulated in float32 (`emulate`: the FP8 operands
    and scales as on hardware, multiplied by torch.mm) or run by torch._scaled_mm."""
    import_float8()
    from torchao.float8 import Float8LinearConfig
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)


@dataclass(frozen=True)
class Split:
    """The groups (by name, in `axes`) that split each dimension of a layer's matmul y[M, N] = x[M, K] W[N, K]^T."""
    rows: tuple[str, ...] = ()    # M, tokens: cp; tp where sequence parallelism gives the layer part of them
    out: tuple[str, ...] = ()     # N: tp of a column-parallel layer
    inner: tuple[str, ...] = ()   # K: tp of a row-parallel layer
    axes: dict[str, Axis] | None = None

    def __str__(self) -> str:
        spans = [f"{dim} over {'+'.join(names)}" for dim, names in (("M", self.rows), ("N", self.out),
                                                                     ("K", self.inner)) if names]
        return ", ".join(spans)


class Fp8Matmul:
    """`Linear.matmul` in FP8 with `recipe`'s casts (torchao's Float8LinearConfig): the forward x W^T, and in
    backward grad_out W and grad_out^T x, each from two float8 operands with scales agreed over `split`; with
    `emulate` the products run in float32 (torchao's emulation), else on torch._scaled_mm."""

    def __init__(self, recipe: str, split: Split, emulate: bool):
        import_float8()
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        self.recipe, self.split = recipe, split
        self.config = c = float8_config(recipe, emulate)
        gemms = (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)
        self.mm_config, self.padded_config = (
            LinearMMConfig(*(ScaledMMConfig(c.emulate, g.use_fast_accum, False, c.pad_inner_dim or pad)
                             for g, pad in zip(gemms, (False, False, padded))))
            for padded in (False, True))
        # which groups split dims 0 and 1 of each operand: x [M, K], W^T [K, N], grad_out [M, N]
        self.dims = {"x": (split.rows, split.inner), "w": (split.inner, split.out), "g": (split.rows, split.out)}
        self.__name__ = (f"fp8 {recipe}" + (" emulated" if emulate else "")
                         + (f" (amax reduced: {split})" if str(split) else ""))
        self.precast = None   # W as gathered in FP8 by ZeRO-3 (fp8_gather.py) while its unit is whole, else None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, layer) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):   # the product in autocast's dtype, as F.linear's would be
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return _Fp8Linear.apply(x, weight, self)

    # -- the product and its backward's two halves, apart: _Fp8Linear, and zero bubble's B and W (weight_grad.py) --
    def split_forward(self, x: torch.Tensor, weight: torch.Tensor, layer) -> tuple[torch.Tensor, tuple]:
        """y = x W^T outside autograd, and what `input_grad` and `weight_grad` need: (x, W, the scales)."""
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        c, scales = self.config, {}
        x2 = x.reshape(-1, x.shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            y = _mm(self.cast(x2, "x", c.cast_config_input, -1, scales),
                    self.weight_t(weight, c.cast_config_weight, 0, scales))
        return y.reshape(*x.shape[:-1], y.shape[-1]), (x, weight, scales)

    def input_grad(self, saved: tuple, grad: torch.Tensor) -> torch.Tensor:
        """grad_x = grad_out W from float8 operands."""
        x, weight, scales = saved
        c, g = self.config, grad.reshape(-1, grad.shape[-1])
        with torch.autocast(grad.device.type, enabled=False):
            grad_x = _mm(self.cast(g, "g", c.cast_config_grad_output, -1, scales),
                         self.weight_t(weight, c.cast_config_weight_for_grad_input, -1, scales).t())
        return grad_x.reshape(x.shape)

    def weight_grad(self, saved: tuple, grad: torch.Tensor) -> torch.Tensor:
        """grad_W = grad_out^T x from float8 operands, in W's dtype."""
        x, weight, scales = saved
        c, g, x2 = self.config, grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        # grad_weight sums over the rows: _scaled_mm on CUDA needs that inner dimension a multiple of 16, which an
        # row count need not be, so it is padded with zeros there (which add nothing)
        padded = self.padded_config if x2.shape[0] % 16 else None
        with torch.autocast(grad.device.type, enabled=False):
            grad_w = _mm(self.cast(g, "g", c.cast_config_grad_output_for_grad_weight, 0, scales, padded).t(),
                         self.cast(x2, "x", c.cast_config_input_for_grad_weight, 0, scales, padded))
        return grad_w.to(weight.dtype)

    def weight_t(self, weight: torch.Tensor, cast_config, dim: int, scales: dict):
        """W^T as a float8 operand: the FP8 weight ZeRO-3 gathered (tensorwise: the same bytes and scale), or a cast."""
        if self.precast is not None:
            return self.precast.t()
        return self.cast(weight.t(), "w", cast_config, dim, scales)

    def cast(self, tensor: torch.Tensor, operand: str, cast_config, dim: int, scales: dict, mm_config=None):
        """`tensor` (2-D) as torchao's float8 tensor; axiswise scales take the amax along `dim`. A scale is
        computed once per (operand, dim, dtype) in `scales` (tensorwise: the forward's serves backward too)."""
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8

        dim = dim if cast_config.scaling_granularity is ScalingGranularity.AXISWISE else None
        dtype, key = cast_config.target_dtype, (operand, dim, cast_config.target_dtype)
        if key not in scales:
            scales[key] = self.scale(tensor, operand, dtype, dim)
        role = {"x": GemmInputRole.INPUT, "w": GemmInputRole.WEIGHT, "g": GemmInputRole.GRAD_OUTPUT}[operand]
        return hp_tensor_and_scale_to_float8(tensor, scales[key], dtype, mm_config or self.mm_config, role, dim)

    def scale(self, tensor: torch.Tensor, operand: str, dtype: torch.dtype, dim: int | None) -> torch.Tensor:
        """The scale one process would use: the local amax, all-reduced (MAX) over the groups splitting the
        dimensions it spans (both for a tensorwise amax, `dim` for an axiswise one)."""
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

        if tensor.numel() == 0:   # a product on no rows here still takes part in its groups' reductions
            shape = () if dim is None else [1 if d == dim % 2 else n for d, n in enumerate(tensor.shape)]
            amax = tensor.new_zeros(shape)
        elif dim is None:
            amax = tensor_to_amax(tensor)
        else:
            amax = tensor_to_amax(tensor, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim)
        amax = amax.float()   # max is exact in any dtype; float32 reduces on every backend
        for d in (0, 1) if dim is None else (dim % 2,):
            for name in self.dims[operand][d]:
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.split.axes[name].group)
        return amax_to_scale(amax, dtype, self.config.round_scales_to_power_of_2)


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T from float8 operands; backward: grad_x = grad_out W and grad_W = grad_out^T x, likewise (Fp8Matmul's
    split_forward, input_grad, weight_grad). The products are torchao's (`torch.mm` of its float8 tensors:
    torch._scaled_mm, or float32 products of the same operands when emulated), in the dtype of x (or grad_out)."""

    @staticmethod
    def forward(ctx, x, weight, mm: Fp8Matmul):
        y, (_, _, scales) = mm.split_forward(x, weight, None)
        ctx.save_for_backward(x, weight)
        ctx.mm, ctx.scales = mm, scales
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        saved = (x, weight, ctx.scales)
        return ctx.mm.input_grad(saved, grad), ctx.mm.weight_grad(saved, grad), None


def _mm(a, b) -> torch.Tensor:
    """a b of two torchao float8 tensors (torch._scaled_mm), in a's high-precision dtype; zeros when a dimension is
    empty (no rows here), which needs no kernel."""
    if a.numel() and b.numel():
        return torch.mm(a, b)
    return torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)


def split_of(layer, ctx) -> Split:
    """Which groups split the layer's matmul dimensions, from the placement of its weight: tp splits N of a
    column-parallel layer (weight split on dim 0), K of a row-parallel one (dim 1), and under sequence
    parallelism M of a MoE block's linears (placed sequence_parallel); cp splits M everywhere (docs/fp8.md).
    Groups of one rank are left out: they reduce nothing."""
    p = placement(layer.weight)
    axes = {"tp": getattr(layer, "axis", None) or ctx.axis("tp"), "cp": ctx.axis("cp")}
    rows = ("cp",) + (("tp",) if p.sequence_parallel else ())
    out, inner = ("tp",) if p.split_dim == 0 else (), ("tp",) if p.split_dim == 1 else ()
    kept = tuple(name for name in axes if axes[name].size > 1)
    return Split(*(tuple(n for n in names if n in kept) for names in (rows, out, inner)), axes=axes)


def convert(name: str, layer, cfg, ctx) -> None:
    """Every linear whose name contains none of model.fp8.filter_fqns computes in FP8."""
    fp8 = cfg.model.fp8
    if not any(part in name for part in fp8.filter_fqns):
        layer.matmul = Fp8Matmul(fp8.recipe, split_of(layer, ctx), emulated(cfg, ctx.device))


def enabled(cfg) -> bool:
    """model.fp8.enabled (false for the config of a checkpoint saved before the key existed)."""
    return bool(cfg.model.get("fp8", {}).get("enabled", False))


def gather_format(model, cfg):
    """ZeRO-3's FP8 gather of the converted weights (model.fp8.gather_in_fp8), else None."""
    from nanoexp.numerics.fp8_gather import Fp8Gather

    if not cfg.model.fp8.get("gather_in_fp8", False):
        return None
    return Fp8Gather({id(m.weight): m.matmul for m in model.modules() if isinstance(getattr(m, "matmul", None),
                                                                                    Fp8Matmul)})


def product_dtype(cfg, device: torch.device | None = None) -> str:
    """float8 on FP8 units; emulated FP8 multiplies in float32."""
    return "float32" if emulated(cfg, device) else "float8"


def gathered_bytes(cfg) -> int | None:
    """model.fp8.gather_in_fp8: one byte an element (the memory estimate's ZeRO-3 term)."""
    return 1 if cfg.model.fp8.get("gather_in_fp8", False) else None


def console_line(cfg, converted: int, device: torch.device | None, pp: int) -> str:
    fp8, where = cfg.model.fp8, " (rank 0's stage)" if pp > 1 else ""
    products = ("products emulated in float32 (model.fp8.emulate), so MFU is against the float32 peak"
                if emulated(cfg, device) else "products on FP8 units (torch._scaled_mm)")
    return (f"FP8: {converted} linears{where} in FP8 (torchao, {fp8.recipe} scaling, {products}); "
            f"in high precision: those named with {', '.join(fp8.filter_fqns) or 'nothing'}"
            + ("; ZeRO-3 gathers their weights in FP8" if fp8.gather_in_fp8 else ""))


def problems(cfg) -> list[str]:
    """model.fp8: torchao installed when on, and nothing asked that is not built (the recipe: validation's)."""
    fp8, out = cfg.model.fp8, []
    if fp8.enabled and not torchao_available():
        out.append("model.fp8.enabled=true needs torchao, which is not importable here: pip install -e '.[fp8]'")
    return out + (gather_problems(cfg) if fp8.gather_in_fp8 else [])


def gather_problems(cfg) -> list[str]:
    """model.fp8.gather_in_fp8=true: what it needs."""
    fp8, dp_cp = cfg.model.fp8, cfg.parallelism.dp * cfg.parallelism.cp
    needs = [(fp8.enabled, "model.fp8.gather_in_fp8=true needs model.fp8.enabled=true (it gathers FP8 layers' "
              "weights)"),
             (fp8.recipe == "tensorwise", f"model.fp8.gather_in_fp8=true needs model.fp8.recipe=tensorwise, not "
              f"{fp8.recipe} (a rowwise recipe casts each weight per row and per column: no one FP8 copy serves both)"),
             (cfg.optimizer.zero_stage == 3 and dp_cp > 1, "model.fp8.gather_in_fp8=true gathers ZeRO-3's weights: it "
              "needs optimizer.zero_stage=3 and parallelism.dp*cp > 1, else set it to false")]
    return [message for ok, message in needs if not ok]


CONVERTERS["fp8"] = Converter(enabled, convert, gather_format, product_dtype, gathered_bytes, console_line, problems,
                              planned_dtype)
