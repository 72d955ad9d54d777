"""The config schema (typed dataclasses in Hydra's ConfigStore), composing it, normalising it, and the
batch and vocabulary values derived from it (the parallel shape is nanoexp.parallel.layout.Layout).

Key names follow nanotron's config. The schema makes an unknown or misspelled key an error at composition
time; nanoexp/validation.py holds every cross-field check. Defaults are read in conf/: the schema types the
keys, and its defaults are conf's (tests/test_config.py checks they agree) or those of keys no conf file sets.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


@dataclass
class GeneralConfig:
    seed: int = 42
    project: str = "nanoexp"
    run: str = "default"
    check_memory: bool = True   # refuse at start a run whose memory estimate exceeds the machine's (false: start it)


@dataclass
class TokenizerConfig:
    tokenizer_name_or_path: str = "byte"   # "byte" = built-in UTF-8 byte tokenizer, or a local HF folder


@dataclass
class TokensConfig:
    sequence_length: int = 128
    micro_batch_size: int = 4
    batch_accumulation_per_replica: Optional[int] = None   # null: global_batch_size / (dp * micro_batch_size)
    global_batch_size: int = 32
    train_steps: int = 240
    val_check_interval: int = 120
    limit_val_batches: int = 4    # global batches of held-out data per evaluation (0: all)


@dataclass
class LlamaConfig:
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    num_hidden_layers: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: Optional[int] = MISSING   # null: as many as attention heads
    vocab_size: int = 257
    max_position_embeddings: int = MISSING
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qk_norm: bool = False   # RMSNorm over each head's query and key before the rotation (Qwen3's)


@dataclass
class InitMethod:
    std: float = MISSING    # every conf/model file sets it: it depends on the width
    path: Optional[str] = None   # a local Hugging Face Llama folder to start from


@dataclass
class MupConfig:
    base_width: Optional[int] = None   # µP: the hidden size at which it equals standard (m = hidden_size / base_width)
    attention_multiplier: float = 1.0  # µP: attention scores attention_multiplier * q·k / d_head


@dataclass
class MoeConfig:
    num_experts: int = 0              # 0: every layer dense; > 0: mixture of experts (nanoexp/model/moe.py)
    top_k: int = 2                    # routed experts per token
    moe_intermediate_size: Optional[int] = None   # each expert's SwiGLU width (null: model_config.intermediate_size)
    num_shared_experts: int = 0       # experts every token goes through (one MLP this many experts wide)
    layer_frequency: int = 1          # every k-th layer is MoE (layers k-1, 2k-1, ...), the others dense
    router: str = "softmax_topk"      # softmax_topk | softmax_topk_normalized (the top-k weights sum to 1)
    aux_loss_coef: float = 0.01       # Switch/GShard load-balancing loss, per MoE layer (balance=aux_loss only)
    z_loss_coef: float = 0.0          # router z-loss (ST-MoE), per MoE layer
    capacity_factor: Optional[float] = None   # null: dropless; c: an expert takes ceil(c x tokens x top_k / E)
    expert_kernel: str = "grouped_mm"  # grouped_mm | loop: how the routed experts run (nanoexp/model/experts.py)
    balance: str = "aux_loss"         # aux_loss | bias (DeepSeek-V3's routing bias, no aux loss) | none
    bias_update_rate: Optional[float] = None   # balance=bias: the bias's step after each optimizer step (null: 0.001)
    seq_aux_loss_coef: float = 0.0    # sequence-wise balancing loss (DeepSeek-V3's), per MoE layer


@dataclass
class Fp8Config:
    """FP8 linears through torchao (nanoexp/numerics/fp8.py, docs/fp8.md); names after torchtitan's `float8`."""
    enabled: bool = False
    recipe: str = "tensorwise"   # tensorwise | rowwise (torchao's recipe names)
    # a linear whose module name contains one of these stays in high precision (the LM head, MoE routers)
    filter_fqns: List[str] = field(default_factory=lambda: ["lm_head", "router"])
    gather_in_fp8: bool = False  # ZeRO-3 gathers FP8 layers' weights in FP8 (tensorwise only)
    # the products in float32 from the same FP8 operands (torchao's emulation); null: where the device has no FP8
    # units (a CPU, a GPU below compute capability 8.9); false: torch._scaled_mm (on a CPU: as fast as the CPU's)
    emulate: Optional[bool] = None


