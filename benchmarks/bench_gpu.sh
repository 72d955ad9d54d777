#!/usr/bin/env bash
# One prepared check for a machine with one NVIDIA GPU (written for the lent H200: Python 3.12, torch 2.11, no
# Hydra/OmegaConf/datasets/flash-attn, no network), within one command's 600 s limit. UNRUN on a GPU so far.
#
#   bash benchmarks/bench_gpu.sh               # on the GPU: results in $OUT (default ./bench_gpu_out)
#   OUT=/tmp/o bash benchmarks/bench_gpu.sh --dry-run   # the same steps on CPU with tiny shapes (tests/test_bench_gpu.py)
#
# Steps, each a fresh `python3 train.py` stopped with SIGKILL at its limit (a SIGTERM would make nanoexp finish the
# step and write a checkpoint, and `timeout` would wait for it), none of which saves a checkpoint:
#   1. environment: GPU, torch, Hydra, flash-attn importable or not;
#   2. smoke: model=tiny, 30 steps, bf16, model.compile=true; the loss must be finite and fall;
#   3. llama_1b (1.2B parameters, vocabulary 128256, sequence 2048, bf16 autocast, compiled blocks, fused AdamW) at
#      micro-batches 4 and 8, one process each (an out-of-memory trial cannot poison the next): tokens/s, MFU
#      against the bf16 datasheet peak, peak memory;
#   4. FP8 (model.fp8, torchao tensorwise, when importable): llama_1b at micro-batch 4, against step 3's, on the
#      GPU's FP8 units (model.fp8.emulate=false: a GPU without them is refused, never emulated unseen; the dry run
#      emulates, as every CPU does by default).
# Every run gets at most its cap and never more than what is left of BUDGET_S (540 s: a minute of the limit is
# kept for start-up and the transfers back); a run with under 30 s left is skipped and said so. The run folders go
# to a temporary folder outside $OUT; $OUT receives two files: bench_gpu.log (this output) and results.json (per
# run: exit code, start and end second, losses, the last step's speed, the summary, the log's last lines).
#
# Wheels for the lent machine (benchmarks/gpu_wheels.txt; fetch them here, where pip has the network, with
# `bash benchmarks/fetch_gpu_wheels.sh`), then with the device tool:
#   run(command="bash benchmarks/bench_gpu.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=false
[ "${1:-}" = "--dry-run" ] && DRY_RUN=true
OUT="${OUT:-$PWD/bench_gpu_out}"
RUNS="$(mktemp -d /tmp/bench_gpu_runs.XXXXXX)"
RESULTS="$OUT/results.json"
BUDGET_S="${BUDGET_S:-540}"
mkdir -p "$OUT" && rm -f "$RESULTS"
export PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1
if [ -d .whl ] && ! $DRY_RUN; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
exec > >(tee "$OUT/bench_gpu.log") 2>&1

if $DRY_RUN; then   # the same steps, shapes a CPU runs in seconds
    SMOKE=(model=tiny tokens.train_steps=6)
    BIG=(model=tiny tokens.sequence_length=128 tokens.train_steps=4)
    MICRO_BATCHES=(2 4)
    CAP_S=90
    FP8=(model.fp8.enabled=true)
else
    SMOKE=(model=tiny model.dtype=bfloat16 model.compile=true tokens.train_steps=30)
    BIG=(model=llama_1b tokens.sequence_length=2048 tokens.train_steps=12 model.compile=true
         optimizer.optimizer_factory.torch_adam_is_fused=true)
    MICRO_BATCHES=(4 8)
    CAP_S=130
    FP8=(model.fp8.enabled=true model.fp8.emulate=false)
fi
# Runs that time steps: no evaluation, no checkpoint, no TensorBoard.
# The warm-up fits the short runs (the default's 20 steps would be refused for a 12-step run).
COMMON=(tokens.val_check_interval=0 tokens.limit_val_batches=1 checkpoint.save_final_state=false
        checkpoint.checkpoint_interval=0 logging.tensorboard=false logging.iteration_step_info_interval=2
        optimizer.learning_rate_scheduler.lr_warmup_steps=2)

run_case() {   # run_case NAME CAP_S OVERRIDES...: one train.py run, recorded in results.json
    local name=$1 cap=$2 left limit start code
    shift 2
    left=$((BUDGET_S - SECONDS - 5))
    limit=$((cap < left ? cap : left))
    if [ "$limit" -lt 30 ]; then
        echo "-- $name: skipped, ${left} s left of the ${BUDGET_S} s budget"
        return
    fi
    echo "-- $name (at most $limit s, from second $SECONDS)"
    start=$SECONDS
    timeout -s KILL "$limit" python3 train.py "$@" "${COMMON[@]}" hydra.run.dir="$RUNS/$name" > "$RUNS/$name.log" 2>&1
    code=$?
    python3 benchmarks/bench_gpu_results.py record "$RESULTS" "$name" "$RUNS/$name" "$RUNS/$name.log" \
        "$code" "$start" "$SECONDS"
    echo "   exit $code after $((SECONDS - start)) s$([ "$code" = 137 ] && echo ', killed at its limit')"
}

echo "== 1. environment (dry run: $DRY_RUN)"
$DRY_RUN || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 - <<'EOF' || exit 1
import torch, hydra, omegaconf
device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
print("torch", torch.__version__, "cuda", torch.version.cuda, "| device:", device)
print("hydra", hydra.__version__, "omegaconf", omegaconf.__version__)
try:
    import flash_attn
    print("attention: flash-attn", flash_attn.__version__)
except ImportError:
    print("attention: flash-attn not importable -> torch SDPA")
import nanoexp.runtime.trainer  # noqa: F401  (fails early if an import is missing here)
EOF

echo "== 2. smoke test"
run_case smoke 90 "${SMOKE[@]}"
echo "== 3. the large model at micro-batches ${MICRO_BATCHES[*]}"
for MB in "${MICRO_BATCHES[@]}"; do
    run_case "mb$MB" "$CAP_S" "${BIG[@]}" tokens.micro_batch_size="$MB" tokens.global_batch_size="$MB"
done
echo "== 4. FP8 (torchao tensorwise) at micro-batch ${MICRO_BATCHES[0]}"
if python3 -c "import torchao.float8" 2>/dev/null; then
    run_case "fp8_mb${MICRO_BATCHES[0]}" "$CAP_S" "${BIG[@]}" "${FP8[@]}" \
        tokens.micro_batch_size="${MICRO_BATCHES[0]}" tokens.global_batch_size="${MICRO_BATCHES[0]}"
else
    echo "FP8: torchao not importable here: carry its wheel (benchmarks/gpu_wheels.txt)"
fi

echo "== results ($SECONDS s of the ${BUDGET_S} s budget)"
python3 benchmarks/bench_gpu_results.py report "$RESULTS"
status=$?
rm -rf "$RUNS"
exit $status
