"""`validate(cfg)`: every check of a composed, normalised config (config.normalize), before any work. First
each key on its own (nanoexp/config_domains.py: known to the schema, set, in its domain; here: a registry's
names), then the rules across keys: each config group has one function listing them as (condition, message)
pairs, the message naming the key, the bad value and what is allowed; last, keys set where they have no effect.
`validate` raises every broken rule at once, one line each, as one ConfigError. It only reads the config."""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional

import torch

from nanoexp.config import (ConfigError, NanoexpConfig, TokensConfig, batch_accumulation, num_kv_heads,
                            optimizer_name, padded_vocab_size, replica_groups, stage_data)
from nanoexp.config_domains import Rule, effect_rules, schema_rules
from nanoexp.data.sources import SOURCES
from nanoexp.model.experts import EXPERT_KERNELS
from nanoexp.model.moe import BALANCES, ROUTERS, balance_rules, routes_with_bias
from nanoexp.model.attention import ATTENTION_KERNELS, flash_attn_func, kernel_problems
from nanoexp.model.saved_ops import SAVABLE_OPS
from nanoexp.numerics.converters import format_problems
from nanoexp.numerics.fp8 import RECIPES
from nanoexp.optim.registry import OPTIMIZERS
from nanoexp.parallel.context_parallel import CP_KERNELS
from nanoexp.parallel.layout import TP_MODES, Layout
from nanoexp.parallel.pipeline.schedules import SCHEDULES
from nanoexp.parallel.replicas import METHODS, SEMI_SYNC, replica_rules

# Key prefixes, so that the rules below fit on a line.
MODEL_CONFIG = "model.model_config."
LR_SCHEDULER, ADAM = "optimizer.learning_rate_scheduler.", "optimizer.optimizer_factory."
# Keys whose values are a registry's names: the registries sit above the schema (nanoexp/config.py), so their
# names are checked here, after the schema's own domains.
REGISTRIES = {"model.attention_kernel": ATTENTION_KERNELS, "model.fp8.recipe": RECIPES,
              "model.moe.router": ROUTERS, "model.moe.expert_kernel": EXPERT_KERNELS, "model.moe.balance": BALANCES,
              "parallelism.pp_engine": SCHEDULES, "parallelism.tp_mode": TP_MODES, "parallelism.cp_mode": CP_KERNELS,
              "fault_tolerance.method": METHODS, "fault_tolerance.semi_sync": SEMI_SYNC}


def validate(cfg: Any, world_size: Optional[int] = None, tokenizer_vocab_size: Optional[int] = None,
             unread_keys: bool = True, each_key: bool = True) -> None:
    """Check every rule; raise one ConfigError listing each problem with its fix (one line for one problem).
    `unread_keys=False` lets keys without effect pass (the planner tries layouts under which some have none);
    `each_key=False` skips the checks of each key on its own, for a plain copy (not a DictConfig) of a config
    whose keys were checked and of which only values in their domains changed (the planner's layouts)."""
    rules = key_rules(cfg) if each_key else []
    if all(ok for ok, _ in rules):   # the rules below compare, divide and look up these keys' values
        rules = (model_rules(cfg, tokenizer_vocab_size) + batch_rules(cfg) + parallelism_rules(cfg, world_size)
                 + optimizer_rules(cfg) + weights_rules(cfg) + data_rules(cfg) + eval_rules(cfg) + fault_rules(cfg)
                 + replica_rules(cfg) + health_rules(cfg))
    problems = [message for ok, message in rules if not ok]
    if not problems and unread_keys:   # every value is valid: is each one read? (a wrong value is said once)
        problems = [message for ok, message in effect_rules(cfg, NanoexpConfig) + [batch_size_rule(cfg)] if not ok]
    if len(problems) == 1:
        raise ConfigError(f"invalid config: {problems[0]}")
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))


