"""The memory one rank of a run needs, estimated from the same overrides `python train.py` takes.

    python scripts/estimate_memory.py model=small parallelism=dp2tp1pp1 optimizer.zero_stage=1
    python scripts/estimate_memory.py --json model=llama_1b parallelism=dp8tp1pp1 tokens.sequence_length=2048

Prints, for every pipeline stage and for the busiest rank, parameters, gradients, optimizer state
and activations above the runtime baseline (nanoexp/memory.py says how each is counted), and the
baseline itself (this process: Python and torch imported, plus a nominal CUDA context with
--device cuda). With --json only this JSON goes to stdout, for the busiest rank:
    {"per_rank_mb": {"parameters": ..., "gradients": ..., "optimizer": ..., "activations": ...},
     "total_mb": ..., "runtime_mb": ...}
total_mb is the peak above the baseline: the model state plus the larger of the activations and
the update's temporaries (they never coexist); a fit decision adds runtime_mb.
"""
from __future__ import annotations

import argparse
import json
import sys

from nanoexp.config import compose, normalize
from nanoexp.memory import MB, busiest_rank_estimate, estimate, runtime_baseline_mb, total
from nanoexp.model.build import model_shape
from nanoexp.parallel.layout import Layout
from nanoexp.validation import validate

KINDS = ("parameters", "gradients", "optimizer", "activations", "communication")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="train.py overrides, e.g. model=small parallelism=dp2tp1pp1")
    parser.add_argument("--json", action="store_true", help="print only the busiest rank's estimate as JSON")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="adds the CUDA context to the baseline")
    args = parser.parse_args(argv)
    cfg = compose(args.overrides)
    normalize(cfg)
    layout = Layout.from_config(cfg)
    validate(cfg, world_size=layout.world_size)
    shape = model_shape(cfg)
    busiest, parts = busiest_rank_estimate(cfg, shape, args.device)
    result = {"per_rank_mb": {k: parts[k] / MB for k in KINDS}, "total_mb": total(parts) / MB,
              "runtime_mb": runtime_baseline_mb(args.device, cfg.model.dtype)}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'pp stage':>8}" + "".join(f"{k:>13}" for k in KINDS) + f"{'total':>10}  (MB per rank above the baseline)")
    for pp_rank in range(layout.pp):
        stage = estimate(cfg, shape, pp_rank, args.device)
        print(f"{pp_rank:>8}" + "".join(f"{stage[k] / MB:>13.1f}" for k in KINDS) + f"{total(stage) / MB:>10.1f}")
    print(f"busiest: pp stage {busiest}, {result['total_mb']:.1f} MB above a runtime baseline of "
          f"{result['runtime_mb']:.0f} MB: {result['total_mb'] + result['runtime_mb']:.0f} MB per rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
