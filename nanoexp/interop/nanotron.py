"""Reading a nanotron YAML config as nanoexp overrides, written as an experiment file (the body of
scripts/import_nanotron_config.py).

`import_nanotron(tree)` maps every nanotron key with a nanoexp counterpart and lists every other key with a
one-line reason: "not carried over" (nanoexp would behave differently) or "nothing to set" (nanoexp already
behaves so at that value), so that nothing is dropped silently. Where nanotron's default differs from nanoexp's
(pp_engine afab, linear decay, min_decay_lr = the peak, rms_norm_eps 1e-6, no final checkpoint) nanotron's is
written. `read_nanotron_yaml(path)` refuses a file that is not a nanotron config with one message.
`write_experiment` writes the overrides as conf/experiment/<name>.yaml, what was not carried over in a comment
block at its top, after checking them over nanoexp's defaults.
"""
from __future__ import annotations

import json
import os
import re
import textwrap
from dataclasses import dataclass, field

import yaml
from omegaconf import OmegaConf

from nanoexp.config import ConfigError, compose
from nanoexp.interop.nanotron_unmapped import ATOMIC, UNMAPPED
from nanoexp.validation import validate


class NotANanotronConfig(ValueError):
    """The input cannot be read as a nanotron config; nothing is written."""


KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}
LR, FACTORY = "optimizer.learning_rate_scheduler.", "optimizer.optimizer_factory."


def pattern(key: str) -> str:
    return re.sub(r"\[\d+\]", "[*]", key)


def leaves(node, prefix: str = "") -> dict:
    """{dotted key: value} of every leaf; a list is a leaf except data_stages, whose entries are walked."""
    out = {}
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and pattern(path) not in ATOMIC and value:
            out.update(leaves(value, path + "."))
        elif path == "data_stages" and isinstance(value, list):
            for i, stage in enumerate(value):
                out.update(leaves(stage, f"{path}[{i}].") if isinstance(stage, dict) else {f"{path}[{i}]": stage})
        else:
            out[path] = value
    return out


def short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class Import:
    """A nanotron config being read: each key taken is marked, what is left is listed."""
    tree: dict
    values: dict = field(default_factory=dict)
    taken: set = field(default_factory=set)
    out: dict = field(default_factory=dict)         # the experiment's overrides, nested
    dropped: list = field(default_factory=list)     # "key = value: reason" (not carried over)
    neutral: list = field(default_factory=list)     # "key = value: reason" (nothing to set)
    notes: list = field(default_factory=list)

    def __post_init__(self):
        self.values = leaves(self.tree)

    def has(self, key: str) -> bool:
        return key in self.values and self.values[key] is not None

    def get(self, key: str, kind: str, default=None):
        """The value at `key` (nanotron's `default` when absent or null), checked to be of `kind`."""
        self.taken.add(key)
        value = self.values.get(key)
        if value is None:
            return default
        if kind == "float" and isinstance(value, str):   # PyYAML reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        ok = {"int": isinstance(value, int) and not isinstance(value, bool),
              "float": isinstance(value, (int, float)) and not isinstance(value, bool),
              "bool": isinstance(value, bool), "str": isinstance(value, str)}[kind]
        if not ok:
            raise NotANanotronConfig(f"{key}: expected {KINDS[kind]}, got {value!r}")
        return float(value) if kind == "float" else value

    def put(self, key: str, value) -> None:
        node, *parents = self.out, *key.split(".")[:-1]
        for part in parents:
            node = node.setdefault(part, {})
        node[key.split(".")[-1]] = value

    def copy(self, key: str, target: str, kind: str, default=None) -> None:
        value = self.get(key, kind, default)
        if value is not None:
            self.put(target, value)

    def choose(self, key: str, default, allowed: tuple, target: str, kind: str = "str") -> None:
        """Carry over a value nanoexp allows (enums lower-cased); else list the key and keep nanoexp's value."""
        value = self.get(key, kind, default)
        value = value.lower() if kind == "str" else value
        if value in allowed:
            self.put(target, value)
        else:
            self.drop(key, f"nanoexp allows {', '.join(map(str, allowed))}: its default is kept")

    def drop(self, key: str, reason: str) -> None:
        self.taken.add(key)
        self.dropped.append(f"{key} = {short(self.values.get(key))}: {reason}")

    def list_the_rest(self) -> None:
        for key, value in self.values.items():
            if key in self.taken:
                continue
            neutral, reason = UNMAPPED.get(pattern(key), (lambda v: False, "no counterpart in nanoexp"))
            if not neutral(value):
                self.dropped.append(f"{key} = {short(value)}: {reason}")
            else:   # a null is simply not used; other neutral values say why nanoexp needs nothing
                self.neutral.append(f"{key} = {short(value)}" + ("" if value is None else f": {reason}"))


