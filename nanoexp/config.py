"""The config schema (typed dataclasses in Hydra's ConfigStore), composing it, normalising it, and the
batch and vocabulary values derived from it (the parallel shape is nanoexp.parallel.layout.Layout).

Key names follow nanotron's config. Each field is one key's home: `key(default, domain, counts)` gives its
default, its domain (a number's range, or the strings allowed) and when the run reads it (nanoexp/config_domains.py
checks them); a key whose values are a registry's names (a schedule, a kernel) is checked against that registry
(validation.REGISTRIES), and rules across keys are nanoexp/validation.py's. The schema makes an unknown key an
error at composition time. Defaults are read in conf/: the schema's are conf's (tests/test_config.py checks they
agree) or those of keys no conf file sets.
"""
from __future__ import annotations

import math
import os
import typing
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from nanoexp.config_domains import (FRACTION, RANK, SEED, SIZE, SLEEP, Counts, Domain, at_least, between, key,
                                    positive)


@dataclass
class GeneralConfig:
    seed: int = key(42, SEED)
    project: str = "nanoexp"
    run: str = "default"
    check_memory: bool = True   # refuse at start a run whose memory estimate exceeds the machine's (false: start it)


@dataclass
class TokenizerConfig:
    tokenizer_name_or_path: str = "byte"   # "byte" = built-in UTF-8 byte tokenizer, or a local HF folder


@dataclass
class TokensConfig:
    sequence_length: int = key(128, SIZE)
    micro_batch_size: int = key(4, SIZE)
    batch_accumulation_per_replica: Optional[int] = key(None, positive("null: global_batch_size / (dp * "
                                                                       "micro_batch_size)"))
    global_batch_size: int = key(32, SIZE)
    train_steps: int = key(240, SIZE)
    val_check_interval: int = key(120, at_least(0, "0: only at the end"))
    limit_val_batches: int = key(4, at_least(0, "0: all held-out data"))   # global batches per evaluation


@dataclass
class LlamaConfig:
    hidden_size: int = key(domain=SIZE)
    intermediate_size: int = key(domain=SIZE)
    num_hidden_layers: int = key(domain=SIZE)
    num_attention_heads: int = key(domain=SIZE)
    num_key_value_heads: Optional[int] = key(domain=positive("null: as many as attention heads"))
    vocab_size: int = key(257, SIZE)
    max_position_embeddings: int = key(domain=SIZE)
    rope_theta: float = key(10000.0, positive())
    rms_norm_eps: float = key(1e-5, positive())
    tie_word_embeddings: bool = False
    qk_norm: bool = False   # RMSNorm over each head's query and key before the rotation (Qwen3's)


@dataclass
class InitMethod:
    std: float = key(domain=positive())   # every conf/model file sets it: it depends on the width
    path: Optional[str] = None   # a local Hugging Face Llama folder to start from


@dataclass
class MupConfig:
    # µP: m = hidden_size / base_width; attention scores attention_multiplier * q·k / d_head
    base_width: Optional[int] = key(None, positive("the hidden size at which µP equals standard"))
    attention_multiplier: float = key(1.0, positive())


MOE = Counts(lambda cfg: cfg.model.moe.num_experts > 0, "model.moe.num_experts > 0")


@dataclass
class MoeConfig:
    """A mixture of experts (nanoexp/model/moe.py); router, balance, expert_kernel: validation.REGISTRIES."""
    num_experts: int = key(0, at_least(0, "0: a dense model"))   # > 0: every layer_frequency-th layer a mixture
    top_k: int = key(2, at_least(1), MOE)   # routed experts per token
    moe_intermediate_size: Optional[int] = key(None, positive("null: model_config.intermediate_size"), MOE)
    num_shared_experts: int = key(0, at_least(0), MOE)   # experts every token goes through (one MLP that wide)
    layer_frequency: int = key(1, at_least(1), MOE)   # every k-th layer is MoE (layers k-1, 2k-1, ...)
    router: str = key("softmax_topk", counts=MOE)   # softmax_topk_normalized: the top-k weights sum to 1
    aux_loss_coef: float = key(0.01, at_least(0), MOE)   # Switch/GShard load balancing (balance=aux_loss only)
    z_loss_coef: float = key(0.0, at_least(0), MOE)   # router z-loss (ST-MoE), per MoE layer
    capacity_factor: Optional[float] = key(None, positive("null: dropless"), MOE)   # ceil(c·tokens·top_k / E) each
    expert_kernel: str = key("grouped_mm", counts=MOE)   # how the routed experts run (nanoexp/model/experts.py)
    balance: str = key("aux_loss", counts=MOE)   # bias: DeepSeek-V3's routing bias, no aux loss
    bias_update_rate: Optional[float] = key(None, positive("null: 0.001, DeepSeek-V3's"), MOE)   # after each step
    seq_aux_loss_coef: float = key(0.0, at_least(0), MOE)   # sequence-wise balancing loss (DeepSeek-V3's)