def key_rules(cfg: Any) -> list[Rule]:
    """Each key on its own: in the schema's domain (config_domains), then, a registry's key, one of its names."""
    rules = schema_rules(cfg, NanoexpConfig)
    if not all(ok for ok, _ in rules):
        return rules
    unknown_ops = [name for name in cfg.parallelism.selective_ops if name not in SAVABLE_OPS]
    return [one_of(cfg, key, tuple(names)) for key, names in REGISTRIES.items()] + [
        (optimizer_name(cfg) in OPTIMIZERS,
         f"{ADAM}name={cfg.optimizer.optimizer_factory.name}: allowed values are {', '.join(OPTIMIZERS)} (any case)"),
        (not unknown_ops, f"parallelism.selective_ops={list(cfg.parallelism.selective_ops)}: {', '.join(unknown_ops)} "
         f"{'is' if len(unknown_ops) == 1 else 'are'} not an op group it knows; known: {', '.join(SAVABLE_OPS)}"),
    ]


def must(cfg: Any, key: str, ok: Callable[[Any], bool], allowed: str) -> Rule:
    """The rule that the value at `key` passes `ok`, and its message "key=value: must be <allowed>"."""
    value = functools.reduce(getattr, key.split("."), cfg)
    return ok(value), f"{key}={value}: must be {allowed}"


def one_of(cfg: Any, key: str, allowed: tuple) -> Rule:
    value = functools.reduce(getattr, key.split("."), cfg)
    return value in allowed, f"{key}={value}: allowed values are {', '.join(map(str, allowed))}"


def model_rules(cfg: Any, tokenizer_vocab_size: Optional[int]) -> list[Rule]:
    m, kv = cfg.model.model_config, num_kv_heads(cfg)
    head_dim, tokenizer = m.hidden_size // m.num_attention_heads, cfg.tokenizer.tokenizer_name_or_path
    return [
        (m.hidden_size % m.num_attention_heads == 0, f"{MODEL_CONFIG}hidden_size={m.hidden_size} is not divisible by "
         f"num_attention_heads={m.num_attention_heads}: choose a head count that divides it"),
        (m.num_attention_heads % kv == 0,
         f"{MODEL_CONFIG}num_key_value_heads={kv} must divide num_attention_heads={m.num_attention_heads}"),
        (head_dim % 2 == 0, f"{MODEL_CONFIG}hidden_size / num_attention_heads = {head_dim}: the head dimension "
         "must be even for rotary embeddings"),
        (tokenizer_vocab_size is None or tokenizer_vocab_size <= m.vocab_size,
         f"{MODEL_CONFIG}vocab_size={m.vocab_size} is smaller than the tokenizer's vocabulary "
         f"({tokenizer_vocab_size}, tokenizer.tokenizer_name_or_path={tokenizer}): set "
         f"{MODEL_CONFIG}vocab_size>={tokenizer_vocab_size}"),
    ] + [(False, problem) for problem in kernel_problems(cfg.model.attention_kernel) + format_problems(cfg)] \
        + parametrization_rules(cfg) + moe_rules(cfg)


def moe_rules(cfg: Any) -> list[Rule]:
    """model.moe: a mixture of experts (num_experts > 0) needs a routing that fits it; Hugging Face weights load
    only as a Mixtral."""
    moe, model = cfg.model.moe, cfg.model
    if moe.num_experts == 0:
        return []
    return balance_rules(cfg.model.moe) + [
        must(cfg, "model.moe.top_k", lambda k: 1 <= k <= moe.num_experts,
             f"between 1 and model.moe.num_experts={moe.num_experts}"),
        must(cfg, "model.moe.layer_frequency", lambda k: 1 <= k <= model.model_config.num_hidden_layers,
             f"between 1 and {MODEL_CONFIG}num_hidden_layers={model.model_config.num_hidden_layers}"),
        (moe.capacity_factor is None or (cfg.parallelism.cp == 1 and cfg.parallelism.tp_mode != "reduce_scatter"),
         f"model.moe.capacity_factor={moe.capacity_factor} with parallelism.cp={cfg.parallelism.cp} and "
         f"tp_mode={cfg.parallelism.tp_mode}: an expert's capacity counts a rank's tokens, so splitting a "
         "micro-batch's tokens over cp or sequence-parallel ranks would drop other tokens than one process; "
         "use cp=1 and tp_mode=all_reduce, or capacity_factor=null (dropless)"),
        (not model.init_method.path or (moe.num_shared_experts == 0 and not routes_with_bias(moe.balance) and (
            model.model_config.qk_norm or (moe.layer_frequency == 1 and moe.router == "softmax_topk_normalized"))),
         f"model.init_method.path={model.init_method.path}: Hugging Face mixtures of experts load as Mixtral or "
         "Qwen3-MoE, which need model.moe.num_shared_experts=0 and a balance other than bias (Mixtral: "
         "layer_frequency=1 and router=softmax_topk_normalized; Qwen3-MoE: model.model_config.qk_norm=true)"),
    ]