def map_parallelism(imp: Import) -> None:
    for axis in ("dp", "tp", "pp"):
        imp.copy(f"parallelism.{axis}", f"parallelism.{axis}", "int", 1)
    imp.copy("parallelism.context_parallel_size", "parallelism.cp", "int", 1)   # nanoexp's cp is ring attention
    imp.choose("parallelism.pp_engine", "afab", ("afab", "1f1b"), "parallelism.pp_engine")   # nanotron's default: afab
    imp.choose("parallelism.tp_mode", "ALL_REDUCE", ("all_reduce", "reduce_scatter"), "parallelism.tp_mode")
    if imp.get("parallelism.recompute_layer", "bool", False):   # nanotron recomputes whole layers
        imp.put("parallelism.recompute", "full")


def map_model(imp: Import) -> None:
    m, shape = "model.model_config.", {"hidden_size": ("int", 4096), "intermediate_size": ("int", 11008),
                                       "num_hidden_layers": ("int", 32), "num_attention_heads": ("int", 32),
                                       "max_position_embeddings": ("int", 2048), "vocab_size": ("int", 32000),
                                       "rms_norm_eps": ("float", 1e-6), "rope_theta": ("float", 10000.0),
                                       "tie_word_embeddings": ("bool", False)}
    for key, (kind, nanotron_default) in shape.items():
        imp.copy(m + key, m + key, kind, nanotron_default)
    imp.put(m + "num_key_value_heads", imp.get(m + "num_key_value_heads", "int"))   # null: as many as heads
    dtype = imp.get("model.dtype", "str", "bfloat16")   # nanotron's default
    names = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}
    if dtype in names:
        imp.put("model.dtype", names[dtype])
    else:
        imp.drop("model.dtype", "nanoexp trains in float32 or bfloat16 autocast (float32 is used)")
    # nanotron pads the vocabulary to a multiple of make_vocab_size_divisible_by x tp: the same padded size here.
    multiple = imp.get("model.make_vocab_size_divisible_by", "int", 1)
    imp.put("model.make_vocab_size_divisible_by", multiple * imp.get("parallelism.tp", "int", 1))
    imp.copy("model.ddp_bucket_cap_mb", "model.ddp_bucket_cap_mb", "float")   # absent: nanoexp's per-backend size
    imp.copy("model.init_method.std", "model.init_method.std", "float")
    if imp.has("model.init_method.std"):
        imp.notes.append("model.init_method.std: nanotron scales the std of the residual output projections "
                         "(o_proj, down_proj) by the depth; nanoexp draws every matrix with the same std")


def map_optimizer(imp: Import, train_steps: int) -> None:
    name = imp.get(FACTORY + "name", "str", "adamW")
    if name.lower() != "adamw":
        imp.drop(FACTORY + "name", "nanoexp trains with AdamW (kept)")
    for key, kind in (("adam_beta1", "float"), ("adam_beta2", "float"), ("adam_eps", "float"),
                      ("torch_adam_is_fused", "bool")):   # older nanotron files keep them under `optimizer`
        source = FACTORY + key if FACTORY + key in imp.values else f"optimizer.{key}"
        imp.copy(source, FACTORY + key, kind)
    imp.copy("optimizer.weight_decay", "optimizer.weight_decay", "float")
    imp.put("optimizer.clip_grad", imp.get("optimizer.clip_grad", "float"))
    imp.choose("optimizer.zero_stage", 0, (0, 1), "optimizer.zero_stage", kind="int")
    peak = imp.get(LR + "learning_rate", "float")
    warmup = imp.get(LR + "lr_warmup_steps", "int", 0)
    if peak is not None:
        imp.put(LR + "learning_rate", peak)
    imp.put(LR + "lr_warmup_steps", warmup)
    imp.choose(LR + "lr_warmup_style", "linear", ("linear", "constant"), LR + "lr_warmup_style")
    imp.choose(LR + "lr_decay_style", "linear", ("linear", "cosine"), LR + "lr_decay_style")   # nanotron's default
    # nanotron's nulls (its lr_scheduler_builder): decay over train_steps - warm-up - the decay's starting step
    # (when one is set), down to the peak itself (no decay).
    start = imp.get(LR + "lr_decay_starting_step", "int")
    imp.put(LR + "lr_decay_steps", imp.get(LR + "lr_decay_steps", "int", max(train_steps - warmup - (start or 0), 1)))
    imp.put(LR + "lr_decay_starting_step", start)
    imp.put(LR + "min_decay_lr", imp.get(LR + "min_decay_lr", "float", peak))