FP8 = Counts(lambda cfg: cfg.model.fp8.enabled, "model.fp8.enabled=true")


@dataclass
class Fp8Config:
    """FP8 linears through torchao (nanoexp/numerics/fp8.py, docs/fp8.md); names after torchtitan's `float8`."""
    enabled: bool = False
    recipe: str = key("tensorwise", counts=FP8)   # torchao's recipe names
    # a linear whose module name contains one of these stays in high precision (the LM head, MoE routers)
    filter_fqns: List[str] = key(["lm_head", "router"], counts=FP8)
    gather_in_fp8: bool = False  # ZeRO-3 gathers FP8 layers' weights in FP8 (tensorwise only; numerics/fp8.py)
    # the products in float32 from the same FP8 operands (torchao's emulation); null: where the device has no FP8
    # units (a CPU, a GPU below compute capability 8.9); false: torch._scaled_mm (on a CPU: as fast as the CPU's)
    emulate: Optional[bool] = key(None, counts=FP8)


@dataclass
class ModelConfig:
    dtype: str = key("float32", ("float32", "bfloat16"))   # bfloat16: autocast, float32 master weights and grads
    init_method: InitMethod = field(default_factory=InitMethod)
    parametrization: str = key("standard", ("standard", "mup"))   # nanoexp/model/mup.py
    mup: MupConfig = field(default_factory=MupConfig)
    make_vocab_size_divisible_by: int = key(64, SIZE)
    compile: bool = False
    allow_tf32: Optional[bool] = None   # float32 matmuls on CUDA in TF32 (null: on with CUDA; CPU: no effect)
    flush_denormals: bool = True   # CPU: results below float32's smallest normal (1.2e-38) are 0, on every thread
    ddp_bucket_cap_mb: Optional[float] = key(None, positive("MB; null: 25 with NCCL, 4 with gloo"))
    # document: packed documents attend within themselves, positions restart
    attention_mask: str = key("causal", ("causal", "document"))
    # nanoexp/model/attention.py (auto: flash-attn where it runs); with cp > 1, parallelism.cp_mode's kernel runs
    attention_kernel: str = key("auto", counts=Counts(lambda cfg: cfg.parallelism.cp == 1, "parallelism.cp=1 (with "
                                                      "cp > 1 attention runs parallelism.cp_mode's kernel)"))
    model_config: LlamaConfig = field(default_factory=LlamaConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)


MUON = Counts(lambda cfg: uses_muon(cfg), "optimizer.optimizer_factory.name=muon")


@dataclass
class OptimizerFactory:
    name: str = "adamW"   # a name of optim/registry.OPTIMIZERS, any case
    adam_beta1: float = key(0.9, FRACTION)
    adam_beta2: float = key(0.95, FRACTION)
    adam_eps: float = key(1e-8, positive())
    torch_adam_is_fused: bool = False   # foreach is used when false
    # name=muon (docs/optimizers.md): torch.optim.Muon's settings for the hidden matrices; the rest use the adam_*
    muon_momentum: float = key(0.95, FRACTION, MUON)
    muon_nesterov: bool = key(True, counts=MUON)
    muon_ns_steps: int = key(5, Domain(lambda steps: 1 <= steps < 100, "in [1, 100)"), MUON)   # Newton–Schulz's
    muon_ns_coefficients: List[float] = key([3.4445, -4.775, 2.0315], Domain(math.isfinite, "finite",
                                                                              item="coefficient"), MUON)
    muon_adjust_lr_fn: str = key("original", counts=MUON)   # optim/muon.ADJUST_LR_FNS