def parametrization_rules(cfg: Any) -> list[Rule]:
    """µP needs its base width; HF Llama weights are a standard-parametrization model."""
    model = cfg.model
    if model.parametrization != "mup":
        return []
    return [
        must(cfg, "model.mup.base_width", lambda width: width is not None, "a positive hidden size with "
             "model.parametrization=mup: the width at which µP equals standard (e.g. the smallest width of a sweep)"),
        (not model.init_method.path, f"model.init_method.path={model.init_method.path}: Hugging Face Llama weights "
         "are a standard-parametrization model; load them with model.parametrization=standard"),
    ]


def batch_rules(cfg: Any) -> list[Rule]:
    t, m, dp, groups = cfg.tokens, cfg.model.model_config, cfg.parallelism.dp, replica_groups(cfg)
    return [
        (t.sequence_length <= m.max_position_embeddings, f"tokens.sequence_length={t.sequence_length} exceeds "
         f"{MODEL_CONFIG}max_position_embeddings={m.max_position_embeddings}: shorten the sequence or raise "
         "max_position_embeddings"),
        (t.batch_accumulation_per_replica is not None or t.global_batch_size % (dp * t.micro_batch_size) == 0,
         f"tokens.global_batch_size={t.global_batch_size} is not divisible by parallelism.dp * tokens.micro_batch_size "
         f"= {dp * t.micro_batch_size}: change one, or set tokens.batch_accumulation_per_replica explicitly"),
        (t.batch_accumulation_per_replica is not None or t.global_batch_size % (dp * groups * t.micro_batch_size) == 0
         or t.global_batch_size % (dp * t.micro_batch_size), f"fault_tolerance.replica_groups={groups} does not divide "
         f"the global batch: tokens.global_batch_size={t.global_batch_size} is not divisible by replica_groups x "
         f"parallelism.dp x tokens.micro_batch_size = {groups * dp * t.micro_batch_size}"),
    ]


def parallelism_rules(cfg: Any, world_size: Optional[int]) -> list[Rule]:
    layout, m, t, kv = Layout.from_config(cfg), cfg.model.model_config, cfg.tokens, num_kv_heads(cfg)
    p, v, micro, padded_vocab = layout, layout.virtual_stages, batch_accumulation(cfg), padded_vocab_size(cfg)
    layers = f"{MODEL_CONFIG}num_hidden_layers={m.num_hidden_layers}"
    # Fewer micro-batches than stages is allowed: the pipeline stays correct, only the bubble grows.
    return [
        *[(size % p.tp == 0, f"{MODEL_CONFIG}{name}={size} is not divisible by parallelism.tp={p.tp}")
          for name, size in [("num_attention_heads", m.num_attention_heads), ("num_key_value_heads", kv),
                             ("intermediate_size", m.intermediate_size)]],
        (padded_vocab % p.tp == 0, f"padded vocabulary {padded_vocab} is not divisible by parallelism.tp={p.tp}: "
         f"set model.make_vocab_size_divisible_by to a multiple of {p.tp}"),
        (p.pp <= m.num_hidden_layers, f"parallelism.pp={p.pp} is larger than {layers}: every pipeline stage needs "
         "at least one layer"),
        (not layout.sequence_parallel or t.sequence_length % p.tp == 0, f"tokens.sequence_length={t.sequence_length}"
         f" is not divisible by parallelism.tp={p.tp} (needed by parallelism.tp_mode=reduce_scatter)"),
        (world_size is None or layout.world_size == world_size, f"parallelism.dp*cp*tp*pp = {p.dp}*{p.cp}*{p.tp}*"
         f"{p.pp} = {layout.world_size} but the world size is {world_size}: make the product equal the number of "
         "processes"),
        *[(False, problem) for problem in SCHEDULES[layout.schedule].problems(layout.schedule, p.pp, v, micro,
                                                                              m.num_hidden_layers)],
    ] + context_parallel_rules(cfg, layout) + expert_parallel_rules(cfg, layout) \
        + hybrid_sharding_rules(cfg, layout) + recompute_rules(cfg)


