"""Turn a local Hugging Face Llama (or Mixtral) folder into a nanoexp checkpoint (step 0, no optimizer state).

    python scripts/convert_from_hf.py hf_llama/ ckpt_out/ [config overrides ...]
    python train.py checkpoint.resume_checkpoint_path=ckpt_out/0 <the overrides printed> ...   # any layout

The model shape is read from the HF config.json; the tokenizer is the HF folder when it holds one,
else the built-in byte tokenizer. Training can also start from the HF folder directly with
`model.init_method.path=hf_llama/`.
"""
import argparse
import os

from nanoexp.checkpoint import CheckpointManager, Progress
from nanoexp.config import compose
from nanoexp.interop.hf import read_hf_config
from nanoexp.runtime.build import build_model
from nanoexp.runtime.optim import build_optimizer
from nanoexp.parallel.context import ParallelContext
from nanoexp.run import check_config


def model_overrides(hf_dir: str) -> list[str]:
    """The config overrides that give nanoexp the HF model's shape and tokenizer."""
    c = read_hf_config(hf_dir)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings")
    out = [f"model.model_config.{k}={str(c[k]).lower() if isinstance(c[k], bool) else c[k]}" for k in keys]
    if c.get("model_type") == "mixtral":   # a mixture of experts: every layer, no shared experts, renormalised
        out += [f"model.moe.num_experts={c['num_local_experts']}", f"model.moe.top_k={c['num_experts_per_tok']}",
                f"model.moe.moe_intermediate_size={c['intermediate_size']}", "model.moe.num_shared_experts=0",
                "model.moe.layer_frequency=1", "model.moe.router=softmax_topk_normalized"]
    has_tokenizer = any(os.path.isfile(os.path.join(hf_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    return out + [f"tokenizer.tokenizer_name_or_path={os.path.abspath(hf_dir) if has_tokenizer else 'byte'}"]


def convert_from_hf(hf_dir: str, out: str, overrides: list[str]) -> list[str]:
    overrides = model_overrides(hf_dir) + overrides
    cfg = compose(overrides + [f"model.init_method.path={os.path.abspath(hf_dir)}",
                               "parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1"])
    check_config(cfg, world_size=1)
    cfg.checkpoint.checkpoints_path = out
    ctx = ParallelContext()
    model = build_model(cfg, ctx)
    CheckpointManager(cfg, ctx, out).save(0, model, build_optimizer(cfg, model), Progress())
    return overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir")
    parser.add_argument("out", help="checkpoints folder: the checkpoint is written to OUT/0")
    parser.add_argument("overrides", nargs="*", help="extra config overrides (e.g. make_vocab_size_divisible_by)")
    args = parser.parse_args()
    overrides = convert_from_hf(args.hf_dir, args.out, args.overrides)
    print(f"wrote {os.path.join(args.out, '0')}; train from it with:\n  python train.py "
          f"checkpoint.resume_checkpoint_path={os.path.join(args.out, '0')} " + " ".join(overrides))


if __name__ == "__main__":
    main()
