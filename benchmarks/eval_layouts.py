"""The same checkpoint's downstream scores on several layouts, against one process.

    python -m benchmarks.eval_layouts outputs/.../checkpoints/240 [--limit 200] \
        [--layouts parallelism.dp=2 parallelism.tp=2 parallelism.pp=2 parallelism.cp=2]

Each layout runs scripts/evaluate.py's evaluation (nanoexp/evaluate.py) with every document's responses;
printed per layout: the largest relative difference of any choice's log-likelihood from one process's, whether
every greedy flag, accuracy and generation is the same, and the seconds it took.
"""
from __future__ import annotations

import argparse
import tempfile
import time

from nanoexp.evaluate import evaluate_checkpoint

TASKS = "eval.tasks=[shakespeare_choice,shakespeare_complete]"


def differences(ours: dict, reference: dict) -> tuple[float, bool]:
    """(largest relative log-likelihood difference, whether every other response is equal)."""
    worst, same = 0.0, True
    for task, docs in reference.items():
        mine = dict((doc, responses) for doc, responses in ours[task])
        for doc, responses in docs:
            if task != "shakespeare_choice":
                same &= mine[doc] == responses
                continue
            for (a, greedy_a), (b, greedy_b) in zip(mine[doc], responses):
                worst, same = max(worst, abs(a - b) / abs(b)), same and greedy_a == greedy_b
    return worst, same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--layouts", nargs="+", default=["parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2",
                                                         "parallelism.cp=2"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        def run(layout: list[str]) -> tuple[dict, float]:
            start = time.perf_counter()
            result = evaluate_checkpoint(args.checkpoint, [TASKS, f"eval.limit={args.limit}", *layout],
                                         f"{folder}/scores.json", samples=True)
            return result, time.perf_counter() - start

        reference, seconds = run([])
        print(f"{'layout':<16} {'max rel. log-lik. diff':>22} {'responses, scores':>18} {'seconds':>8}")
        print(f"{reference['layout']:<16} {'(reference)':>22} {'':>18} {seconds:>8.1f}   {reference['scores']}")
        for layout in args.layouts:
            result, seconds = run(layout.split(","))
            worst, same = differences(result["samples"], reference["samples"])
            same &= result["scores"] == reference["scores"]
            print(f"{result['layout']:<16} {worst:>22.1e} {'equal' if same else 'DIFFER':>18} {seconds:>8.1f}")


if __name__ == "__main__":
    main()