def recompute_rules(cfg: Any) -> list[Rule]:
    """nanotron's recompute_layer=true means recompute=full, so beside another mode it is ambiguous."""
    p = cfg.parallelism
    return [(not p.recompute_layer or p.recompute in ("none", "full"), f"parallelism.recompute_layer=true is "
             f"nanotron's spelling of parallelism.recompute=full, which contradicts parallelism.recompute={p.recompute}"
             ": set only parallelism.recompute")]


def hybrid_sharding_rules(cfg: Any, layout: Layout) -> list[Rule]:
    """parallelism.dp_shard: ZeRO shards over dp_shard x cp ranks and replicates across dp / dp_shard of them
    (docs/zero.md#hybrid-sharding)."""
    shard, dp, ep = cfg.parallelism.dp_shard, layout.dp, layout.ep
    if shard is None:
        return []
    key = f"parallelism.dp_shard={shard}"
    return [
        (dp % shard == 0, f"{key} does not divide parallelism.dp={dp}: dp = replicas x dp_shard"),
        (cfg.optimizer.zero_stage >= 1, f"{key} has no effect at optimizer.zero_stage=0 (nothing is sharded): set "
         "optimizer.zero_stage to 1, 2 or 3, or parallelism.dp_shard=null"),
        (dp % shard or layout.shard_size % ep == 0, f"{key} with parallelism.ep={ep}: ep must divide dp_shard * cp "
         f"= {shard * layout.cp}, so that an ep group lies inside one shard group (the experts shard over its edp "
         "ranks there); change parallelism.dp_shard or parallelism.ep"),
    ]


def eval_rules(cfg: Any) -> list[Rule]:
    """The eval group (downstream tasks): whether its tasks exist is checked at start (checks.check_config)."""
    e = cfg.eval
    return [(not e.include_path or os.path.isdir(os.path.expanduser(e.include_path)),
             f"eval.include_path={e.include_path}: no such folder (a folder of lm-eval task YAMLs)")]


def expert_parallel_rules(cfg: Any, layout: Layout) -> list[Rule]:
    """ep splits a mixture's experts over groups of dp x cp ranks (Layout.ep)."""
    ep, experts = layout.ep, cfg.model.moe.num_experts
    if ep == 1:
        return []
    return [
        (experts > 0, f"parallelism.ep={ep} needs a mixture of experts: set model.moe.num_experts (e.g. "
         "model=moe_tiny) or parallelism.ep=1"),
        (layout.dp_cp % ep == 0, f"parallelism.ep={ep} does not divide parallelism.dp * cp = {layout.dp_cp}: expert "
         "parallelism splits the experts over dp x cp ranks; change parallelism.ep or parallelism.dp"),
        (experts == 0 or experts % ep == 0, f"model.moe.num_experts={experts} is not divisible by parallelism.ep={ep}:"
         " each ep rank holds num_experts / ep experts"),
    ]


def context_parallel_rules(cfg: Any, layout: Layout) -> list[Rule]:
    """cp splits each sequence into 2·cp zig-zag chunks (two per cp rank); tp's sequence parallelism then splits
    a rank's s/cp tokens."""
    cp, tp, s = layout.cp, layout.tp, cfg.tokens.sequence_length
    if cp == 1:
        return []
    return [(False, problem) for problem in CP_KERNELS[layout.cp_mode].problems(cfg, layout)] + [
        (s % (2 * cp) == 0, f"tokens.sequence_length={s} is not divisible by 2 * parallelism.cp = {2 * cp}: "
         "context parallelism gives each cp rank two of 2·cp equal chunks"),
        (not layout.sequence_parallel or s % (2 * cp) or layout.local_tokens(s) % tp == 0,
         f"tokens.sequence_length / parallelism.cp = {s}/{cp} is not divisible by parallelism.tp={tp} (needed "
         "by parallelism.tp_mode=reduce_scatter): change tokens.sequence_length"),
    ]


