"""The nanotron keys nanoexp has no counterpart for, each with the reason the importer prints
(nanoexp/interop/nanotron.py reads them)."""
from __future__ import annotations

# Keys nanoexp has no counterpart for: (neutral, reason). `neutral(value)` is true where nanoexp already behaves
# as nanotron does with that value (listed as "nothing to set"); otherwise the key is "not carried over".
# "[*]" stands for any stage index.
ALWAYS, NULL = (lambda v: True), (lambda v: v is None)
UNMAPPED = {
    "general.step": (NULL, "nanoexp reads the step from the checkpoint it resumes"),
    "general.consumed_train_samples": (NULL, "nanoexp reads consumed samples from the checkpoint it resumes"),
    "general.benchmark_csv_path": (NULL, "nanoexp writes its measurements to metrics.jsonl and summary.json"),
    "general.ignore_sanity_checks": (lambda v: not v, "nanoexp always checks the config at start"),
    "checkpoints.save_initial_state": (lambda v: not v, "nanoexp saves after optimizer steps only"),
    "checkpoints.resume_checkpoint_path": (NULL, "a nanotron checkpoint, which nanoexp cannot read: export its "
                                           "weights to a Hugging Face folder and set model.init_method.path"),
    "checkpoints.checkpoints_path_is_shared_file_system": (
        lambda v: v is None or v, "nanoexp writes every rank's shard into one folder: a file system all ranks share"),
    "parallelism.tp_linear_async_communication": (lambda v: not v, "nanoexp's tensor-parallel layers communicate "
                                                  "synchronously"),
    "parallelism.expert_parallel_size": (lambda v: v in (None, 1), "the imported model is a dense Llama: nothing "
                                         "to split (for a nanoexp mixture of experts set model.moe and parallelism.ep)"),
    "parallelism.moe_layer_recompute": (lambda v: not v, "the imported model is a dense Llama (nanoexp recomputes "
                                        "whole layers: parallelism.recompute)"),
    "parallelism.tp_recompute_allgather": (lambda v: not v, "nanoexp keeps the all-gathered input for backward"),
    "model.init_method.path": (NULL, "a nanotron checkpoint, which nanoexp cannot read: export it to a Hugging "
                               "Face folder and set model.init_method.path (weights start from init_method.std)"),
    "model.init_method.use_mup": (lambda v: not v, "nanotron's spectral µP is not nanoexp's µP (Tensor Programs "
                                  "V): choose model.parametrization=mup and model.mup.base_width yourself"),
    "model.init_method.scaling_method": (ALWAYS, "nanoexp draws every matrix with model.init_method.std"),
    "model.model_config.bos_token_id": (ALWAYS, "nanoexp takes token ids from the tokenizer"),
    "model.model_config.eos_token_id": (ALWAYS, "nanoexp takes the end-of-document id from the tokenizer"),
    "model.model_config.pad_token_id": (ALWAYS, "nanoexp packs documents: no padding in training"),
    "model.model_config.hidden_act": (lambda v: v in (None, "silu"), "nanoexp's MLP is SwiGLU (silu)"),
    "model.model_config.initializer_range": (ALWAYS, "training initialises from model.init_method.std"),
    "model.model_config.is_llama_config": (lambda v: v in (None, True), "nanoexp trains Llama models only"),
    "model.model_config.pretraining_tp": (lambda v: v in (None, 1), "nanoexp has no pretraining_tp"),
    "model.model_config.rope_scaling": (NULL, "nanoexp's rotary embeddings have no scaling"),
    "model.model_config.rope_interleaved": (lambda v: not v, "nanoexp rotates half-split pairs (Hugging Face's "
                                            "convention), not interleaved ones"),
    "model.model_config.use_cache": (ALWAYS, "a generation setting"),
    "model.model_config.attention_bias": (lambda v: not v, "nanoexp's projections have no bias"),
    "model.model_config._attn_implementation": (ALWAYS, "nanoexp uses flash-attn when it can, else SDPA"),
    "model.model_config.z_loss_enabled": (lambda v: not v, "nanoexp has no z-loss"),
    "model.model_config.z_loss_coefficient": (ALWAYS, "used only with z_loss_enabled"),
    "optimizer.accumulate_grad_in_fp32": (lambda v: v in (None, True), "nanoexp accumulates gradients in float32"),
    "optimizer.weight_decay_exclude_named_params": (lambda v: not v, "nanoexp exempts 1-D parameters (norms) from "
                                                    "weight decay, nothing else"),
    "tokens.limit_test_batches": (lambda v: not v, "nanoexp has no test split"),
    "tokenizer.tokenizer_revision": (NULL, "nanoexp reads a local tokenizer folder: pick the revision when you "
                                     "download it"),
    "tokenizer.tokenizer_max_length": (NULL, "nanoexp packs documents into tokens.sequence_length windows"),
    "logging.log_level": (lambda v: v in (None, "info"), "nanoexp logs at INFO"),
    "logging.log_level_replica": (lambda v: v in (None, "info"), "every nanoexp rank logs INFO to logs/rank_<r>.log"),
    "lighteval": (NULL, "nanoexp has no lighteval: evaluate checkpoints with scripts/evaluate.py or export them to "
                        "Hugging Face (scripts/convert_to_hf.py)"),
    "s3_upload": (NULL, "nanoexp writes checkpoints to checkpoint.checkpoints_path only"),
    "metrics_logging": (NULL, "nanoexp logs its metrics to metrics.jsonl, TensorBoard or W&B"),
    "profiler": (NULL, "no profiling (nanoexp's logging.profiler stays off)"),
    "profiler.profiler_export_path": (NULL, "nanoexp writes traces into <run folder>/profiler/"),
    "profiler.repeat": (lambda v: v in (None, 1), "nanoexp profiles one window"),
    "profiler.profile_memory": (lambda v: not v, "nanoexp's profiler records time, not memory"),
    "profiler.with_stack": (ALWAYS, "nanoexp's profiler records no Python stacks"),
    "profiler.export_chrome_trace": (ALWAYS, "nanoexp always writes a Chrome/Perfetto trace"),
    "data_stages[*].data.num_loading_workers": (lambda v: v in (None, 0, 1), "nanoexp prepares batches in one "
                                                "background thread per rank"),
    "data_stages[*].data.dataset.dataset_processing_num_proc_per_process": (
        lambda v: v in (None, 1), "nanoexp tokenizes a Hugging Face dataset in the training process (for large "
                                  "data make a Nanoset: scripts/preprocess_data.py --workers N)"),
    "data_stages[*].data.dataset.dataset_overwrite_cache": (ALWAYS, "nanoexp keeps no tokenization cache"),
    "data_stages[*].data.dataset.tokenizer_name": (ALWAYS, "nanoexp reads it from each Nanoset's metadata.json"),
    "data_stages[*].data.dataset.vocab_size": (ALWAYS, "nanoexp reads it from each Nanoset's metadata.json"),
    "data_stages[*].data.dataset.token_size_in_bytes": (ALWAYS, "nanoexp reads it from each Nanoset's metadata.json"),
}
# Values kept whole (not walked key by key): mappings that are data, and sections nanoexp has no part of.
ATOMIC = {"lighteval", "s3_upload", "metrics_logging", "model.model_config.rope_scaling",
          "data_stages[*].data.dataset.dataset_folder", "data_stages[*].data.dataset.hf_dataset_or_datasets"}