@dataclass
class LRSchedulerConfig:
    learning_rate: float = key(4e-3, positive())
    lr_warmup_steps: int = key(20, at_least(0))
    lr_warmup_style: str = key("linear", ("linear", "constant"))
    lr_decay_style: str = key("cosine", ("linear", "cosine", "constant"))
    lr_decay_steps: Optional[int] = key(None, at_least(1, "train_steps - the step the decay starts at"))
    lr_decay_starting_step: Optional[int] = key(None, at_least(0, "null: where warm-up ends"))   # the peak holds
    min_decay_lr: Optional[float] = key(None, at_least(0, "null: half the peak learning_rate"))   # follows LR sweeps


@dataclass
class OptimizerConfig:
    optimizer_factory: OptimizerFactory = field(default_factory=OptimizerFactory)
    weight_decay: float = key(0.1, at_least(0))
    clip_grad: Optional[float] = key(1.0, positive("null: no clipping"))
    # 1 optimizer state | 2 + gradients | 3 + parameters, sharded over dp x cp; the zero3_* and zero_overlap_*
    # keys: validation.zero_rules
    zero_stage: int = key(0, Domain(lambda stage: stage in (0, 1, 2, 3), "one of 0, 1, 2, 3"))
    zero3_prefetch: int = key(1, at_least(0, "units gathered ahead; 0: none"))   # units (layers) gathered ahead
    zero3_reshard_after_forward: bool = True   # ZeRO-3: free a layer after its forward (false: until its backward)
    # ZeRO-2/3: a unit's reduce-scatter stays in flight during the next unit's backward (null: on CUDA, whose
    # collectives run on their own stream; on CPU waited at once, as FSDP2 does there: less memory)
    zero_overlap_reduce_scatter: Optional[bool] = None
    skip_nonfinite_steps: bool = False   # true: skip an update whose loss or gradient is NaN/Inf
    learning_rate_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)


RECOMPUTE_MODES = ("none", "full", "selective", "every_k")   # parallelism.recompute


@dataclass
class ParallelismConfig:
    """The layout (nanoexp/parallel/layout.py, docs/parallelism.md); pp_engine, tp_mode, cp_mode: the
    registries of validation.REGISTRIES."""
    dp: int = key(1, SIZE)
    tp: int = key(1, SIZE)
    pp: int = key(1, SIZE)
    cp: int = key(1, SIZE)                # context parallel: each sample's sequence split over cp ranks
    # how the cp ranks' attention meets the other chunks (nanoexp/parallel/context_parallel/)
    cp_mode: str = key("ring", counts=Counts(lambda cfg: cfg.parallelism.cp > 1, "parallelism.cp > 1"))
    # expert parallel: dp x cp ranks that split a mixture's experts (divides dp x cp)
    ep: int = key(1, at_least(1, "1: every rank holds every expert"))
    # hybrid sharding: ZeRO shards over dp_shard x cp ranks, replicated dp / dp_shard times (docs/zero.md)
    dp_shard: Optional[int] = key(None, at_least(1, "null: ZeRO shards over all of dp x cp"))
    pp_engine: str = "1f1b"               # nanoexp/parallel/pipeline/schedules.py
    pp_virtual_stages: int = key(1, SIZE)   # chunks of layers per pp rank (interleaved_1f1b; 2 for V schedules)
    # reduce_scatter: sequence parallelism
    tp_mode: str = key("all_reduce", counts=Counts(lambda cfg: cfg.parallelism.tp > 1, "parallelism.tp > 1"))
    # what each decoder layer keeps for backward (docs/memory.md#activation-recomputation): none (everything) | full
    # (its input; the forward runs again in backward) | selective (its input and the outputs of selective_ops; the
    # rest runs again) | every_k (layers k-1, 2k-1, ... full, k = recompute_every; the others everything)
    recompute: str = key("none", RECOMPUTE_MODES)
    recompute_every: int = key(2, at_least(1, "1: every layer, as recompute=full"), Counts(
        lambda cfg: recompute_mode(cfg) == "every_k", "parallelism.recompute=every_k"))
    selective_ops: List[str] = key(["matmul", "attention"], counts=Counts(   # model/saved_ops.SAVABLE_OPS
        lambda cfg: recompute_mode(cfg) == "selective", "parallelism.recompute=selective"))
    # what a layer saves waits in pinned host memory for its backward (CUDA); a recomputed layer keeps only what
    # checkpoint holds itself (its input, the kept ops' outputs): nothing to move
    offload_activations: bool = key(False, counts=Counts(lambda cfg: recompute_mode(cfg) == "none" or (
        recompute_mode(cfg) == "every_k" and cfg.parallelism.recompute_every > 1), "parallelism.recompute=none, or "
        "every_k with recompute_every > 1 (the layers it does not recompute)"))
    recompute_layer: bool = False  # nanotron's spelling of recompute=full
    # a rank stuck this long in a collective is an error; torch.distributed's clocks overflow near 1e13 s
    collective_timeout_s: float = key(600.0, Domain(lambda seconds: 0 < seconds <= 1e9, "positive and at most 1e9",
                                                    "seconds"))
    start_method: str = key("auto", ("auto", "fork", "spawn"))   # local workers: auto (spawn with CUDA, fork on CPU)