def optimizer_rules(cfg: Any) -> list[Rule]:
    lr, steps = cfg.optimizer.learning_rate_scheduler, cfg.tokens.train_steps
    return [
        (lr.lr_warmup_steps <= steps, f"{LR_SCHEDULER}lr_warmup_steps={lr.lr_warmup_steps} must be between 0 and "
         f"tokens.train_steps={steps} (for a quick smoke test use debug=fast, which shrinks both)"),
        must(cfg, LR_SCHEDULER + "lr_decay_starting_step", lambda start: start is None or start >= lr.lr_warmup_steps,
             f">= lr_warmup_steps={lr.lr_warmup_steps} or null (the decay starts when warm-up ends)"),
        (lr.min_decay_lr is None or lr.min_decay_lr <= lr.learning_rate,
         f"{LR_SCHEDULER}min_decay_lr={lr.min_decay_lr} must be between 0 and learning_rate"),
    ] + optimizer_problems(cfg) + zero_rules(cfg)


def zero_rules(cfg: Any) -> list[Rule]:
    """The ZeRO-3 and ZeRO-2/3 settings: changed at a stage that does not use them, they would be ignored."""
    o = cfg.optimizer
    unused = f"has no effect at optimizer.zero_stage={o.zero_stage}"
    return [
        (o.zero_stage == 3 or o.zero3_prefetch == 1, f"optimizer.zero3_prefetch={o.zero3_prefetch} {unused}: it "
         "sets ZeRO-3's gathers; leave it at 1 or set optimizer.zero_stage=3"),
        (o.zero_stage == 3 or o.zero3_reshard_after_forward, f"optimizer.zero3_reshard_after_forward=false {unused}:"
         " it sets ZeRO-3's gathers; leave it true or set optimizer.zero_stage=3"),
        (o.zero_stage >= 2 or o.zero_overlap_reduce_scatter is None, f"optimizer.zero_overlap_reduce_scatter="
         f"{o.zero_overlap_reduce_scatter} {unused}: it sets ZeRO-2/3's reduce-scatters; leave it null or set "
         "optimizer.zero_stage=2 or 3"),
    ]


def optimizer_problems(cfg: Any) -> list[Rule]:
    """The configured optimizer's own settings (its OPTIMIZERS entry's problems)."""
    entry = OPTIMIZERS.get(optimizer_name(cfg))
    return [(False, problem) for problem in entry.problems(cfg)] if entry else []


def weights_rules(cfg: Any) -> list[Rule]:
    """Where the weights start: random with model.init_method.std, a Hugging Face folder, or a checkpoint."""
    hf_folder, resume_folder = cfg.model.init_method.path, cfg.checkpoint.resume_checkpoint_path
    return [
        (not hf_folder or os.path.isfile(os.path.join(hf_folder, "config.json")),
         f"model.init_method.path={hf_folder}: not a Hugging Face model folder (no config.json there)"),
        (not resume_folder or os.path.isfile(os.path.join(resume_folder, "meta.json")),
         f"checkpoint.resume_checkpoint_path={resume_folder}: no such checkpoint "
         "(a folder <checkpoints_path>/<step> holding meta.json)"),
        (not cfg.checkpoint.async_save or cfg.checkpoint.checkpoint_interval > 0,
         "checkpoint.async_save=true: checkpoint.checkpoint_interval=0 saves only at the end of training, which the "
         "run waits for anyway; set checkpoint.checkpoint_interval (the saves written in the background)"),
    ]


def data_rules(cfg: Any) -> list[Rule]:
    """The data group's rules, or with data_stages each stage's (its data merged over the group) and their order."""
    if not cfg.data_stages:
        return data_group_rules(cfg.data, "data.")
    rules, previous, names = [], None, []
    for i, stage in enumerate(cfg.data_stages):
        key, start = f"data_stages[{i}]", stage.start_training_step
        rules += [(bool(stage.name) and stage.name not in names,
                   f"{key}.name={stage.name!r}: every stage needs its own non-empty name"),
                  (start == 1 if previous is None else start > previous,
                   f"{key}.start_training_step={start}: " + ("the first stage must start at step 1" if previous is None
                   else f"must be larger than data_stages[{i - 1}].start_training_step={previous} (stages are "
                   "listed in the order they run)"))]
        rules += data_group_rules(stage_data(cfg, stage), f"{key}.data.")
        previous = start
        names.append(stage.name)
    return rules


