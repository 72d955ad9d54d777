"""Rank every valid layout of a model on a cluster by predicted tokens/s per GPU (nanoexp/plan/, docs/planning.md).

    python scripts/plan.py model=llama3_8b --gpus 64 --gpus-per-node 8 --gpu h100 --seq 8192 \
        --global-batch-tokens 1048576 --top 5 [--json]
    python scripts/plan.py --hf-config path/to/config.json --gpus 16 --gpu h200      # a Hugging Face model's shape

Positional arguments are Hydra overrides, composed as train.py composes them (anywhere among the options). The
header names the machine, the model and the framework the prediction assumes; then for each of the --top fastest
layouts that fit: tokens/s per GPU and how far behind the first (~: within the model's error, a tie), MFU, memory
per GPU in GiB and its margin to the fit limit, and where the step's time goes (compute, the slowest stage's
surplus, exposed communication, the pipeline bubble, the optimizer update, the host); then one line per reason the
other candidates are out. --json prints a list of objects (dp, cp, ep, tp, pp, zero_stage, schedule,
micro_batch, recompute, tokens_per_s_per_gpu, mfu, memory_gib, margin_gib, fits, ...). Bad input, or a GPU count
on which nothing runs: one line naming the argument, exit status 2. docs/planning.md says what the model is.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a file: the repository root

from nanoexp.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
