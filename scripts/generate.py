"""Generate text from a checkpoint of any layout (one process, KV cache).

    python scripts/generate.py outputs/.../checkpoints/100 --prompt "To be" --max-new-tokens 100
    python scripts/generate.py CKPT --prompt "To be" --temperature 0.8 --top-k 50 --seed 1
"""
import argparse

import torch

from nanoexp.runtime.build import load_single_process
from nanoexp.data.tokenizer import build_tokenizer
from nanoexp.model.generation import generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint folder <checkpoints_path>/<step>")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model, cfg = load_single_process(args.checkpoint)
    tokenizer = build_tokenizer(cfg.tokenizer.tokenizer_name_or_path)
    new_ids = generate(model, tokenizer.encode(args.prompt), args.max_new_tokens, tokenizer.vocab_size,
                       temperature=args.temperature, top_k=args.top_k, stop_id=tokenizer.eod_id,
                       generator=torch.Generator(next(model.parameters()).device).manual_seed(args.seed))
    print(args.prompt + tokenizer.decode(new_ids))


if __name__ == "__main__":
    main()
