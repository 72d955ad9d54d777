"""The step as a reader follows it: every nanoexp function one training step calls, by file, outside the model.

    python -m benchmarks.step_path                                   # dp2, ZeRO-0, pp 1 (two forked gloo ranks)
    python -m benchmarks.step_path --set optimizer.zero_stage=3      # any layout with pp = 1 (overrides)

The second `Trainer.train_step` of rank 0 runs under `sys.setprofile`; each named function whose code lies in
nanoexp/ outside `nanoexp/model/` (the forward itself) is listed once, in the order first called, with its length
in lines. Lambdas and comprehensions are not counted (they are lines of a function that is). Issue 65 compares the
counts before and after the gradient path's refactor: files, functions, lines.
"""
from __future__ import annotations

import argparse
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PACKAGE = os.path.join(ROOT, "nanoexp") + os.sep
SKIPPED = (os.path.join(PACKAGE, "model") + os.sep,)


def function_lengths(path: str) -> dict[int, int]:
    """Lines of each function of `path` by the line its code object starts on (its first decorator or `def`)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            for start in [node.lineno] + [d.lineno for d in node.decorator_list]:
                out[start] = length
    return out


def traced_step(rank, world_size, overrides):
    """Two steps; the second traced on rank 0: [(file, function, lines)] in the order first called."""
    from nanoexp.checks import check_config
    from nanoexp.config import compose
    from nanoexp.parallel.context import ParallelContext
    from nanoexp.parallel.layout import Layout
    from nanoexp.runtime.trainer import Trainer
    cfg = compose(["debug=fast", "logging.tensorboard=false", "data.prefetch=false", *overrides])
    check_config(cfg, world_size)
    trainer = Trainer(cfg, ParallelContext(Layout.from_config(cfg)), run_dir=os.devnull)
    trainer.train_step(trainer.batches.next_step(), 1e-3)
    seen: dict[tuple, None] = {}

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(PACKAGE) and not code.co_filename.startswith(SKIPPED) \
                and not code.co_name.startswith("<"):
            seen.setdefault((code.co_filename, code.co_name, code.co_firstlineno))

    batch = trainer.batches.next_step()
    sys.setprofile(profile if rank == 0 else None)
    try:
        trainer.train_step(batch, 1e-3)
    finally:
        sys.setprofile(None)
    trainer.batches.close()
    lengths = {path: function_lengths(path) for path in {path for path, _, _ in seen}}
    return [(os.path.relpath(path, ROOT), name, lengths[path].get(line, 0)) for path, name, line in seen]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", nargs="*", default=[], help="config overrides (default: dp2, ZeRO-0)")
    args = parser.parse_args()
    from tests.distributed import run_distributed
    overrides = ["parallelism.dp=2", *args.set]
    dp = next((int(o.split("=")[1]) for o in reversed(overrides) if o.startswith("parallelism.dp=")), 1)
    visited = run_distributed(traced_step, dp, overrides)[0]
    files: dict[str, list] = {}
    for path, name, lines in visited:
        files.setdefault(path, []).append((name, lines))
    for path, functions in files.items():
        print(f"{path} ({len(functions)} functions, {sum(n for _, n in functions)} lines)")
        print("    " + ", ".join(f"{name} {lines}" for name, lines in functions))
    print(f"{len(files)} files, {len(visited)} functions, {sum(n for _, _, n in visited)} lines "
          f"({' '.join(overrides)})")


if __name__ == "__main__":
    main()
