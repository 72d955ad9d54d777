"""Putting a run together on one rank: the model's shape from the config, this rank's shard of the model (the
plain model, the layout's parallel dimensions applied to it, initial weights), and with it the gradient
synchronisation, the optimizer, the pipeline engine and the precision (`build_runtime`), the same for training
and for evaluating a checkpoint; and a checkpoint of any layout as one process's whole model (`load_single_process`).

The modules are built and transformed on the meta device (no memory), then only this rank's shards are
materialised on its device and filled: no rank ever allocates or draws a full tensor it does not keep
(nanoexp/model/init.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from nanoexp.checkpoint.load import CheckpointReader, check_compatible, load_model, single_process_config
from nanoexp.config import batch_accumulation
from nanoexp.interop.hf import load_hf_weights
from nanoexp.model.init import init_weights
from nanoexp.model.llama import LlamaForCausalLM
from nanoexp.model.moe import BALANCES
from nanoexp.model.mup import parametrization_of
from nanoexp.model.shape import model_shape
from nanoexp.numerics.converters import convert_linears, gather_format
from nanoexp.numerics.precision import autocast
from nanoexp.runtime.optim import build_optimizer
from nanoexp.runtime.recompute import RecomputePolicy, apply_recompute
from nanoexp.parallel.context import ParallelContext
from nanoexp.parallel.gradient_sync import GradientSync
from nanoexp.parallel.parallelize import parallelize
from nanoexp.parallel.zero.engine import ZeroOptions
from nanoexp.parallel.pipeline import PipelineEngine
from nanoexp.parallel.pipeline.schedules import SCHEDULES
from nanoexp.parallel.pipeline.weight_grad import defer_weight_gradients
from nanoexp.instruments.trace import NO_TRACE, PipelineTrace
from nanoexp.runtime.step import StepRunner


def build_model(cfg, ctx: ParallelContext) -> LlamaForCausalLM:
    """This rank's shard of the model, on its device: its pipeline stage's layers (with virtual stages, its
    chunks of them), its tensor-parallel slices, as ctx.layout splits them (the config's layout when
    training; one process's to read a checkpoint of any layout), each layer keeping for backward what
parallelism.recompute says. model.compile compiles each decoder block."""
    shape = model_shape(cfg)
    with torch.device("meta"):
        model = parallelize(LlamaForCausalLM(shape), ctx)
    model.converted_linears = convert_linears(model, cfg, ctx)   # number formats (nanoexp/numerics/converters.py)
    materialize(model, ctx.device)
    init_weights(model, cfg.model.init_method.std, cfg.general.seed, parametrization_of(cfg))
    if cfg.model.init_method.path:   # start from a local Hugging Face Llama's weights
        load_hf_weights(model, cfg.model.init_method.path)
    apply_recompute(model, RecomputePolicy.from_config(cfg), ctx.device)   # before compile, which compiles it too
    if cfg.model.compile:
        for layer in model.model.layers.values():
            layer.compile()
    return model


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give every parameter of a model built on the meta device uninitialised memory on `device`, keeping its
    placement and the ties between modules (a tied LM head stays the embedding tensor); every buffer zeros (a MoE
    layer's routing bias starts at 0)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            module.register_buffer(name, torch.zeros_like(buffer, device=device),
                                   persistent=name not in module._non_persistent_buffers_set)
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in made:
                made[id(param)] = nn.Parameter(torch.empty_like(param, device=device), param.requires_grad)
                made[id(param)].__dict__.update(param.__dict__)   # its placement
            setattr(module, name, made[id(param)])


def load_single_process(folder: str, device: torch.device | None = None):
    """(model, config) from a checkpoint of any layout, as one process's whole model in eval mode, on `device`
    (default: the GPU when there is one)."""
    reader = CheckpointReader(folder)
    cfg = single_process_config(reader.meta["config"])
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ctx = ParallelContext(device=device)   # one process: the whole model in one chunk
    model = build_model(cfg, ctx)
    check_compatible(reader, model.shape)
    load_model(reader, model, ctx)
    return model.eval(), cfg


@dataclass
class Runtime:
    """What one rank trains or evaluates with."""
    model: nn.Module
    runner: StepRunner
    grad_sync: GradientSync | None = None   # None: evaluation only
    optimizer: object = None
    trace: object = NO_TRACE   # the pipeline timeline (logging.pipeline_trace)
    after_step: list = field(default_factory=list)   # post-step hooks, run after each optimizer step


def after_step_hooks(model: nn.Module) -> list:
    """What runs after each optimizer step: the MoE balance's hook (BALANCES; balance=bias moves the routing biases
    by the step's loads, which every rank read alike in the step)."""
    moe = model.moe_losses
    after = BALANCES[moe.moe.balance].after_step if moe else None
    return [lambda: after(model, moe.loads)] if after else []


def build_runtime(cfg, ctx: ParallelContext, training: bool = True, run_dir: str | None = None) -> Runtime:
    """This rank's model shard and step runner, and for training its gradient sync (flat buffers, one set of
    buckets per chunk: a chunk's gradients are final after its own last backward), optimizer, post-step hooks
    and, with logging.pipeline_trace, the pipeline timeline written into `run_dir`."""
    model = build_model(cfg, ctx)
    trace = PipelineTrace.for_run(run_dir, ctx) if training and run_dir and cfg.logging.pipeline_trace else NO_TRACE
    # zero-bubble schedules run each backward as B and W: the linears keep their weight gradients for W
    weights = defer_weight_gradients(model) if training and SCHEDULES[ctx.layout.schedule].splits_backward else None
    engine = PipelineEngine(ctx, ctx.layout.schedule, ctx.layout.virtual_stages, trace, weights)
    t = cfg.tokens
    runner = StepRunner(model, ctx, engine, autocast(cfg, ctx.device), t.micro_batch_size, t.sequence_length)
    if not training:
        return Runtime(model, runner)
    if model.moe_losses:   # its losses weigh 1/micro-batches, x cp against the dp x cp average (moe.py)
        model.moe_losses.scale = ctx.cp / batch_accumulation(cfg)
    o = cfg.optimizer
    overlap = o.zero_overlap_reduce_scatter
    options = ZeroOptions(bucket_cap_mb=cfg.model.ddp_bucket_cap_mb or (4 if ctx.backend == "gloo" else 25),
                          prefetch=o.zero3_prefetch, reshard_after_forward=o.zero3_reshard_after_forward,
                          overlap_reduce_scatter=ctx.device.type == "cuda" if overlap is None else overlap,
                          gather_format=gather_format(model, cfg), split_backward=weights is not None)
    grad_sync = GradientSync(model.units_by_chunk(), ctx, o.zero_stage, options, trace)
    return Runtime(model, runner, grad_sync, build_optimizer(cfg, model, grad_sync), trace, after_step_hooks(model))