@dataclass
class DataConfig:
    name: str = "builtin"          # a source of data/sources.SOURCES: builtin (Shakespeare) | nanoset | hf
    seed: Optional[int] = key(None, SEED._replace(note="null: general.seed"))   # the sample order's (nanotron's)
    validation_fraction: float = key(0.05, Domain(lambda fraction: 0 < fraction < 1, "between 0 and 1"))
    prefetch: bool = True
    dataset_folder: List[str] = key([])   # nanoset: one folder per dataset
    dataset_weights: Optional[List[float]] = key(None, Domain(lambda weight: weight > 0, "positive", item="weight"))
    hf_dataset_or_datasets: Optional[str] = None              # hf: local path or Hub name
    hf_dataset_config_name: Optional[str] = None
    hf_dataset_splits: str = "train"
    text_column_name: str = "text"
    streaming: bool = False


# A data stage's `data`: each field of the data group (with its domain), null (the default) where the stage keeps
# the group's value. A stage that sets dataset_folder (hf_dataset_or_datasets) without dataset_weights
# (hf_dataset_config_name) does not inherit the group's: they belong to the group's datasets.
DataOverrides = make_dataclass("DataOverrides", [
    (f.name, Optional[typing.get_type_hints(DataConfig)[f.name]], field(default=None, metadata=f.metadata))
    for f in fields(DataConfig)], namespace={"__module__": __name__})


@dataclass
class DataStageConfig:
    """One entry of `data_stages` (nanotron's): from `start_training_step` on, training reads `data`."""
    name: str = key()
    start_training_step: int = key(domain=at_least(1))
    data: DataOverrides = field(default_factory=DataOverrides)


@dataclass
class CheckpointConfig:
    checkpoint_interval: int = key(0, at_least(0, "0: only at the end"))
    checkpoints_path: Optional[str] = None     # null: <run folder>/checkpoints
    save_final_state: bool = True
    resume: str = key("auto", ("auto", "never"))   # auto: continue from the newest checkpoint in checkpoints_path
    resume_checkpoint_path: Optional[str] = None   # a checkpoint folder to resume from (wins over resume)
    keep_last_n: Optional[int] = key(None, at_least(1, "null: keep all"))
    load_optimizer: bool = True                # false: fresh AdamW state (fine-tuning from weights)
    load_lr_scheduler: bool = True             # false: the LR schedule restarts at the resumed step
    load_strict: bool = True                   # false: load the parameters model and checkpoint share, log the rest
    async_save: bool = False                   # true: write interval saves in the background (docs/checkpoints.md)


@dataclass
class WandbConfig:
    mode: str = key("disabled", ("disabled", "offline", "online"))
    project: Optional[str] = None
    entity: Optional[str] = None
    name: Optional[str] = None         # null: the job's overrides (Hydra's override_dirname), else general.run
    group: Optional[str] = None        # null: the sweep folder in a multirun, else none
    tags: Optional[List[str]] = None   # null: the layout (e.g. dp2tp2pp2)


@dataclass
class ProfilerConfig:
    """torch.profiler trace of a few steps into <run>/profiler/ (nanoexp/instruments/profiling.py)."""
    enabled: bool = False
    wait: int = key(1, at_least(0))     # steps skipped first
    warmup: int = key(1, at_least(0))   # steps traced but dropped (the profiler's own start-up)
    active: int = key(2, at_least(1))   # steps recorded
    record_shapes: bool = False