def map_tokens(imp: Import) -> int:
    for key in ("sequence_length", "micro_batch_size", "train_steps"):
        imp.copy(f"tokens.{key}", f"tokens.{key}", "int")
    accumulation = imp.get("tokens.batch_accumulation_per_replica", "int", 1)
    imp.put("tokens.batch_accumulation_per_replica", accumulation)
    micro, dp = imp.get("tokens.micro_batch_size", "int", 1), imp.get("parallelism.dp", "int", 1)
    imp.put("tokens.global_batch_size", dp * micro * accumulation)
    interval = imp.get("tokens.val_check_interval", "int", -1)
    imp.put("tokens.val_check_interval", max(interval, 0))
    if interval <= 0:
        imp.notes.append(f"tokens.val_check_interval={interval} (no evaluation): nanoexp's 0 still evaluates once, "
                         "at the end")
    batches = imp.get("tokens.limit_val_batches", "int", 0)
    if batches > 0:
        imp.put("tokens.limit_val_batches", batches)
    return imp.get("tokens.train_steps", "int", 1)


def map_general(imp: Import) -> None:
    imp.copy("general.project", "general.project", "str")
    imp.copy("general.run", "general.run", "str")
    c = "checkpoints."
    imp.copy(c + "checkpoints_path", "checkpoint.checkpoints_path", "str")
    imp.copy(c + "checkpoint_interval", "checkpoint.checkpoint_interval", "int")
    imp.put("checkpoint.save_final_state", imp.get(c + "save_final_state", "bool", False))   # nanotron's default
    imp.copy(c + "load_optimizer", "checkpoint.load_optimizer", "bool")
    imp.copy(c + "load_lr_scheduler", "checkpoint.load_lr_scheduler", "bool")
    imp.copy("logging.iteration_step_info_interval", "logging.iteration_step_info_interval", "int")
    tokenizer = imp.get("tokenizer.tokenizer_name_or_path", "str")
    if tokenizer is not None:
        imp.put("tokenizer.tokenizer_name_or_path", tokenizer)
        if tokenizer != "byte" and not os.path.isdir(os.path.expanduser(tokenizer)):
            imp.notes.append(f"tokenizer.tokenizer_name_or_path={tokenizer}: nanoexp trains with a local tokenizer "
                             "folder: download it and override tokenizer.tokenizer_name_or_path=<folder>")
    if imp.tree.get("profiler") is not None:   # nanotron's defaults: skip 3 steps, wait 1, warm up 1, record 1
        p = "logging.profiler."
        imp.put(p + "enabled", True)
        imp.put(p + "wait", imp.get("profiler.skip_first", "int", 3) + imp.get("profiler.wait", "int", 1))
        imp.put(p + "warmup", imp.get("profiler.warmup", "int", 1))
        imp.put(p + "active", imp.get("profiler.active", "int", 1))
        imp.put(p + "record_shapes", imp.get("profiler.record_shapes", "bool", False))