def data_group_rules(d: Any, key: str) -> list[Rule]:
    """The rules of one data config, `key` being where it sits ("data." or "data_stages[i].data.")."""
    weights, folders = d.dataset_weights, d.dataset_folder or []
    rules = [(d.name in SOURCES, f"{key}name={d.name}: allowed values are {', '.join(SOURCES)}")]
    if d.name == "nanoset":
        rules.append((len(folders) > 0, f"{key}dataset_folder is empty: give one or more Nanoset folders, "
                      f"e.g. {key}dataset_folder=[data/nanoset/web]"))
    if d.name == "nanoset" and weights is not None:
        rules.append((len(weights) == len(folders), f"{key}dataset_weights has {len(weights)} values for "
                      f"{len(folders)} {key}dataset_folder entries: give one weight per folder (or null for equal "
                      "weights)"))
    if d.name == "hf":
        rules += [(bool(d.hf_dataset_or_datasets),
                   f"{key}hf_dataset_or_datasets is not set: give a local path or a Hub name"),
                  (bool(d.text_column_name), f"{key}text_column_name is empty: name the column holding the text")]
    return rules


def fault_rules(cfg: Any) -> list[Rule]:
    world, f = Layout.from_config(cfg).world_size, cfg.fault_injection
    ranks = ["hang_rank"] + [key for key in ("stall_rank", "sigstop_rank", "skip_collective_rank", "wrong_shape_rank",
                                              "short_pipeline_rank", "raise_rank", "slow_rank", "flip_gradient_rank")
                             if getattr(f, key) is not None]
    rules = [must(cfg, f"fault_injection.{key}", lambda rank: rank < world, f"below dp*cp*tp*pp = {world} (a rank "
                  "of the run)") for key in ranks]
    if f.hold_checkpoint_write:
        rules.append((cfg.checkpoint.async_save, f"fault_injection.hold_checkpoint_write={f.hold_checkpoint_write}: "
                      "holds back a background write; set checkpoint.async_save=true"))
    if f.short_pipeline_rank is not None:
        rules.append((cfg.parallelism.pp > 1 and batch_accumulation(cfg) > 1,
                      f"fault_injection.short_pipeline_rank={f.short_pipeline_rank}: needs a pipeline (pp > 1) "
                      "with at least two micro-batches a step, to drop one of them"))
    return rules


def health_rules(cfg: Any) -> list[Rule]:
    """The detectors' actions; a rollback needs checkpoints, a replay kernels that repeat to the bit."""
    h, rules = cfg.health, []
    if h.spike.action == "rollback":
        rules.append((cfg.checkpoint.checkpoint_interval > 0, "health.spike.action=rollback returns to the last "
                      "checkpoint: set checkpoint.checkpoint_interval (0 saves only at the end)"))
    kernel = cfg.model.attention_kernel
    if h.replay_every and cfg.parallelism.cp == 1 and kernel != "sdpa":
        flash = kernel == "flash" or (flash_attn_func is not None and torch.cuda.is_available()
                                      and cfg.model.dtype != "float32")   # "auto" picks flash-attn here
        rules.append((not flash, f"health.replay_every={h.replay_every} compares two backwards to the bit: "
                      f"model.attention_kernel={kernel} runs flash-attn, whose backward adds in no fixed order; "
                      "set model.attention_kernel=sdpa"))
    return rules



def batch_size_rule(cfg: Any) -> Rule:
    """tokens.batch_accumulation_per_replica sets the batch (dp x micro_batch_size x it): a global_batch_size
    changed beside it must agree."""
    t, dp, groups = cfg.tokens, cfg.parallelism.dp, replica_groups(cfg)
    if t.batch_accumulation_per_replica is None or t.global_batch_size == TokensConfig.global_batch_size:
        return True, ""
    product = dp * groups * t.micro_batch_size * t.batch_accumulation_per_replica
    return (t.global_batch_size == product, f"tokens.global_batch_size={t.global_batch_size} has no effect beside "
            f"tokens.batch_accumulation_per_replica={t.batch_accumulation_per_replica}, which makes the batch "
            f"parallelism.dp{' x fault_tolerance.replica_groups' if groups > 1 else ''} x micro_batch_size x it = "
            f"{product}: set one of the two")
