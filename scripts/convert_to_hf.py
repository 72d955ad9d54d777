"""Export a checkpoint of any layout to a Hugging Face transformers Llama folder (Mixtral for a mixture of experts).

    python scripts/convert_to_hf.py outputs/.../checkpoints/100 hf_out/
    # then: transformers.LlamaForCausalLM.from_pretrained("hf_out"), AutoTokenizer.from_pretrained("hf_out")

Writes config.json (vocab_size = nanoexp's padded vocabulary), model.safetensors (float32) and the
tokenizer files (generated for the built-in byte tokenizer, copied for an HF tokenizer folder).
A µP model's multipliers are baked into the weights (q_proj and the LM head; a tied embedding is
exported untied), so transformers' Llama gives its logits (nanoexp.interop.hf.bake_multipliers). A mixture of experts
exports as a MixtralForCausalLM, with the Hub's Mixtral tensor names, when it is one: every layer MoE, no
shared experts, router=softmax_topk_normalized (otherwise an error says which key differs).
"""
import argparse
import json
import os

from omegaconf import OmegaConf
from safetensors.torch import save_file

from nanoexp.checkpoint.load import CheckpointReader, check_compatible
from nanoexp.data.tokenizer import build_tokenizer
from nanoexp.interop.hf import bake_multipliers, hf_config, hf_name, mixtral_mismatch, parameter_shapes, write_tokenizer
from nanoexp.runtime.build import model_shape


def convert_to_hf(checkpoint: str, out: str) -> None:
    reader = CheckpointReader(checkpoint)
    cfg = OmegaConf.create(reader.meta["config"])
    shape = model_shape(cfg)
    if shape.moe is not None and mixtral_mismatch(shape):
        raise ValueError(f"{checkpoint} holds a mixture of experts that Hugging Face's Mixtral cannot hold: "
                         f"{mixtral_mismatch(shape)}")
    check_compatible(reader, shape)
    tokenizer = build_tokenizer(cfg.tokenizer.tokenizer_name_or_path)
    os.makedirs(out, exist_ok=True)
    tensors = {name: reader.full_tensor(name).contiguous() for name in parameter_shapes(shape)}
    tensors, shape = bake_multipliers(tensors, shape)
    tensors = {hf_name(name): tensor for name, tensor in tensors.items()}   # Mixtral's names for MoE blocks
    weights = os.path.join(out, "model.safetensors")
    save_file(tensors, weights, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(weights, 0o666 & ~umask)   # safetensors writes 0600, like a temporary file: these are for others
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config(shape, tokenizer.eod_id), f, indent=2)
    write_tokenizer(cfg.tokenizer.tokenizer_name_or_path, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint folder <checkpoints_path>/<step>")
    parser.add_argument("out", help="the Hugging Face folder to write")
    args = parser.parse_args()
    convert_to_hf(args.checkpoint, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
