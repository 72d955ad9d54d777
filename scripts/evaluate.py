"""Evaluate a checkpoint of any layout: the loss of a text file (one process), or downstream tasks (any layout).

    python scripts/evaluate.py outputs/.../checkpoints/100 --text-file some.txt
    python scripts/evaluate.py outputs/.../checkpoints/100 --tasks shakespeare_choice,shakespeare_complete \
        parallelism=dp2tp1pp1 eval.limit=100 [--out scores.json] [--samples]

--tasks runs lm-evaluation-harness tasks on the checkpoint as training runs them in the loop
(nanoexp/evaluation/): the checkpoint's config, with the overrides given after the options (a layout such as
parallelism=dp1tp2pp1 or parallelism.dp=2, any eval.* key); it prints the scores as JSON and writes them
(with --samples each document's responses too) to --out, by default eval_<step>.json beside the
checkpoint folder.

The text is encoded without special tokens; every token from the second on is predicted from the
tokens before it in its window: windows of `tokens.sequence_length` predictions that overlap by
one token (the last target of a window is the first input of the next). `loss` is the mean
next-token cross-entropy in nats; `perplexity` = exp(loss).
"""
import argparse
import json
import math
import os

import torch
import torch.nn.functional as F

from nanoexp.runtime.build import load_single_process
from nanoexp.data.tokenizer import build_tokenizer


@torch.no_grad()
def evaluate_ids(model, ids: list[int], window: int) -> dict:
    """Mean next-token cross-entropy over windows of `window` predictions (see the module docstring)."""
    device = next(model.parameters()).device
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start:start + window + 1]], device=device)
        logits = model(input_ids=chunk[:, :-1])[0].float()   # the padded vocabulary, as in training
        total += F.cross_entropy(logits, chunk[0, 1:], reduction="sum")   # read once, at the end
        count += chunk.shape[1] - 1
    loss = total.item() / count if count else float("nan")
    return {"loss": loss, "tokens": count, "perplexity": math.exp(loss) if count else float("nan")}


def layout_overrides(overrides: list[str]) -> list[str]:
    """Dotted overrides, with a parallelism=<file> group choice expanded into its keys (conf/parallelism/)."""
    from omegaconf import OmegaConf

    from nanoexp.config import CONF_DIR
    dotted = []
    for override in overrides:
        key, _, value = override.partition("=")
        if key == "parallelism":
            group = OmegaConf.load(os.path.join(CONF_DIR, "parallelism", f"{value}.yaml"))
            dotted += [f"parallelism.{k}={v}" for k, v in group.items()]
        else:
            dotted.append(override)
    return dotted


def evaluate_tasks(args) -> None:
    from nanoexp.evaluate import evaluate_checkpoint
    overrides = [f"eval.tasks=[{args.tasks}]"] + layout_overrides(args.overrides)
    result = evaluate_checkpoint(args.checkpoint, overrides, args.out, samples=args.samples)
    print(json.dumps({"checkpoint": result["checkpoint"], "layout": result["layout"], **result["scores"]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint folder <checkpoints_path>/<step>")
    parser.add_argument("--text-file", help="the loss and perplexity of this text")
    parser.add_argument("--tasks", help="comma-separated lm-eval task names (the shipped ones, or any the harness "
                        "knows; eval.include_path=<folder> for your own)")
    parser.add_argument("--out", help="--tasks: where the scores go (default: eval_<step>.json beside the checkpoint)")
    parser.add_argument("--samples", action="store_true", help="--tasks: also every document's responses")
    parser.add_argument("overrides", nargs="*", help="--tasks: parallelism=..., eval.limit=..., ...")
    args = parser.parse_intermixed_args()   # overrides may come before or after the options
    if bool(args.text_file) == bool(args.tasks):
        parser.error("give one of --text-file and --tasks")
    if args.tasks:
        checkpoint = os.path.normpath(args.checkpoint)
        args.out = args.out or os.path.join(os.path.dirname(checkpoint), f"eval_{os.path.basename(checkpoint)}.json")
        return evaluate_tasks(args)
    model, cfg = load_single_process(args.checkpoint)
    tokenizer = build_tokenizer(cfg.tokenizer.tokenizer_name_or_path)
    with open(args.text_file, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read())
    result = evaluate_ids(model, ids, cfg.tokens.sequence_length)
    print(json.dumps({**result, "checkpoint": args.checkpoint, "text_file": args.text_file}))


if __name__ == "__main__":
    main()
