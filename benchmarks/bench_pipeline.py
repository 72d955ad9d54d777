"""The pipeline bubble of each schedule, measured from its timeline and set beside what the measured compute
times predict.

    python benchmarks/bench_pipeline.py [--pp 2 4] [--micro 4 8] [--engines afab 1f1b interleaved_1f1b zb_h1 zbv]
        [--steps 3] [--set KEY=VALUE ...]

Each case trains `--steps` steps of a small Llama (8 layers, hidden 256, sequence 256, micro-batch 2; dp = tp = 1)
with `logging.pipeline_trace=true` through `python train.py`, and reads the last step's timeline
(nanoexp.verify.trace_analysis):
  measured  1 - (mean over ranks of the time in F, B, W) / (first compute start to last compute end);
  T_F, T_B, T_W  the mean time of a whole stage's forward, input-gradient backward and weight-gradient step for one
      micro-batch (a chunk's times x v; schedules without W measure B and W as one backward, shown under T_B);
  deps      the idle fraction that the schedule's order alone gives with those times, communication free
      (nanoexp.verify.pipeline_bubble.idle_by_dependencies; for afab and 1f1b (p-1)/(m+p-1), interleaved
      (p-1)/(v·m+p-1), zb_h1 (p-1)(T_F+T_B-T_W) over the step);
  nccl      the same under NCCL's rules as the engine posts and waits (idle_under_nccl);
  MB above baseline, measured / estimated: the busiest pp rank's memory peak over the run less the runtime
      baseline (summary.json), and the memory estimate's figure for that rank (nanoexp/observe/memory_estimate.py,
      which replays the schedule: a micro-batch held from its F to its B, or to its W where W is split off).
On CPU the ranks share the cores: with pp above the core count a waiting rank lends its core to the others, so
compute times move with the number of busy ranks; the figures of such rows say so.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.harness import compose  # noqa: E402
from nanoexp.instruments.memory import MB  # noqa: E402
from nanoexp.observe.memory_estimate import estimate, total  # noqa: E402
from nanoexp.model.shape import model_shape  # noqa: E402
from nanoexp.verify.trace_analysis import measured_bubble, predicted_bubble, read_trace, stage_times  # noqa: E402

MODEL = ["model.model_config.hidden_size=256", "model.model_config.intermediate_size=768",
         "model.model_config.num_hidden_layers=8", "model.model_config.num_attention_heads=8",
         "model.model_config.num_key_value_heads=4", "tokens.sequence_length=256", "tokens.micro_batch_size=2",
         "tokens.val_check_interval=0", "checkpoint.save_final_state=false", "logging.tensorboard=false",
         "logging.pipeline_trace=true", "data.prefetch=false", "optimizer.learning_rate_scheduler.lr_warmup_steps=1"]
CHUNKS = {"interleaved_1f1b": 2, "zbv": 2, "dualpipev": 2}


def run_case(engine: str, pp: int, m: int, steps: int, extra: list[str], folder: str) -> dict:
    v = CHUNKS.get(engine, 1)
    run_dir = os.path.join(folder, f"{engine}_pp{pp}_m{m}")
    overrides = MODEL + [f"parallelism=dp1tp1pp{pp}", f"parallelism.pp_engine={engine}",
                         f"parallelism.pp_virtual_stages={v}", f"tokens.global_batch_size={2 * m}",
                         f"tokens.train_steps={steps}", f"hydra.run.dir={run_dir}"] + extra
    done = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *overrides], cwd=ROOT, text=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if done.returncode:
        raise SystemExit(f"{engine} pp{pp} m{m} failed:\n{done.stderr[-2000:]}")
    metas, events = read_trace(run_dir)
    last = max(e["step"] for e in events)
    step = [e for e in events if e["step"] == last and e["dp_rank"] == 0 and e["tp_rank"] == 0]
    t_f, t_b, t_w = stage_times(step, v)
    predicted = predicted_bubble(step, engine, pp, v, m)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    held = [peak - summary["baseline_memory_mb"] for peak in summary["peak_memory_mb_per_rank"]]
    cfg = compose([o for o in overrides if not o.startswith("hydra.")])
    estimated = [total(estimate(cfg, model_shape(cfg), r)) / MB for r in range(pp)]
    busiest = max(range(len(held)), key=held.__getitem__)
    return {"held_mb": held[busiest], "estimated_mb": estimated[busiest], "busiest": busiest,"engine": engine, "pp": pp, "m": m, "v": v, "T_F": t_f, "T_B": t_b, "T_W": t_w,
            "measured": measured_bubble(step), "deps": predicted["dependencies"], "nccl": predicted["nccl"],
            }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro", type=int, nargs="+", default=[4, 8], help="micro-batches per step")
    parser.add_argument("--engines", nargs="+", default=["afab", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], help="another override for every case")
    args = parser.parse_args(argv)
    print(f"{'engine':<17}{'pp':>3}{'m':>3}{'T_F ms':>8}{'T_B ms':>8}{'T_W ms':>8}{'measured':>10}{'deps':>7}"
          f"{'nccl':>7}  MB held / estimated (pp rank)", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        for pp in args.pp:
            for m in args.micro:
                for engine in args.engines:
                    row = run_case(engine, pp, m, args.steps, args.set, folder)
                    print(f"{engine:<17}{pp:>3}{m:>3}{row['T_F'] * 1e3:>8.1f}{row['T_B'] * 1e3:>8.1f}"
                          f"{row['T_W'] * 1e3:>8.1f}{row['measured']:>10.3f}{row['deps']:>7.3f}{row['nccl']:>7.3f}"
                          f"  {row['held_mb']:>5.0f} / {row['estimated_mb']:>5.0f} ({row['busiest']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
