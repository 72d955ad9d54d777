"""The config schema (typed dataclasses in Hydra's ConfigStore) and `validate(cfg)`.

Key names follow nanotron's config. The schema makes an unknown or misspelled key an error
at composition time; `validate` holds every cross-field check and runs before any work.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class GeneralConfig:
    seed: int = 42
    project: str = "nanoexp"
    run: str = "default"


@dataclass
class TokenizerConfig:
    tokenizer_name_or_path: str = "byte"   # "byte" = built-in UTF-8 byte tokenizer, or a local HF folder


@dataclass
class TokensConfig:
    sequence_length: int = 128
    micro_batch_size: int = 4
    batch_accumulation_per_replica: Optional[int] = None   # null: global_batch_size / (dp * micro_batch_size)
    global_batch_size: int = 32
    train_steps: int = 1000
    val_check_interval: int = 250
    limit_val_batches: int = 4    # global batches of held-out data per evaluation (0: all)


@dataclass
class LlamaConfig:
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    num_hidden_layers: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: Optional[int] = None   # null: as many as attention heads
    vocab_size: int = 257
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False


@dataclass
class InitMethod:
    std: float = 0.02
    path: Optional[str] = None   # a local Hugging Face Llama folder to start from


@dataclass
class ModelConfig:
    dtype: str = "float32"   # float32 | bfloat16 (bf16 autocast, float32 master weights and grads)
    init_method: InitMethod = field(default_factory=InitMethod)
    make_vocab_size_divisible_by: int = 64
    compile: bool = False
    model_config: LlamaConfig = field(default_factory=LlamaConfig)


@dataclass
class OptimizerFactory:
    name: str = "adamW"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    torch_adam_is_fused: bool = False   # foreach is used when false


@dataclass
class LRSchedulerConfig:
    learning_rate: float = 4e-3
    lr_warmup_steps: int = 0
    lr_warmup_style: str = "linear"       # linear | constant
    lr_decay_style: str = "cosine"        # linear | cosine | constant
    lr_decay_steps: Optional[int] = None  # null: train_steps - lr_warmup_steps
    min_decay_lr: Optional[float] = None  # null: half the peak learning_rate (follows it in LR sweeps)


@dataclass
class OptimizerConfig:
    optimizer_factory: OptimizerFactory = field(default_factory=OptimizerFactory)
    weight_decay: float = 0.1
    clip_grad: Optional[float] = 1.0
    zero_stage: int = 0
    skip_nonfinite_steps: bool = False   # true: skip an update whose loss or gradient is NaN/Inf
    learning_rate_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)


@dataclass
class ParallelismConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    pp_engine: str = "1f1b"        # afab | 1f1b | interleaved_1f1b
    pp_virtual_stages: int = 1     # chunks of layers per pp rank (interleaved_1f1b only)
    tp_mode: str = "all_reduce"    # all_reduce | reduce_scatter (sequence parallel)
    recompute_layer: bool = False
    collective_timeout_s: float = 600.0   # a rank stuck this long in a collective is an error
    start_method: str = "auto"     # local workers: auto (spawn with CUDA, fork on CPU) | fork | spawn


@dataclass
class DataConfig:
    name: str = "builtin"          # builtin (Shakespeare) | nanoset | hf
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
class CheckpointConfig:
    checkpoint_interval: int = 0               # 0: only at the end
    checkpoints_path: Optional[str] = None     # null: <run folder>/checkpoints
    save_final_state: bool = True
    resume: str = "auto"                       # auto: continue from the newest checkpoint in checkpoints_path | never
    resume_checkpoint_path: Optional[str] = None   # a checkpoint folder to resume from (wins over resume)
    keep_last_n: Optional[int] = None          # null: keep every checkpoint
    load_optimizer: bool = True                # false: fresh AdamW state (fine-tuning from weights)
    load_lr_scheduler: bool = True             # false: the LR schedule restarts at the resumed step


@dataclass
class WandbConfig:
    mode: str = "disabled"   # disabled | offline | online
    project: Optional[str] = None
    entity: Optional[str] = None


@dataclass
class ProfilerConfig:
    """torch.profiler trace of a few steps into <run>/profiler/ (nanoexp/profiling.py)."""
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
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)


@dataclass
class FaultInjectionConfig:
    """Deliberate faults, for the robustness tests (all off by default)."""
    nonfinite_loss_at_step: Optional[int] = None   # the loss of this step becomes NaN
    hang_at_step: Optional[int] = None             # rank `hang_rank` sleeps before this step
    hang_rank: int = 0


@dataclass
class NanoexpConfig:
    general: GeneralConfig = field(default_factory=GeneralConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    tokens: TokensConfig = field(default_factory=TokensConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    fault_injection: FaultInjectionConfig = field(default_factory=FaultInjectionConfig)


def register_configs() -> None:
    ConfigStore.instance().store(name="nanoexp_schema", node=NanoexpConfig)


class ConfigError(ValueError):
    """An invalid configuration: one line per problem, each naming the key and the fix."""


PP_ENGINES = ("afab", "1f1b", "interleaved_1f1b")
TP_MODES = ("all_reduce", "reduce_scatter")
DTYPES = ("float32", "bfloat16")
DECAY_STYLES = ("linear", "cosine", "constant")
WARMUP_STYLES = ("linear", "constant")
OPTIMIZERS = ("adamw",)
DATA_SOURCES = ("builtin", "nanoset", "hf")


def normalize(cfg: Any) -> None:
    """Accept nanotron's upper-case enum spellings (ALL_REDUCE, 1F1B, ...)."""
    cfg.parallelism.tp_mode = str(cfg.parallelism.tp_mode).lower()
    cfg.parallelism.pp_engine = str(cfg.parallelism.pp_engine).lower()
    cfg.optimizer.learning_rate_scheduler.lr_decay_style = str(
        cfg.optimizer.learning_rate_scheduler.lr_decay_style).lower()
    cfg.optimizer.learning_rate_scheduler.lr_warmup_style = str(
        cfg.optimizer.learning_rate_scheduler.lr_warmup_style).lower()