def map_nanoset(imp: Import, dataset: str) -> dict:
    """A Nanoset stage: one folder, a list (weights from dataset_weights, else by size as nanotron blends), or a
    folder -> weight mapping."""
    key = dataset + ".dataset_folder"
    imp.taken.add(key)
    value, weights = imp.values[key], None
    if isinstance(value, str):
        folders = [value]
    elif isinstance(value, list) and value and all(isinstance(f, str) for f in value):
        folders, weights = value, imp.values.get(dataset + ".dataset_weights")
        imp.taken.add(dataset + ".dataset_weights")
    elif isinstance(value, dict) and value and all(isinstance(f, str) for f in value):
        folders, weights = list(value), list(value.values())
    else:
        raise NotANanotronConfig(f"{key}: expected a folder, a list of folders or a folder: weight mapping, "
                                 f"got {short(value)}")
    if weights is not None and not (isinstance(weights, list) and all(
            isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights)):
        raise NotANanotronConfig(f"{dataset}: expected a list of numbers as weights, got {short(weights)}")
    if weights is None and len(folders) > 1:
        weights = folder_sizes(folders)
        imp.notes.append(f"{key}: nanotron blends a list without weights by size; " + (
            "dataset_weights are the folders' token counts (from their metadata.json)" if weights else
            "the folders were not readable here, so nanoexp blends them equally: set dataset_weights"))
    return {"name": "nanoset", "dataset_folder": folders, "dataset_weights": [float(w) for w in weights or []] or None}


def folder_sizes(folders: list) -> list | None:
    """Each nanoexp Nanoset folder's token count, or None when one cannot be read."""
    try:
        return [json.load(open(os.path.join(f, "metadata.json")))["num_tokens"] for f in folders]
    except (OSError, ValueError, KeyError):
        return None


def map_hf(imp: Import, dataset: str) -> dict:
    key, splits_key = dataset + ".hf_dataset_or_datasets", dataset + ".hf_dataset_splits"
    imp.taken.update((key, splits_key))
    source, splits = imp.values[key], imp.values.get(splits_key) or "train"
    if isinstance(source, (list, dict)) and source:
        source = next(iter(source))
        imp.drop(key, "nanoexp reads one Hugging Face dataset per stage (the first is used): blend several as "
                      "Nanosets made by scripts/preprocess_data.py")
    if isinstance(splits, list) and splits:
        splits = splits[0]
        imp.drop(splits_key, "nanoexp reads one split per stage (the first is used)")
    if not isinstance(source, str) or not isinstance(splits, str):
        raise NotANanotronConfig(f"{key}: expected a dataset name or path and a split, got {short(source)}, "
                                 f"{short(splits)}")
    return {"name": "hf", "hf_dataset_or_datasets": source, "hf_dataset_splits": splits,
            "hf_dataset_config_name": imp.get(dataset + ".hf_dataset_config_name", "str"),
            "text_column_name": imp.get(dataset + ".text_column_name", "str", "text")}


def map_stage(imp: Import, key: str) -> dict:
    name, start = imp.get(key + ".name", "str"), imp.get(key + ".start_training_step", "int")
    if name is None or start is None:
        raise NotANanotronConfig(f"{key}: a data stage needs a name and a start_training_step")
    dataset = key + ".data.dataset"
    if dataset + ".dataset_folder" in imp.values:
        data = map_nanoset(imp, dataset)
    elif dataset + ".hf_dataset_or_datasets" in imp.values:
        data = map_hf(imp, dataset)
    else:
        data = {"name": "builtin"}
        if dataset in imp.values:   # null: nanotron's generated dummy data
            imp.drop(dataset, "nanotron's dummy data: this stage reads nanoexp's built-in corpus")
        else:
            imp.notes.append(f"{dataset}: neither a Hugging Face dataset nor a Nanoset folder: the stage reads "
                             "nanoexp's built-in corpus")
    return {"name": name, "start_training_step": start, "data": data}


def map_seed(imp: Import, num_stages: int) -> None:
    """nanotron seeds the weights with general.seed and each stage's data with its own data.seed (42 when
    unset); nanoexp has both: general.seed, and each stage's data.seed (its samples' order, with the stage's
    index)."""
    imp.put("general.seed", imp.get("general.seed", "int", 42))
    for i in range(num_stages):
        imp.out["data_stages"][i]["data"]["seed"] = imp.get(f"data_stages[{i}].data.seed", "int", 42)


