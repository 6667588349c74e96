#!/usr/bin/env bash
# One command for a machine with one CUDA GPU; finishes within about 7 minutes (SmolLM2-135M, the default model).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        # figures in OUT_DIR (default: ./gpu_check_out)
#
# 1. bf16 parity with transformers on CUDA: greedy tokens on 4 prompts, prefill logits vs float32 within 1.25x transformers bf16 error (gpu_check.py)
# 2. peak GPU memory of a bf16 run; --keep-quantized on CUDA (dequantization fused by torch.compile)
# 3. decode tok/s, llmtrace eager and --compile against transformers; --trace full overhead (bench.py, 1 round)
# 4. --fast on CUDA: _weight_int4pack_mm on each block type, drift against the exact path, decode tok/s (gpu_fast_check.py)
# Exit status: non-zero if a parity check failed. Every stage has its own time limit, so one hang cannot eat the rest.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu_check_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$OUT/inductor}"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'error: no CUDA device visible to torch')" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
start=$SECONDS
status=0

echo "== parity, peak memory, --keep-quantized"
timeout 120 python benchmarks/gpu_check.py --json "$OUT/check.json" 2>"$OUT/check.err" || status=$?
[ -s "$OUT/check.err" ] && tail -3 "$OUT/check.err"

echo "== decode tok/s (eager, --compile, transformers) and --trace overhead"
timeout 150 python benchmarks/bench.py --device cuda --rounds 1 --only decode overhead --decode-pairs 2 \
    --overhead-pairs 2 --json "$OUT/bench.json" 2>"$OUT/bench.err" | tail -25
[ "${PIPESTATUS[0]}" -ne 0 ] && { echo "bench.py failed or timed out: see $OUT/bench.err"; tail -3 "$OUT/bench.err"; }

echo "== --fast on CUDA: int4 kernel per block type, drift, decode tok/s"
timeout 150 python benchmarks/gpu_fast_check.py --json "$OUT/fast.json" 2>"$OUT/fast.err" || status=$?
[ -s "$OUT/fast.err" ] && tail -3 "$OUT/fast.err"

echo "== done in $((SECONDS - start)) s; figures in $OUT/"
exit $status
