#!/usr/bin/env bash
# One prepared check for a machine with one NVIDIA GPU (written for the lent H200: Python 3.12,
# torch 2.11, no Hydra/OmegaConf/datasets/flash-attn, no network). UNRUN so far: no GPU was
# available when it was written; it uses only APIs present in torch 2.11.
#
# What it does (about 8-10 minutes on an H200; results in $OUT, default ./bench_gpu_out):
#   1. environment: GPU, torch, whether flash-attn is importable;
#   2. smoke test: `train.py model=tiny` for 30 steps in bf16 with model.compile=true
#      (attention: flash-attn if importable, else SDPA); the loss must be finite and fall;
#   3. llama_1b (1.2B parameters, vocabulary 128256, sequence 2048, bf16 autocast, compiled
#      blocks, fused AdamW) on one GPU for micro-batches 4 and 8 (one process each, so an
#      out-of-memory trial cannot poison the next): tokens/s, MFU (model FLOPs, PaLM
#      convention, against the 989 TFLOP/s dense bf16 peak) and peak memory; the best is
#      printed last;
#   4. FP8 (model.fp8, torchao tensorwise; skipped when torchao is not importable): the same
#      llama_1b run at micro-batch 4 with model.fp8.enabled=true, its tokens/s against step 3's
#      micro-batch 4 in the same session and its MFU against the 1,979 TFLOP/s dense FP8 peak.
#
# Preparing the wheels it needs (here, in the repo root, where pip has the network):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl hydra-core==1.3.8 omegaconf==2.3.1
#   python3 -m pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3   # sdist only: build it here
#   (all three are pure Python; psutil, PyYAML, safetensors and tensorboard are already there)
#   and for step 4 torchao (its float8 training is Python over torch._scaled_mm; 0.17.0 passes
#   tests/test_fp8.py's matmul and scale tests here):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl torchao==0.17.0
# Then with the device tool:  run(command="bash benchmarks/bench_gpu.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/bench_gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
exec > >(tee "$OUT/bench_gpu.log") 2>&1

echo "== 1. environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 - <<'EOF' || exit 1
import torch, hydra, omegaconf
print("torch", torch.__version__, "cuda", torch.version.cuda, "| device:", torch.cuda.get_device_name(0))
print("hydra", hydra.__version__, "omegaconf", omegaconf.__version__)
try:
    import flash_attn
    print("attention: flash-attn", flash_attn.__version__)
except ImportError:
    print("attention: flash-attn not importable -> torch SDPA")
import nanoexp.runtime.trainer  # noqa: F401  (fails early if an import is missing here)
EOF

# Runs that time steps: no eval batches, no checkpoint, no TensorBoard.
COMMON=(tokens.val_check_interval=0 tokens.limit_val_batches=1 checkpoint.save_final_state=false
        logging.tensorboard=false logging.iteration_step_info_interval=5)

echo "== 2. smoke test: tiny, bf16, compile"
python3 train.py model=tiny model.dtype=bfloat16 model.compile=true tokens.train_steps=30 \
    "${COMMON[@]}" hydra.run.dir="$OUT/smoke" || { echo "smoke test FAILED"; exit 1; }
python3 - "$OUT/smoke" <<'EOF' || exit 1
import json, math, sys
losses = [json.loads(l)["loss"] for l in open(sys.argv[1] + "/metrics.jsonl") if '"loss"' in l]
ok = all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.5
print(f"smoke: loss {losses[0]:.3f} -> {losses[-1]:.3f}:", "OK" if ok else "FAILED")
sys.exit(0 if ok else 1)
EOF

echo "== 3. llama_1b on one GPU, sequence 2048, bf16, compiled blocks, fused AdamW"
for MB in 4 8; do
    echo "-- micro-batch $MB"
    timeout 150 python3 train.py model=llama_1b tokens.sequence_length=2048 tokens.micro_batch_size=$MB \
        tokens.global_batch_size=$MB tokens.train_steps=12 model.compile=true \
        optimizer.optimizer_factory.torch_adam_is_fused=true "${COMMON[@]}" hydra.run.dir="$OUT/mb$MB" \
        > "$OUT/mb$MB.log" 2>&1
    echo "exit $? ($(grep -m1 -o 'OutOfMemoryError' "$OUT/mb$MB.log" || echo 'no OOM'))"
done
python3 - "$OUT" <<'EOF'
import json, os, sys
rows = []
for mb in (4, 8):
    path = os.path.join(sys.argv[1], f"mb{mb}", "summary.json")
    if not os.path.exists(path):
        print(f"micro-batch {mb}: no summary (see mb{mb}.log)")
        continue
    s = json.load(open(path))
    steps = [json.loads(l) for l in open(os.path.join(sys.argv[1], f"mb{mb}", "metrics.jsonl")) if '"loss"' in l]
    last = steps[-1] if steps else {}
    print(f"micro-batch {mb}: {s['status']}, {s['tokens_per_sec'] or 0:,.0f} tokens/s (mean after 2 steps), "
          f"MFU {100 * (s['mfu'] or 0):.1f}% (last step), model {last.get('model_tflops_per_sec', 0):.0f} TFLOP/s, "
          f"peak memory {s['peak_memory_mb'] / 1024:.1f} GiB, final loss {s['final_loss']}")
    if s["status"] == "completed":
        rows.append((s["tokens_per_sec"] or 0, mb, s["mfu"]))
if rows:
    tps, mb, mfu = max(rows)
    print(f"BEST: micro-batch {mb}: {tps:,.0f} tokens/s, MFU {100 * (mfu or 0):.1f}% of 989 TFLOP/s bf16")
EOF

echo "== 4. FP8 (torchao tensorwise): llama_1b at micro-batch 4, against step 3's micro-batch 4"
if python3 -c "import torchao.float8" 2>/dev/null; then
    timeout 150 python3 train.py model=llama_1b tokens.sequence_length=2048 tokens.micro_batch_size=4 \
        tokens.global_batch_size=4 tokens.train_steps=12 model.compile=true model.fp8.enabled=true \
        optimizer.optimizer_factory.torch_adam_is_fused=true "${COMMON[@]}" hydra.run.dir="$OUT/fp8_mb4" \
        > "$OUT/fp8_mb4.log" 2>&1
    echo "exit $?"
    python3 - "$OUT" <<'EOF'
import json, os, sys
runs = {name: os.path.join(sys.argv[1], name, "summary.json") for name in ("mb4", "fp8_mb4")}
s = {name: json.load(open(path)) for name, path in runs.items() if os.path.exists(path)}
if "fp8_mb4" not in s:
    print("FP8: no summary (see fp8_mb4.log)")
    sys.exit(0)
fp8 = s["fp8_mb4"]
print(f"FP8 micro-batch 4: {fp8['status']}, {fp8['tokens_per_sec'] or 0:,.0f} tokens/s, MFU "
      f"{100 * (fp8['mfu'] or 0):.1f}% of the FP8 peak, peak memory {fp8['peak_memory_mb'] / 1024:.1f} GiB, "
      f"final loss {fp8['final_loss']}")
if "mb4" in s and s["mb4"]["tokens_per_sec"]:
    print(f"FP8 / bf16 tokens/s at micro-batch 4: {(fp8['tokens_per_sec'] or 0) / s['mb4']['tokens_per_sec']:.2f}x, "
          f"final loss {fp8['final_loss']} against {s['mb4']['final_loss']}")
EOF
else
    echo "FP8: torchao not importable here: carry its wheel (see the header)"
fi
