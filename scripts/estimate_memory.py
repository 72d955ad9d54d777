"""The memory one rank of a run needs, estimated from the same overrides `python train.py` takes.

    python scripts/estimate_memory.py model=small parallelism=dp2tp1pp1 optimizer.zero_stage=1
    python scripts/estimate_memory.py --json model=llama_1b parallelism=dp8tp1pp1 tokens.sequence_length=2048
    python scripts/estimate_memory.py --zero-stages model=llama_1b parallelism=dp8tp1pp1   # ZeRO 0-3 side by side

Prints, for every pipeline stage and for the busiest rank, parameters, gradients, optimizer state,
activations, ZeRO-2/3's units in flight (gathered parameters, gradients being reduce-scattered) and gloo's
communication copies above the runtime baseline (nanoexp/observe/memory_estimate.py says how each is counted), and the
baseline itself (this process: Python and torch imported, plus a nominal CUDA context with
--device cuda). --zero-stages prints the busiest rank under each of ZeRO-0..3 instead of the config's stage.
With --json only this JSON goes to stdout, for the busiest rank:
    {"per_rank_mb": {"parameters": ..., "gradients": ..., "optimizer": ..., "activations": ...,
                     "in_flight": ..., "communication": ...}, "total_mb": ..., "runtime_mb": ...}
total_mb is the peak above the baseline: the model state plus the largest of the activations with the units
in flight beside them, the update's temporaries and gloo's copies after backward (never held together,
memory.total); a fit decision adds runtime_mb.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys

from nanoexp.config import compose, normalize
from nanoexp.instruments.memory import MB, runtime_baseline_mb
from nanoexp.observe.memory_estimate import busiest_rank_estimate, estimate, total
from nanoexp.model.shape import model_shape
from nanoexp.parallel.layout import Layout
from nanoexp.validation import validate

KINDS = ("parameters", "gradients", "optimizer", "activations", "in_flight", "communication")


def sharded_over(layout: Layout) -> str:
    """Where ZeRO shards: dp x cp, or the shard group under hybrid sharding (parallelism.dp_shard)."""
    if layout.replicas == 1:
        return f"dp x cp = {layout.dp_cp}"
    return f"shard groups of dp_shard x cp = {layout.shard_size}, {layout.replicas} replicas"


def print_zero_stages(cfg, shape, device: str) -> None:
    """The busiest rank's estimate under each ZeRO stage (the config otherwise as given)."""
    cfg = copy.deepcopy(cfg)
    print(f"{'ZeRO':>8}{'pp stage':>9}" + "".join(f"{k:>14}" for k in KINDS) + f"{'total':>10}"
          f"  (MB per rank above the baseline, sharded over {sharded_over(Layout.from_config(cfg))})")
    for stage in range(4):
        cfg.optimizer.zero_stage = stage
        busiest, parts = busiest_rank_estimate(cfg, shape, device)
        print(f"{stage:>8}{busiest:>9}" + "".join(f"{parts[k] / MB:>14.1f}" for k in KINDS)
              + f"{total(parts) / MB:>10.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="train.py overrides, e.g. model=small parallelism=dp2tp1pp1")
    parser.add_argument("--json", action="store_true", help="print only the busiest rank's estimate as JSON")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="adds the CUDA context to the baseline")
    parser.add_argument("--zero-stages", action="store_true", help="the busiest rank under each ZeRO stage 0-3")
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
    if args.zero_stages:
        print_zero_stages(cfg, shape, args.device)
    else:
        print(f"{'pp stage':>8}" + "".join(f"{k:>14}" for k in KINDS) + f"{'total':>10}  (MB per rank above the "
              f"baseline, ZeRO-{cfg.optimizer.zero_stage} over {sharded_over(layout)}"
              + (f"; {shape.moe.num_experts // layout.ep} experts per rank, ep = {layout.ep}, their state over "
                 f"{layout.shard_size // layout.ep} ranks)" if layout.ep > 1 else ")"))
        for pp_rank in range(layout.pp):
            stage = estimate(cfg, shape, pp_rank, args.device)
            print(f"{pp_rank:>8}" + "".join(f"{stage[k] / MB:>14.1f}" for k in KINDS) + f"{total(stage) / MB:>10.1f}")
    print(f"busiest (ZeRO-{cfg.optimizer.zero_stage}): pp stage {busiest}, {result['total_mb']:.1f} MB above a "
          f"runtime baseline of {result['runtime_mb']:.0f} MB: {result['total_mb'] + result['runtime_mb']:.0f} MB "
          "per rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