@dataclass
class LoggingConfig:
    iteration_step_info_interval: int = key(10, positive())
    tensorboard: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)
    peak_tflops: Optional[float] = key(None, positive("null: the device's known peak"))
    pipeline_trace: bool = False          # per-rank pipeline timeline in <run>/pipeline_trace/
    exact_cpu_memory: bool = False        # CPU: glibc returns freed tensor memory at once (slower; see README Memory)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)


@dataclass
class EvalConfig:
    """Downstream tasks of EleutherAI's lm-eval in the training loop (nanoexp/evaluation/downstream.py)."""
    tasks: List[str] = key([])   # empty: none (the default)
    interval: int = key(0, at_least(0, "0: only at the end of training"))   # and at the end
    limit: Optional[int] = key(None, positive("null: every example"))   # examples per task
    num_fewshot: Optional[int] = key(None, at_least(0, "null: the task's default"))
    batch_size: int = key(32, positive())   # rows per scoring call
    include_path: Optional[str] = None   # a folder of your own task YAMLs (the harness's --include_path)
    bootstrap_iters: int = key(1000, at_least(0))   # the harness's bootstrap for the stderr of non-mean metrics
    on_error: str = key("continue", ("continue", "stop"))   # a task that raises: continue (logged, training goes on)


@dataclass
class FaultInjectionConfig:
    """Deliberate faults, for the robustness tests (all off by default)."""
    nonfinite_loss_at_step: Optional[int] = key(None, at_least(1, "null: off"))   # this step's loss becomes NaN
    hang_at_step: Optional[int] = key(None, at_least(1, "null: off"))   # rank `hang_rank` sleeps before this step
    hang_rank: int = key(0, at_least(0))
    slow_step_s: float = key(0.0, SLEEP)            # every rank sleeps this long before each step (a slow host)
    slow_start_up_s: float = key(0.0, SLEEP)        # every rank sleeps this long at the end of its start-up
    stall_rank: Optional[int] = key(None, RANK)     # this rank sleeps `stall_s` in its compute at `stall_at_step`
    stall_at_step: int = key(3, at_least(1))
    stall_s: float = key(3600.0, SLEEP)
    stall_holds_interpreter: bool = False          # that sleep holds Python's interpreter lock (no thread runs)
    sigstop_rank: Optional[int] = key(None, RANK)   # this rank stops itself (SIGSTOP) in its compute at stall_at_step
    skip_collective_rank: Optional[int] = key(None, RANK)   # this rank skips the loss all-reduce of step 3
    wrong_shape_rank: Optional[int] = key(None, RANK)       # this rank posts step 3's loss all-reduce with shape [2]
    short_pipeline_rank: Optional[int] = key(None, RANK)    # this rank runs step 3 with one micro-batch too few
    raise_rank: Optional[int] = key(None, RANK)             # this rank raises at step 3
    slow_checkpoint_s: float = key(0.0, SLEEP)      # rank 0 sleeps this long inside each checkpoint write
    hold_checkpoint_write: int = key(0, at_least(0, "0: off"))   # async_save: step S's write waits for S + this
    kill_group: Optional[int] = key(None, RANK)     # fault_tolerance: this replica group's rank 0 is SIGKILLed...
    kill_at_step: int = key(3, at_least(1), Counts(lambda cfg: cfg.fault_injection.kill_group is not None,
                                                   "fault_injection.kill_group set"))   # ...at this step
    slow_rank: Optional[int] = key(None, RANK)      # this rank sleeps `slow_rank_s` in each micro-batch's forward
    slow_rank_s: float = key(0.05, SLEEP)
    spike_at_step: Optional[int] = key(None, at_least(1, "null: off"))   # this step's batch in a fresh run: loss x 10
    flip_gradient_rank: Optional[int] = key(None, RANK)   # this rank flips one bit of a gradient at flip_gradient_step
    flip_gradient_step: int = key(2, at_least(1))


TORCHFT = Counts(lambda cfg: cfg.fault_tolerance.method != "none", "fault_tolerance=torchft")
DILOCO = Counts(lambda cfg: cfg.fault_tolerance.semi_sync == "diloco", "fault_tolerance.semi_sync=diloco")
TIMEOUT = Domain(lambda seconds: 0 < seconds <= 1e6, "positive and at most 1e6", "seconds")


