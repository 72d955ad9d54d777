"""Export a checkpoint of any layout to a Hugging Face transformers Llama folder (Mixtral or Qwen3-MoE for a mixture of
experts).

    python scripts/convert_to_hf.py outputs/.../checkpoints/100 hf_out/
    # then: transformers.LlamaForCausalLM.from_pretrained("hf_out"), AutoTokenizer.from_pretrained("hf_out")

Writes config.json (vocab_size = nanoexp's padded vocabulary), model.safetensors (float32) and the
tokenizer files (generated for the built-in byte tokenizer, copied for an HF tokenizer folder).
A µP model's multipliers are baked into the weights (q_proj and the LM head; a tied embedding is
exported untied), so transformers' Llama gives its logits (nanoexp.interop.hf.bake_multipliers). A mixture of experts
exports as a MixtralForCausalLM, with the Hub's Mixtral tensor names, when it is one: every layer MoE, no
shared experts, router=softmax_topk_normalized; with q/k norms (model.model_config.qk_norm, the qwen3_moe_* models)
as a Qwen3MoeForCausalLM: no shared experts; neither with balance=bias (otherwise an error says which key differs).
The conversion is nanoexp/interop/hf_checkpoint.py's.
"""
import argparse
import sys

from nanoexp.failures import run_tool
from nanoexp.interop.hf_checkpoint import convert_to_hf


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint folder <checkpoints_path>/<step>")
    parser.add_argument("out", help="the Hugging Face folder to write (new or empty)")
    args = parser.parse_args()
    code = run_tool("convert_to_hf.py", lambda: convert_to_hf(args.checkpoint, args.out))
    if code == 0:
        print(f"wrote {args.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