@dataclass
class ModelConfig:
    dtype: str = "float32"   # float32 | bfloat16 (bf16 autocast, float32 master weights and grads)
    init_method: InitMethod = field(default_factory=InitMethod)
    parametrization: str = "standard"   # standard | mup (nanoexp/model/mup.py)
    mup: MupConfig = field(default_factory=MupConfig)
    make_vocab_size_divisible_by: int = 64
    compile: bool = False
    allow_tf32: Optional[bool] = None   # float32 matmuls on CUDA in TF32 (null: on with CUDA; CPU: no effect)
    flush_denormals: bool = True   # CPU: results below float32's smallest normal (1.2e-38) are 0, on every thread
    ddp_bucket_cap_mb: Optional[float] = None   # null: 25 with NCCL, 4 with gloo (its reduce-scatter copies a bucket)
    attention_mask: str = "causal"   # causal | document (packed documents attend within themselves, positions restart)
    attention_kernel: str = "auto"   # auto | sdpa | flash (nanoexp/model/attention.py; auto: flash-attn where it runs)
    model_config: LlamaConfig = field(default_factory=LlamaConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)


@dataclass
class OptimizerFactory:
    name: str = "adamW"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    torch_adam_is_fused: bool = False   # foreach is used when false
    # name=muon (docs/optimizers.md): torch.optim.Muon's settings for the hidden matrices; the rest use the adam_*
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5              # Newton–Schulz iterations
    muon_ns_coefficients: List[float] = field(default_factory=lambda: [3.4445, -4.775, 2.0315])
    muon_adjust_lr_fn: str = "original"   # original | match_rms_adamw


@dataclass
class LRSchedulerConfig:
    learning_rate: float = 4e-3
    lr_warmup_steps: int = 20
    lr_warmup_style: str = "linear"       # linear | constant
    lr_decay_style: str = "cosine"        # linear | cosine | constant
    lr_decay_steps: Optional[int] = None  # null: train_steps - the step the decay starts at
    lr_decay_starting_step: Optional[int] = None   # the peak holds after warm-up until here (null: warm-up's end)
    min_decay_lr: Optional[float] = None  # null: half the peak learning_rate (follows it in LR sweeps)


@dataclass
class OptimizerConfig:
    optimizer_factory: OptimizerFactory = field(default_factory=OptimizerFactory)
    weight_decay: float = 0.1
    clip_grad: Optional[float] = 1.0
    zero_stage: int = 0                  # 0 | 1 optimizer state | 2 + gradients | 3 + parameters, sharded over dp x cp
    zero3_prefetch: int = 1              # ZeRO-3: units (layers) gathered ahead of the one computing
    zero3_reshard_after_forward: bool = True   # ZeRO-3: free a layer after its forward (false: until its backward)
    # ZeRO-2/3: a unit's reduce-scatter stays in flight during the next unit's backward (null: on CUDA, whose
    # collectives run on their own stream; on CPU waited at once, as FSDP2 does there: less memory)
    zero_overlap_reduce_scatter: Optional[bool] = None
    skip_nonfinite_steps: bool = False   # true: skip an update whose loss or gradient is NaN/Inf
    learning_rate_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)


