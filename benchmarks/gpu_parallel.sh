#!/usr/bin/env bash
# The parallel drafters beside EAGLE-3 on one GPU, all on the same rows of the SmolLM2 reference data:
#   1. the reference recipe's data stages and dump (gpu_reference.sh with STOP_AFTER_DUMP=1; a run that has them
#      goes straight on, one with the data stages but no dump makes the dump alone; no dump when every head of HEADS
#      is DFlash)
#   2. each head of HEADS (EAGLE-3, P-EAGLE, DFlash, each at its k or block size) trained on the same FRACTION of
#      the rows for EPOCHS (DFlash online: it reads five other layers than the dump holds), each with its recipe
#      beside smollm2_eagle3_gpu.yaml
#   3. each exported, then evaluated on the mixed set and Vicuna beside n-gram: EAGLE-3 and P-EAGLE at their k
#      (P-EAGLE's depths), DFlash at block_size - 1
#   4. RUNTIME=1: after each head's evals, bench_runtime at batch 1 and 8 with it (compiled engine, CUDA graphs),
#      and SERVE requests (default 64) of the mixed set served with continuous batching in 8 slots
#   -> OUT/parallel.json and OUT/parallel.md (benchmarks/parallel_summary.py), refreshed after every stage
#
# Usage:  bash benchmarks/gpu_parallel.sh [GGUF [DATA [OUT]]]   (arguments as gpu_reference.sh's)
# Environment: FRACTION (default 0.3), EPOCHS (default 2), HEADS (the heads to train, each KIND:SIZE, SIZE being
# EAGLE-3's and P-EAGLE's k and DFlash's block size; default from KINDS (default "eagle3 peagle dflash"), K (default
# 4) and BLOCK (default 16); each head's files are named KIND_kSIZE or dflash_bSIZE), ANCHORS (DFlash's anchors per
# micro-batch, default 2048 as its recipe; BENCHMARKS.md names each figure's), LR (default 1e-3), SETS (eval sets,
# default "mixed vicuna"), RUNTIME=1, EXTRA_OV (more overrides for every stage), RUN (default OUT/run), LIMIT (seconds
# a stage may take, default 600) and LIMIT_TRAIN (a training, default 1800), TAG (a suffix of each head's files, as
# dflash_b16_TAG: variants of one head on the same rows, e.g. two invocations side by side once the data stages are
# there), SMALL=1 DEVICE=cpu (a CPU smoke test of this script). Every stage resumes after a kill.
set -u
GGUF=${1:-${GGUF:-}}; DATA=${2:-${DATA:-data}}; OUT=${3:-${OUT:-out}}
. "$(dirname "$0")/gpu_setup.sh"
use_gguf "$GGUF" "$OUT"
RUN=${RUN:-$OUT/run}; DEVICE=${DEVICE:-cuda}; S="python3 -m specheads.cli"
reference_overrides "$RUN" "$DATA" "$DEVICE"
FRACTION=${FRACTION:-0.3}; EPOCHS=${EPOCHS:-2}; KINDS=${KINDS:-eagle3 peagle dflash}; K=${K:-4}; BLOCK=${BLOCK:-16}
HEADS=${HEADS:-$(for kind in $KINDS; do [ $kind = dflash ] && echo dflash:$BLOCK || echo $kind:$K; done)}
ANCHORS=${ANCHORS:-2048}; LR=${LR:-1e-3}; SETS=${SETS:-mixed vicuna}; VL=80; ML=null
for h in $HEADS; do
  [[ $h =~ ^(eagle3|peagle|dflash):[1-9][0-9]*$ ]] ||
    { echo "HEADS: '$h' is not eagle3:K, peagle:K or dflash:BLOCK" >&2; exit 2; }
done
[[ -z "${TAG:-}" || $TAG =~ ^[A-Za-z0-9._-]+$ ]] ||
  { echo "TAG: '$TAG' must be letters, digits, '.', '_' or '-' (it names each head's files)" >&2; exit 2; }