def padded_vocab_size(cfg: Any) -> int:
    multiple = cfg.model.make_vocab_size_divisible_by
    vocab = cfg.model.model_config.vocab_size
    return -(-vocab // multiple) * multiple


def num_kv_heads(cfg: Any) -> int:
    m = cfg.model.model_config
    return m.num_key_value_heads or m.num_attention_heads


def batch_accumulation(cfg: Any) -> int:
    """Micro-batches per optimizer step and dp replica (nanotron's batch_accumulation_per_replica)."""
    t, dp = cfg.tokens, cfg.parallelism.dp
    if t.batch_accumulation_per_replica is not None:
        return t.batch_accumulation_per_replica
    return t.global_batch_size // (dp * t.micro_batch_size)


def global_batch_size(cfg: Any) -> int:
    return cfg.parallelism.dp * cfg.tokens.micro_batch_size * batch_accumulation(cfg)


def validate(cfg: Any, world_size: Optional[int] = None, tokenizer_vocab_size: Optional[int] = None) -> None:
    """Check every cross-field rule; raise one ConfigError listing each problem with its fix."""
    normalize(cfg)
    problems: list[str] = []

    def check(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    m, t, p = cfg.model.model_config, cfg.tokens, cfg.parallelism
    lr = cfg.optimizer.learning_rate_scheduler
    positive = {
        "model.model_config.hidden_size": m.hidden_size,
        "model.model_config.intermediate_size": m.intermediate_size,
        "model.model_config.num_hidden_layers": m.num_hidden_layers,
        "model.model_config.num_attention_heads": m.num_attention_heads,
        "model.model_config.vocab_size": m.vocab_size,
        "model.model_config.max_position_embeddings": m.max_position_embeddings,
        "model.make_vocab_size_divisible_by": cfg.model.make_vocab_size_divisible_by,
        "tokens.sequence_length": t.sequence_length,
        "tokens.micro_batch_size": t.micro_batch_size,
        "tokens.global_batch_size": t.global_batch_size,
        "tokens.train_steps": t.train_steps,
        "parallelism.dp": p.dp, "parallelism.tp": p.tp, "parallelism.pp": p.pp,
        "parallelism.pp_virtual_stages": p.pp_virtual_stages,
    }
    for key, value in positive.items():
        check(value > 0, f"{key}={value}: must be a positive integer")
    if t.batch_accumulation_per_replica is not None:
        check(t.batch_accumulation_per_replica > 0,
              f"tokens.batch_accumulation_per_replica={t.batch_accumulation_per_replica}: must be positive (or null)")
    if problems:  # the divisibility checks below would only repeat these
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))

    kv = num_kv_heads(cfg)
    check(m.hidden_size % m.num_attention_heads == 0,
          f"model.model_config.hidden_size={m.hidden_size} is not divisible by num_attention_heads="
          f"{m.num_attention_heads}: choose a head count that divides it")
    check(kv > 0 and m.num_attention_heads % kv == 0,
          f"model.model_config.num_key_value_heads={kv} must divide num_attention_heads={m.num_attention_heads}")
    check((m.hidden_size // m.num_attention_heads) % 2 == 0,
          f"model.model_config.hidden_size / num_attention_heads = {m.hidden_size // m.num_attention_heads}: "
          "the head dimension must be even for rotary embeddings")
    check(t.sequence_length <= m.max_position_embeddings,
          f"tokens.sequence_length={t.sequence_length} exceeds model.model_config.max_position_embeddings="
          f"{m.max_position_embeddings}: shorten the sequence or raise max_position_embeddings")
    if tokenizer_vocab_size is not None:
        check(tokenizer_vocab_size <= m.vocab_size,
              f"model.model_config.vocab_size={m.vocab_size} is smaller than the tokenizer's vocabulary "
              f"({tokenizer_vocab_size}, tokenizer.tokenizer_name_or_path={cfg.tokenizer.tokenizer_name_or_path}): "
              f"set model.model_config.vocab_size>={tokenizer_vocab_size}")
    check(cfg.model.dtype in DTYPES, f"model.dtype={cfg.model.dtype}: allowed values are {', '.join(DTYPES)}")

    # Parallelism.
    check(p.pp_engine in PP_ENGINES,
          f"parallelism.pp_engine={p.pp_engine}: allowed values are {', '.join(PP_ENGINES)}")
    check(p.tp_mode in TP_MODES, f"parallelism.tp_mode={p.tp_mode}: allowed values are {', '.join(TP_MODES)}")
    check(m.num_attention_heads % p.tp == 0,
          f"model.model_config.num_attention_heads={m.num_attention_heads} is not divisible by parallelism.tp={p.tp}")
    check(kv % p.tp == 0,
          f"model.model_config.num_key_value_heads={kv} is not divisible by parallelism.tp={p.tp}")
    check(m.intermediate_size % p.tp == 0,
          f"model.model_config.intermediate_size={m.intermediate_size} is not divisible by parallelism.tp={p.tp}")
    check(padded_vocab_size(cfg) % p.tp == 0,
          f"padded vocabulary {padded_vocab_size(cfg)} is not divisible by parallelism.tp={p.tp}: "
          f"set model.make_vocab_size_divisible_by to a multiple of {p.tp}")
    check(p.pp <= m.num_hidden_layers,
          f"parallelism.pp={p.pp} is larger than model.model_config.num_hidden_layers={m.num_hidden_layers}: "
          "every pipeline stage needs at least one layer")
    if p.tp_mode == "reduce_scatter":
        check(t.sequence_length % p.tp == 0,
              f"tokens.sequence_length={t.sequence_length} is not divisible by parallelism.tp={p.tp} "
              "(needed by parallelism.tp_mode=reduce_scatter)")
    if world_size is not None:
        check(p.dp * p.tp * p.pp == world_size,
              f"parallelism.dp*tp*pp = {p.dp}*{p.tp}*{p.pp} = {p.dp * p.tp * p.pp} but the world size is "
              f"{world_size}: make the product equal the number of processes")

    # Batch.
    if t.batch_accumulation_per_replica is None:
        check(t.global_batch_size % (p.dp * t.micro_batch_size) == 0,
              f"tokens.global_batch_size={t.global_batch_size} is not divisible by parallelism.dp * "
              f"tokens.micro_batch_size = {p.dp * t.micro_batch_size}: change one, or set "
              "tokens.batch_accumulation_per_replica explicitly")
    # Fewer micro-batches than stages is allowed: the pipeline stays correct, only the bubble grows.
    if p.pp_engine == "interleaved_1f1b":
        v, micro = p.pp_virtual_stages, batch_accumulation(cfg)
        check(p.pp >= 2, f"parallelism.pp_engine=interleaved_1f1b needs parallelism.pp >= 2 (got {p.pp})")
        check(v >= 2, f"parallelism.pp_virtual_stages={v}: interleaved_1f1b needs at least 2 chunks per rank "
              "(with 1 use parallelism.pp_engine=1f1b)")
        check(m.num_hidden_layers >= p.pp * v,
              f"model.model_config.num_hidden_layers={m.num_hidden_layers} is smaller than parallelism.pp * "
              f"pp_virtual_stages = {p.pp * v}: every virtual stage needs at least one layer")
        check(micro % p.pp == 0,
              f"micro-batches per step (tokens.batch_accumulation_per_replica = {micro}) is not a multiple of "
              f"parallelism.pp={p.pp}: interleaved_1f1b sends micro-batches in groups of pp; change "
              "tokens.global_batch_size or tokens.micro_batch_size")
    else:
        check(p.pp_virtual_stages == 1, f"parallelism.pp_virtual_stages={p.pp_virtual_stages} needs "
              f"parallelism.pp_engine=interleaved_1f1b (got {p.pp_engine})")
    check(p.start_method in ("auto", "fork", "spawn"),
          f"parallelism.start_method={p.start_method}: allowed values are auto, fork, spawn")
    check(p.collective_timeout_s > 0,
          f"parallelism.collective_timeout_s={p.collective_timeout_s}: must be positive (seconds)")
    check(t.val_check_interval >= 0, f"tokens.val_check_interval={t.val_check_interval}: must be >= 0 (0: only at the end)")

    # Optimizer and schedule.
    check(cfg.optimizer.optimizer_factory.name.lower() in OPTIMIZERS,
          f"optimizer.optimizer_factory.name={cfg.optimizer.optimizer_factory.name}: allowed values are adamW")
    check(cfg.optimizer.zero_stage in (0, 1), f"optimizer.zero_stage={cfg.optimizer.zero_stage}: allowed values are 0, 1")
    check(lr.learning_rate > 0, f"optimizer.learning_rate_scheduler.learning_rate={lr.learning_rate}: must be positive")
    check(lr.lr_decay_style in DECAY_STYLES,
          f"optimizer.learning_rate_scheduler.lr_decay_style={lr.lr_decay_style}: allowed values are "
          f"{', '.join(DECAY_STYLES)}")
    check(lr.lr_warmup_style in WARMUP_STYLES,
          f"optimizer.learning_rate_scheduler.lr_warmup_style={lr.lr_warmup_style}: allowed values are "
          f"{', '.join(WARMUP_STYLES)}")
    check(0 <= lr.lr_warmup_steps <= t.train_steps,
          f"optimizer.learning_rate_scheduler.lr_warmup_steps={lr.lr_warmup_steps} must be between 0 and "
          f"tokens.train_steps={t.train_steps}")
    check(lr.min_decay_lr is None or 0 <= lr.min_decay_lr <= lr.learning_rate,
          f"optimizer.learning_rate_scheduler.min_decay_lr={lr.min_decay_lr} must be between 0 and learning_rate")
    if cfg.optimizer.clip_grad is not None:
        check(cfg.optimizer.clip_grad > 0, f"optimizer.clip_grad={cfg.optimizer.clip_grad}: must be positive or null")

    # Checkpoints and initial weights.
    ck = cfg.checkpoint
    check(ck.checkpoint_interval >= 0,
          f"checkpoint.checkpoint_interval={ck.checkpoint_interval}: must be >= 0 (0: only at the end)")
    check(ck.resume in ("auto", "never"), f"checkpoint.resume={ck.resume}: allowed values are auto, never")
    check(ck.keep_last_n is None or ck.keep_last_n >= 1,
          f"checkpoint.keep_last_n={ck.keep_last_n}: must be >= 1 or null (keep all)")
    if ck.resume_checkpoint_path:
        check(os.path.isfile(os.path.join(ck.resume_checkpoint_path, "meta.json")),
              f"checkpoint.resume_checkpoint_path={ck.resume_checkpoint_path}: no such checkpoint "
              "(a folder <checkpoints_path>/<step> holding meta.json)")
    if cfg.model.init_method.path:
        check(os.path.isfile(os.path.join(cfg.model.init_method.path, "config.json")),
              f"model.init_method.path={cfg.model.init_method.path}: not a Hugging Face model folder "
              "(no config.json there)")

    # Data and logging.
    d = cfg.data
    check(d.name in DATA_SOURCES, f"data.name={d.name}: allowed values are {', '.join(DATA_SOURCES)}")
    if d.name == "nanoset":
        check(len(d.dataset_folder) > 0, "data.dataset_folder is empty: give one or more Nanoset folders, "
              "e.g. data.dataset_folder=[data/nanoset/web]")
        if d.dataset_weights is not None:
            check(len(d.dataset_weights) == len(d.dataset_folder),
                  f"data.dataset_weights has {len(d.dataset_weights)} values for {len(d.dataset_folder)} "
                  "data.dataset_folder entries: give one weight per folder (or null for equal weights)")
            check(all(w > 0 for w in d.dataset_weights),
                  f"data.dataset_weights={list(d.dataset_weights)}: every weight must be positive")
    if d.name == "hf":
        check(bool(d.hf_dataset_or_datasets), "data.hf_dataset_or_datasets is not set: give a local path or a Hub name")
        check(bool(d.text_column_name), "data.text_column_name is empty: name the column holding the text")
    check(0 < cfg.data.validation_fraction < 1,
          f"data.validation_fraction={cfg.data.validation_fraction}: must be between 0 and 1")
    check(cfg.logging.iteration_step_info_interval > 0,
          f"logging.iteration_step_info_interval={cfg.logging.iteration_step_info_interval}: must be positive")
    check(cfg.logging.wandb.mode in ("disabled", "offline", "online"),
          f"logging.wandb.mode={cfg.logging.wandb.mode}: allowed values are disabled, offline, online")
    prof = cfg.logging.profiler
    check(prof.wait >= 0 and prof.warmup >= 0 and prof.active >= 1,
          f"logging.profiler.wait={prof.wait}, warmup={prof.warmup}, active={prof.active}: wait and warmup must "
          "be >= 0 and active >= 1")

    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