@dataclass
class ParallelismConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1                    # context parallel: each sample's sequence split over cp ranks
    cp_mode: str = "ring"          # ring (K/V blocks passed round the cp ranks) | all_gather (one all-gather of
                                   # K/V, Llama 3); both zig-zag load-balanced | ulysses (all-to-all to heads/cp
                                   # of the heads over the whole sequence and back; heads divisible by cp x tp)
    ep: int = 1                    # expert parallel: dp x cp ranks that split a mixture's experts (divides dp x cp)
    dp_shard: Optional[int] = None  # hybrid sharding: ZeRO shards over dp_shard x cp ranks, replicated dp / dp_shard
                                    # times (divides dp; null: shard over all of dp x cp; docs/zero.md)
    pp_engine: str = "1f1b"        # afab | 1f1b | interleaved_1f1b | zb_h1 | zbv | dualpipev (the last three split B
                                   # and W; zbv and dualpipev V-shaped, dualpipev with m >= 2·pp: docs/parallelism.md)
    pp_virtual_stages: int = 1     # chunks of layers per pp rank (interleaved_1f1b; 2 for zbv and dualpipev)
    tp_mode: str = "all_reduce"    # all_reduce | reduce_scatter (sequence parallel)
    # what each decoder layer keeps for backward (docs/memory.md#activation-recomputation): none (everything) | full
    # (its input; the forward runs again in backward) | selective (its input and the outputs of selective_ops; the
    # rest runs again) | every_k (layers k-1, 2k-1, ... full, k = recompute_every; the others everything)
    recompute: str = "none"
    recompute_every: int = 2
    selective_ops: List[str] = field(default_factory=lambda: ["matmul", "attention"])
    offload_activations: bool = False   # what a layer saves waits in pinned host memory for its backward (CUDA)
    recompute_layer: bool = False  # nanotron's spelling of recompute=full
    collective_timeout_s: float = 600.0   # a rank stuck this long in a collective is an error
    start_method: str = "auto"     # local workers: auto (spawn with CUDA, fork on CPU) | fork | spawn


@dataclass
class DataConfig:
    name: str = "builtin"          # builtin (Shakespeare) | nanoset | hf
    seed: Optional[int] = None     # the sample order's seed (nanotron's data.seed); null: general.seed
    validation_fraction: float = 0.05
    prefetch: bool = True
    dataset_folder: List[str] = field(default_factory=list)   # nanoset: one folder per dataset
    dataset_weights: Optional[List[float]] = None             # nanoset: blend weights (null: equal)
    hf_dataset_or_datasets: Optional[str] = None              # hf: local path or Hub name
    hf_dataset_config_name: Optional[str] = None
    hf_dataset_splits: str = "train"
    text_column_name: str = "text"
    streaming: bool = False


@dataclass
class DataOverrides:
    """A data stage's `data`: the fields of the `data` group, each null (the default) where the stage keeps the
    group's value. A stage that sets dataset_folder (hf_dataset_or_datasets) without dataset_weights
    (hf_dataset_config_name) does not inherit the group's: they belong to the group's datasets."""
    name: Optional[str] = None
    seed: Optional[int] = None
    validation_fraction: Optional[float] = None
    prefetch: Optional[bool] = None
    dataset_folder: Optional[List[str]] = None
    dataset_weights: Optional[List[float]] = None
    hf_dataset_or_datasets: Optional[str] = None
    hf_dataset_config_name: Optional[str] = None
    hf_dataset_splits: Optional[str] = None
    text_column_name: Optional[str] = None
    streaming: Optional[bool] = None


@dataclass
class DataStageConfig:
    """One entry of `data_stages` (nanotron's): from `start_training_step` on, training reads `data`."""
    name: str = MISSING
    start_training_step: int = MISSING
    data: DataOverrides = field(default_factory=DataOverrides)


@dataclass
class CheckpointConfig:
    checkpoint_interval: int = 0               # 0: only at the end
    checkpoints_path: Optional[str] = None     # null: <run folder>/checkpoints
    save_final_state: bool = True
    resume: str = "auto"                       # auto: continue from the newest checkpoint in checkpoints_path | never
    resume_checkpoint_path: Optional[str] = None   # a checkpoint folder to resume from (wins over resume)
    keep_last_n: Optional[int] = None          # null: keep every checkpoint
    load_optimizer: bool = True                # false: fresh AdamW state (fine-tuning from weights)
    load_lr_scheduler: bool = True             # false: the LR schedule restarts at the resumed step
    load_strict: bool = True                   # false: load the parameters model and checkpoint share, log the rest
    async_save: bool = False                   # true: write interval saves in the background (docs/checkpoints.md)