@dataclass
class FaultToleranceConfig:
    """Replica groups that train on through a failure, with torchft (docs/fault-tolerance.md; pip install -e
    '.[ft]'). Each group is a world of the parallelism group's layout; gradients are averaged across the live groups,
    and a group that comes back copies a live peer's state. method, semi_sync: parallel/replicas.py."""
    method: str = "none"
    replica_groups: int = key(1, SIZE, TORCHFT)   # R groups: the data-parallel degree is R x parallelism.dp
    min_replicas: int = key(1, SIZE, TORCHFT)     # fewer live groups than this: no step is committed
    lighthouse: Optional[str] = key(None, counts=TORCHFT)   # a running lighthouse's http://host:port (null: start one)
    group: Optional[int] = key(None, at_least(0, "null: every group on this machine"), TORCHFT)   # this world's
    quorum_timeout_s: float = key(60.0, TIMEOUT, TORCHFT)   # the longest wait for a quorum (and the lighthouse)
    timeout_s: float = key(30.0, TIMEOUT, TORCHFT)   # a cross-group collective, vote or state copy (then retried)
    max_restarts: int = key(3, at_least(0, "0: a dead group stays out"), Counts(   # a local group's, then given up
        lambda cfg: cfg.fault_tolerance.method != "none" and cfg.fault_tolerance.group is None, "fault_tolerance="
        "torchft with fault_tolerance.group=null (the groups started on this machine, which nanoexp restarts)"))
    semi_sync: str = key("none", counts=TORCHFT)   # diloco: groups apart, synced every sync_every (none: each step)
    sync_every: int = key(20, SIZE, DILOCO)         # diloco: inner steps between syncs (H)
    outer_lr: float = key(0.7, positive(), DILOCO)  # diloco: the outer Nesterov SGD's learning rate (DiLoCo's paper)
    outer_momentum: float = key(0.9, FRACTION, DILOCO)   # diloco: its momentum


SPIKES = Counts(lambda cfg: cfg.health.spike.action != "off", "health.spike.action other than off")


@dataclass
class SpikeConfig:
    """A loss above the median of the last `window` steps by `z` robust deviations (docs/health.md)."""
    action: str = key("warn", ("off", "warn", "skip", "rollback"))   # skip: drop the update; rollback: to a checkpoint
    window: int = key(50, at_least(1, "steps"), SPIKES)
    z: float = key(6.0, positive("robust deviations"), SPIKES)
    max_rollbacks: int = key(3, at_least(1), Counts(lambda cfg: cfg.health.spike.action == "rollback",
                                                    "health.spike.action=rollback"))   # then the run stops


def compares_ranks(cfg: Any) -> bool:
    """Whether the straggler detector runs: on, with ranks doing the same work to compare (nanoexp/health/)."""
    p = cfg.parallelism
    return bool(cfg.health.stragglers) and p.dp * p.cp * p.tp > 1


STRAGGLERS = Counts(compares_ranks, "health.stragglers=true and two or more ranks per pipeline stage (dp x cp x tp)")


@dataclass
class HealthConfig:
    """Stragglers, loss spikes and replay checks (nanoexp/health/, docs/health.md)."""
    stragglers: bool = True
    every: int = key(10, SIZE, STRAGGLERS)   # the ranks' compute times are compared every this many steps (a window)
    # a rank this many times slower than its stage's median for straggler_windows windows in a row is named
    straggler_factor: float = key(1.5, Domain(lambda factor: factor > 1, "above 1", "times the median"), STRAGGLERS)
    straggler_windows: int = key(3, at_least(1), STRAGGLERS)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    replay_every: int = key(0, at_least(0, "0: off"))   # every N steps forward and backward twice, gradients compared
    replay_action: str = key("stop", ("stop", "skip"), Counts(lambda cfg: cfg.health.replay_every > 0,
                                                              "health.replay_every > 0"))   # skip: drop the update


@dataclass
class DebugConfig:
    """Hang and desync diagnosis (docs/debugging.md)."""
    # no rank progressed this long: dump the stacks and diagnose
    stall_s: Optional[float] = key(None, between(0, 1e9, "between 0 and 1e9", "seconds, null: auto, 0: off"))
    flight_recorder_entries: int = key(2000, at_least(0, "0: off"))   # collectives torch's flight recorder keeps
    collectives: str = key("off", ("off", "check"))   # check: torch checks each collective's op, shape, dtype
    cuda_sync: str = key("off", ("off", "warn", "error"))   # torch reports each host wait for the GPU (CUDA only)