P=$RUN/parallel
OV+=(train.data_fraction=$FRACTION train.epochs=$EPOCHS train.lr=$LR train.dflash_anchors=$ANCHORS ${EXTRA_OV:-})
if [ -n "${SMALL:-}" ]; then
  OV+=("${SMALL_DATA_OV[@]}" train.max_tokens_per_batch=2048 train.eval_every=4 train.eval_fraction=0.1
       train.precision=fp32 eval.limit=3 eval.max_new_tokens=16 eval.batch_size=4 head.num_layers=1)
  VL=3; ML=3
fi
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/timeline.txt"; }
stage() { local name=$1; shift; log "start $name"; local t=$(date +%s)
  timeout "${LIMIT:-600}" "$@" >> "$OUT/log.txt" 2>&1; local rc=$?
  log "end $name rc=$rc $(( $(date +%s) - t ))s"; summary; return $rc; }
summary() { python3 benchmarks/parallel_summary.py "$P" --timeline "$OUT/timeline.txt" --out "$OUT/parallel.json" \
  --md "$OUT/parallel.md" >> "$OUT/log.txt" 2>&1; }

# 1. the data stages and the dump, exactly as the reference run makes them (same overrides, same RUN)
#    (no dump when every head of HEADS trains online: DFlash reads other layers than the dump holds)
OFFLINE=$(printf '%s\n' $HEADS | grep -v '^dflash:')
if [ -n "$OFFLINE" ] && [ ! -f "$RUN/dump/manifest.json" ]; then
  STOP_AFTER_DUMP=1 RUN=$RUN bash "$(dirname "$0")/gpu_reference.sh" "$GGUF" "$DATA" "$OUT" ||
    { log "data stages failed"; exit 1; }
elif [ -z "$OFFLINE" ] && [ ! -f "$RUN/vocab/vocab.json" ]; then
  STOP_BEFORE_DUMP=1 RUN=$RUN bash "$(dirname "$0")/gpu_reference.sh" "$GGUF" "$DATA" "$OUT" ||
    { log "data stages failed"; exit 1; }
fi
[ -f "$RUN/dump/manifest.json" ] && \
  OV+=(dump.dtype=$(python3 -c "import json; print(json.load(open('$RUN/dump/manifest.json'))['dtype'])"))

# 2-3. each head: train, export, evaluate
for h in $HEADS; do
  kind=${h%%:*}; k=${h#*:}; name=${kind}_k$k; HOV=(head.num_depths=$k)
  [ $kind = dflash ] && { name=dflash_b$k; HOV=(head.block_size=$k); k=$(( k - 1 )); }
  name=$name${TAG:+_$TAG}
  R=recipes/smollm2_${kind}_gpu.yaml; TD=$P/train_$name; ED=$P/$name
  resume=$([ -d $TD/checkpoints ] && echo true || echo false)
  LIMIT=${LIMIT_TRAIN:-1800} stage train_$name $S train $R "${OV[@]}" "${HOV[@]}" train.out=$TD train.resume=$resume ||
    continue
  stage export_$name $S export $R "${OV[@]}" "${HOV[@]}" train.out=$TD export.out=$ED export.k=$k || continue
  for set in $SETS; do
    case $set in
      mixed) src=(eval.prompts=builtin:eval_mixed eval.split=all eval.limit=$ML) ;;
      vicuna) src=(eval.prompts=$DATA/vicuna_bench_questions.jsonl eval.split=all eval.limit=$VL) ;;
      gsm8k) src=(eval.prompts=$DATA/gsm8k_train.jsonl eval.split=holdout eval.limit=64) ;;
    esac
    stage eval_${name}_$set $S eval $R "${OV[@]}" "${HOV[@]}" "${src[@]}" "eval.head=[$ED]" eval.k=$k \
      eval.compare=[ngram] eval.out=$P/eval_${name}_$set
  done
  # 4. decode speed with this head before the next kind trains (a run cut short keeps what it measured)
  if [ -n "${RUNTIME:-}" ]; then
    stage runtime_$name python3 benchmarks/bench_runtime.py --device $DEVICE --cuda-graphs --batches 1,8 \
      --new-tokens 128 --head $ED --k $k --engines compiled --drafters plain,ngram,head --repeat 3 \
      --serve ${SERVE:-64} --out $P/runtime_$name.json
  fi
done

log done