@dataclass
class WandbConfig:
    mode: str = "disabled"   # disabled | offline | online
    project: Optional[str] = None
    entity: Optional[str] = None
    name: Optional[str] = None         # null: the job's overrides (Hydra's override_dirname), else general.run
    group: Optional[str] = None        # null: the sweep folder in a multirun, else none
    tags: Optional[List[str]] = None   # null: the layout (e.g. dp2tp2pp2)


@dataclass
class ProfilerConfig:
    """torch.profiler trace of a few steps into <run>/profiler/ (nanoexp/instruments/profiling.py)."""
    enabled: bool = False
    wait: int = 1          # steps skipped first
    warmup: int = 1        # steps traced but dropped (the profiler's own start-up)
    active: int = 2        # steps recorded
    record_shapes: bool = False


@dataclass
class LoggingConfig:
    iteration_step_info_interval: int = 10
    tensorboard: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)
    peak_tflops: Optional[float] = None   # null: look the device up in the known-peak table
    pipeline_trace: bool = False          # per-rank pipeline timeline in <run>/pipeline_trace/
    exact_cpu_memory: bool = False        # CPU: glibc returns freed tensor memory at once (slower; see README Memory)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)


@dataclass
class EvalConfig:
    """Downstream tasks of EleutherAI's lm-eval in the training loop (nanoexp/evaluation/downstream.py)."""
    tasks: List[str] = field(default_factory=list)   # empty: none (the default)
    interval: int = 0                    # every this many steps, and at the end (0: only at the end)
    limit: Optional[int] = None          # examples per task (null: all)
    num_fewshot: Optional[int] = None    # null: the task's own default
    batch_size: int = 32                 # rows per scoring call
    include_path: Optional[str] = None   # a folder of your own task YAMLs (the harness's --include_path)
    bootstrap_iters: int = 1000          # the harness's bootstrap for the stderr of non-mean metrics
    on_error: str = "continue"           # a task that raises: continue (logged, training goes on) | stop


@dataclass
class FaultInjectionConfig:
    """Deliberate faults, for the robustness tests (all off by default)."""
    nonfinite_loss_at_step: Optional[int] = None   # the loss of this step becomes NaN
    hang_at_step: Optional[int] = None             # rank `hang_rank` sleeps before this step
    hang_rank: int = 0
    slow_step_s: float = 0.0                       # every rank sleeps this long before each step (a slow host)
    slow_start_up_s: float = 0.0                   # every rank sleeps this long at the end of its start-up
    stall_rank: Optional[int] = None               # this rank sleeps `stall_s` in its compute at `stall_at_step`
    stall_at_step: int = 3
    stall_s: float = 3600.0
    stall_holds_interpreter: bool = False          # that sleep holds Python's interpreter lock (no thread runs)
    sigstop_rank: Optional[int] = None             # this rank stops itself (SIGSTOP) in its compute at `stall_at_step`
    skip_collective_rank: Optional[int] = None     # this rank skips the loss all-reduce of step 3
    wrong_shape_rank: Optional[int] = None         # this rank posts the loss all-reduce of step 3 with shape [2]
    short_pipeline_rank: Optional[int] = None      # this rank runs step 3 with one micro-batch too few
    raise_rank: Optional[int] = None               # this rank raises at step 3
    slow_checkpoint_s: float = 0.0                 # rank 0 sleeps this long inside each checkpoint write
    hold_checkpoint_write: int = 0                 # async_save: rank 0's write of step S waits for step S + this
    kill_group: Optional[int] = None               # fault_tolerance: this replica group's rank 0 is SIGKILLed
    kill_at_step: int = 3                          # in its compute at this step (a restarted group heals past it)
    slow_rank: Optional[int] = None                # this rank sleeps `slow_rank_s` in each micro-batch's forward
    slow_rank_s: float = 0.05
    spike_at_step: Optional[int] = None            # the batch this step reads in a fresh run: its loss x 10
    flip_gradient_rank: Optional[int] = None       # this rank flips one bit of a gradient at `flip_gradient_step`
    flip_gradient_step: int = 2