@dataclass
class NanoexpConfig:
    general: GeneralConfig = field(default_factory=GeneralConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    tokens: TokensConfig = field(default_factory=TokensConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    data: DataConfig = field(default_factory=DataConfig)
    data_stages: List[DataStageConfig] = key([])   # empty: `data` is the one stage
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    fault_injection: FaultInjectionConfig = field(default_factory=FaultInjectionConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


def register_configs() -> None:
    ConfigStore.instance().store(name="nanoexp_schema", node=NanoexpConfig)


CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def compose(overrides=()) -> Any:
    """The config `python train.py <overrides>` runs with, composed from conf/ (for scripts and tests)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


class ConfigError(ValueError):
    """An invalid configuration: one line per problem, each naming the key and the fix."""


def normalize(cfg: Any) -> None:
    """Accept nanotron's upper-case enum spellings (ALL_REDUCE, 1F1B, ...): lower-case them in place. The
    first step of checking a config, before validation (which only reads)."""
    p, lr = cfg.parallelism, cfg.optimizer.learning_rate_scheduler
    p.tp_mode, p.pp_engine, p.cp_mode = str(p.tp_mode).lower(), str(p.pp_engine).lower(), str(p.cp_mode).lower()
    lr.lr_decay_style, lr.lr_warmup_style = str(lr.lr_decay_style).lower(), str(lr.lr_warmup_style).lower()


def optimizer_name(cfg: Any) -> str:
    """optimizer.optimizer_factory.name in lower case, as every part of nanoexp compares it (adamw | muon; a config
    saved before the optimizer group existed: adamw)."""
    return str(cfg.get("optimizer", {}).get("optimizer_factory", {}).get("name", "adamW")).lower()


def uses_muon(cfg: Any) -> bool:
    """Whether the hidden matrices are Muon's (optim/muon.py) and the rest AdamW's."""
    return optimizer_name(cfg) == "muon"


def recompute_mode(cfg: Any) -> str:
    """parallelism.recompute as every part of nanoexp reads it: nanotron's recompute_layer=true is full (validation
    refuses it beside another mode); a config saved before the key existed: its recompute_layer."""
    p = cfg.parallelism
    mode = str(p.get("recompute", "none"))
    return "full" if mode == "none" and p.get("recompute_layer", False) else mode


def padded_vocab_size(cfg: Any) -> int:
    multiple = cfg.model.make_vocab_size_divisible_by
    return -(-cfg.model.model_config.vocab_size // multiple) * multiple


def num_kv_heads(cfg: Any) -> int:
    m = cfg.model.model_config
    return m.num_key_value_heads or m.num_attention_heads


def replica_groups(cfg: Any) -> int:
    """Replica groups that share the global batch (fault_tolerance.replica_groups under torchft, else 1)."""
    ft = cfg.get("fault_tolerance") or {}
    return int(ft.get("replica_groups", 1)) if ft.get("method", "none") != "none" else 1


def batch_accumulation(cfg: Any) -> int:
    """Micro-batches per optimizer step and dp replica (nanotron's batch_accumulation_per_replica)."""
    t, dp = cfg.tokens, cfg.parallelism.dp * replica_groups(cfg)
    if t.batch_accumulation_per_replica is not None:
        return t.batch_accumulation_per_replica
    return t.global_batch_size // (dp * t.micro_batch_size)


def global_batch_size(cfg: Any) -> int:
    """Samples a step over every replica group (dp x replica groups x micro-batch x accumulation)."""
    return cfg.parallelism.dp * replica_groups(cfg) * cfg.tokens.micro_batch_size * batch_accumulation(cfg)


# A stage that names its own datasets does not inherit the group's weights or HF config name for them.
COUPLED_DATA_KEYS = {"dataset_folder": "dataset_weights", "hf_dataset_or_datasets": "hf_dataset_config_name"}


def stage_data(cfg: Any, stage: Any) -> Any:
    """The `data` config a stage of `data_stages` trains on: the `data` group with the stage's non-null fields."""
    data = OmegaConf.to_container(cfg.data)
    overrides = {name: value for name, value in OmegaConf.to_container(stage.data).items() if value is not None}
    for name, coupled in COUPLED_DATA_KEYS.items():
        if name in overrides and coupled not in overrides:
            data[coupled] = None
    data.update(overrides)
    return OmegaConf.create(data)
