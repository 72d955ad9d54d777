"""Loss and perplexity of a text file under a checkpoint of any layout (one process), as JSON.

    python scripts/evaluate.py outputs/.../checkpoints/100 --text-file some.txt

The text is encoded without special tokens; every token from the second on is predicted from the
tokens before it in its window: windows of `tokens.sequence_length` predictions that overlap by
one token (the last target of a window is the first input of the next). `loss` is the mean
next-token cross-entropy in nats; `perplexity` = exp(loss).
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F

from nanoexp.checkpoint.load import load_single_process
from nanoexp.data.tokenizer import build_tokenizer


@torch.no_grad()
def evaluate_ids(model, ids: list[int], window: int) -> dict:
    """Mean next-token cross-entropy over windows of `window` predictions (see the module docstring)."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start:start + window + 1]])
        logits = model(input_ids=chunk[:, :-1])[0].float()   # the padded vocabulary, as in training
        total += F.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    loss = total / count if count else float("nan")
    return {"loss": loss, "tokens": count, "perplexity": math.exp(loss) if count else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint folder <checkpoints_path>/<step>")
    parser.add_argument("--text-file", required=True)
    args = parser.parse_args()
    model, cfg = load_single_process(args.checkpoint)
    tokenizer = build_tokenizer(cfg.tokenizer.tokenizer_name_or_path)
    with open(args.text_file, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read())
    result = evaluate_ids(model, ids, cfg.tokens.sequence_length)
    print(json.dumps({**result, "checkpoint": args.checkpoint, "text_file": args.text_file}))


if __name__ == "__main__":
    main()