@dataclass
class FaultToleranceConfig:
    """Replica groups that train on through a failure, with torchft (docs/fault-tolerance.md; pip install -e
    '.[ft]'). Each group is a world of the parallelism group's layout; gradients are averaged across the live groups,
    and a group that comes back copies a live peer's state."""
    method: str = "none"             # none | torchft
    replica_groups: int = 1          # R groups: the data-parallel degree is R x parallelism.dp
    min_replicas: int = 1            # fewer live groups than this: no step is committed
    lighthouse: Optional[str] = None   # http://host:port of a running lighthouse (null: nanoexp starts one here)
    group: Optional[int] = None      # which group this process (world) is (null: start every group on this machine)
    quorum_timeout_s: float = 60.0   # the longest wait for a quorum (and to reach the lighthouse)
    timeout_s: float = 30.0          # a cross-group collective, commit vote or state copy (then the step is retried)
    max_restarts: int = 3            # local launch: restarts of each group before the run gives it up
    semi_sync: str = "none"          # none (every step synchronous) | diloco (groups apart, synced every sync_every)
    sync_every: int = 20             # diloco: inner steps between syncs (H)
    outer_lr: float = 0.7            # diloco: the outer Nesterov SGD's learning rate (DiLoCo's paper)
    outer_momentum: float = 0.9      # diloco: its momentum


@dataclass
class SpikeConfig:
    """A loss above the median of the last `window` steps by `z` robust deviations (docs/health.md)."""
    action: str = "warn"      # off | warn | skip (drop the step's update) | rollback (to the last checkpoint)
    window: int = 50
    z: float = 6.0
    max_rollbacks: int = 3    # rollback: the run stops after this many


@dataclass
class HealthConfig:
    """Stragglers, loss spikes and replay checks (nanoexp/health/, docs/health.md)."""
    stragglers: bool = True
    every: int = 10                 # the ranks' compute times are compared every this many steps (a window)
    straggler_factor: float = 1.5   # a rank this many times slower than its stage's median...
    straggler_windows: int = 3      # ...for this many windows in a row is named
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    replay_every: int = 0           # every N steps forward and backward twice, gradients compared (0: off)
    replay_action: str = "stop"     # stop | skip (drop the step's update)


@dataclass
class DebugConfig:
    """Hang and desync diagnosis (docs/debugging.md)."""
    stall_s: Optional[float] = None      # no rank progressed this long: dump and diagnose. null: auto, 0: off
    flight_recorder_entries: int = 2000  # collectives each process remembers (torch's flight recorder); 0: off
    collectives: str = "off"             # check: torch checks every collective's op, shape and dtype across ranks
    cuda_sync: str = "off"               # warn | error: torch reports each host wait for the GPU (CUDA only)


@dataclass
class NanoexpConfig:
    general: GeneralConfig = field(default_factory=GeneralConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    tokens: TokensConfig = field(default_factory=TokensConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    data: DataConfig = field(default_factory=DataConfig)
    data_stages: List[DataStageConfig] = field(default_factory=list)   # empty: `data` is the one stage
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


RECOMPUTE_MODES = ("none", "full", "selective", "every_k")


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
    overrides = {key: value for key, value in OmegaConf.to_container(stage.data).items() if value is not None}
    for key, coupled in COUPLED_DATA_KEYS.items():
        if key in overrides and coupled not in overrides:
            data[coupled] = None
    data.update(overrides)
    return OmegaConf.create(data)
