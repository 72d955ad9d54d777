"""Turn a local Hugging Face Llama (Mixtral, Qwen3-MoE) folder into a nanoexp checkpoint (step 0, no optimizer state).

    python scripts/convert_from_hf.py hf_llama/ ckpt_out/ [config overrides ...]
    python train.py checkpoint.resume_checkpoint_path=ckpt_out/0 <the overrides printed> ...   # any layout

The model shape is read from the HF config.json; the tokenizer is the HF folder when it holds one,
else the built-in byte tokenizer. Training can also start from the HF folder directly with
`model.init_method.path=hf_llama/`. The conversion is nanoexp/interop/hf_checkpoint.py's.
"""
import argparse
import os
import sys

from nanoexp.failures import run_tool
from nanoexp.interop.hf_checkpoint import convert_from_hf


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir")
    parser.add_argument("out", help="checkpoints folder: the checkpoint is written to OUT/0")
    parser.add_argument("overrides", nargs="*", help="extra config overrides (e.g. make_vocab_size_divisible_by)")
    args = parser.parse_args()
    overrides = []
    code = run_tool("convert_from_hf.py",
                    lambda: overrides.extend(convert_from_hf(args.hf_dir, args.out, args.overrides)))
    if code == 0:
        print(f"wrote {os.path.join(args.out, '0')}; train from it with:\n  python train.py "
              f"checkpoint.resume_checkpoint_path={os.path.join(args.out, '0')} " + " ".join(overrides))
    return code


if __name__ == "__main__":
    sys.exit(main())