def import_nanotron(tree: dict) -> Import:
    """The nanoexp overrides of a nanotron config (see the module docstring), with what was not carried over."""
    if isinstance(tree.get("data"), dict) and "data_stages" not in tree:   # older nanotron: one `data` section
        tree = {**tree, "data_stages": [{"name": "training", "start_training_step": 1, "data": tree["data"]}]}
        del tree["data"]
    imp = Import(tree)
    map_general(imp)
    map_parallelism(imp)
    map_model(imp)
    map_optimizer(imp, map_tokens(imp))
    stages = tree.get("data_stages") or []
    if stages:
        imp.put("data_stages", [map_stage(imp, f"data_stages[{i}]") for i in range(len(stages))])
        if any(stage["data"]["name"] == "nanoset" for stage in imp.out["data_stages"]):
            imp.notes.append("dataset_folder: nanoexp reads Nanoset folders made by scripts/preprocess_data.py "
                             "(tokens.bin, documents.npy, metadata.json), not datatrove's .ds files")
    else:
        imp.notes.append("no data_stages (nanotron's dummy data): the run reads nanoexp's built-in corpus")
    map_seed(imp, len(stages))
    imp.list_the_rest()
    return imp


def read_nanotron_yaml(path: str) -> dict:
    """The parsed config; NotANanotronConfig when the file is missing, not YAML or not shaped like nanotron's."""
    try:
        with open(path) as f:
            tree = yaml.safe_load(f)
    except OSError as error:
        raise NotANanotronConfig(f"{path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise NotANanotronConfig(f"{path} is not YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(tree, dict):
        raise NotANanotronConfig(f"{path} is not a nanotron config: expected a mapping of sections")
    missing = [s for s in ("parallelism", "model") if not isinstance(tree.get(s), dict)]
    if missing or not isinstance(tree["model"].get("model_config"), dict):
        raise NotANanotronConfig(f"{path} is not a nanotron config: no {' or '.join(missing) or 'model.model_config'} "
                                 "section")
    wrong = [s for s in ("general", "checkpoints", "tokens", "optimizer", "tokenizer", "logging")
             if tree.get(s) is not None and not isinstance(tree[s], dict)]
    if wrong:
        raise NotANanotronConfig(f"{path}: section {wrong[0]} is {short(tree[wrong[0]])}, expected a mapping")
    if not isinstance(tree.get("data_stages") or [], list):
        raise NotANanotronConfig(f"{path}: data_stages is {short(tree['data_stages'])}, expected a list of stages")
    return tree


def render(imp: Import, source: str, name: str) -> str:
    """The experiment file: how it was made, the comment block of what was not carried over, the overrides."""
    lines = ["# @package _global_",
             f"# Imported from the nanotron config {source} by scripts/import_nanotron_config.py:",
             f"#   python train.py +experiment={name}"]
    for title, items in (("Not carried over (nanotron key = value: why)", imp.dropped),
                         ("Nothing to set: nanoexp already behaves so (nanotron key = value: why)", imp.neutral),
                         ("Notes", imp.notes)):
        if items:
            lines += ["#", f"# {title}:"] + [line for item in items for line in textwrap.wrap(
                item, 116, initial_indent="#   ", subsequent_indent="#       ", break_on_hyphens=False)]
    return "\n".join(lines) + "\n" + yaml.safe_dump(imp.out, sort_keys=False)


def check_experiment(overrides: dict) -> list[str]:
    """What nanoexp's schema and `validate` say about the experiment on top of the defaults (empty: fine)."""
    try:
        cfg = OmegaConf.merge(compose([]), overrides)
        validate(cfg)
    except ConfigError as error:
        return str(error).splitlines()[1:]
    except Exception as error:   # the schema refused a value the mapping produced
        return [f"{type(error).__name__}: {error}".splitlines()[0]]
    return []


def write_experiment(source: str, name: str, out: str, force: bool = False) -> tuple[Import, list[str]]:
    """Import the nanotron config file `source` and write it to `out` as the experiment `name`; return the Import
    and what nanoexp's checks say about it (to fix by override). A bad name, a file that is not a nanotron config
    and an existing `out` without `force` raise NotANanotronConfig, and nothing is written."""
    if not re.fullmatch(r"[\w.-]+", name):
        raise NotANanotronConfig(f"--name {name!r}: use letters, digits, '_', '-' or '.'")
    imp = import_nanotron(read_nanotron_yaml(source))
    if os.path.exists(out) and not force:
        raise NotANanotronConfig(f"{out} exists: pass --force to replace it")
    problems = check_experiment(imp.out)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(render(imp, source, name))
    return imp, problems
