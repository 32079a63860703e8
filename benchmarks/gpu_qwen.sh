#!/usr/bin/env bash
# A Qwen2.5-Coder-1.5B-Instruct draft head from nothing but prompts on one GPU, in the order a run cut short keeps
# what matters (recipes/qwen2.5_coder_1.5b_eagle3.yaml; its target is a GGUF in 22 parts):
#   1. target: join the parts (or check the joined file) and de-quantise once, so that later stages load a cached copy
#   2. synthesize -> regenerate -> prepare -> vocab (the EAGLE-3 recipe's data stages, whatever the head kind: every
#      kind trains on the same deterministic rows) and the held-out code set (code_holdout)
#   3. train KIND online (the target inside the trainer: no dump) -> export
#   4. eval on the mixed set, Vicuna, held-back gsm8k and the held-out code set, the head beside n-gram, suffix
#      decoding and the head's hybrid with each -> OUT/qwen2.5_coder_1.5b.json and .md (benchmarks/qwen_summary.py)
#   1b. RUNTIME=1, right after the target: bench_runtime of plain, n-gram and suffix decoding at batch 1, 8 and 32 and
#      served, and bandwidth.py (6): the figures that need no head come first
#   5. RUNTIME=1: bench_runtime at batch 1, 8 and 32 with the head (compiled engine, CUDA graphs) and SERVE requests
#      served with continuous batching
#   6. bandwidth.py: the device's copy bandwidth and the bf16 weights' bytes -> plain decoding's bound at batch 1,
#      printed beside plain decoding's figure (this kind's bench_runtime JSON, else another kind's: plain decoding has
#      no head), and the matmul peak the online training's MFU is computed against
# Steps 1-4 are the "prompts -> evaluated head" time (the timeline's prompts_to_eval_KIND[_TAG]; a 20-minute budget on
# one H100, the recipe's comments give the estimate behind the data size). 5 may be a run of its own: RUNTIME=1 on a
# finished OUT skips every finished stage.
#
# Usage:  bash benchmarks/gpu_qwen.sh PARTS_OR_GGUF DATA OUT   (or the environment variables GGUF, DATA, OUT)
#   PARTS_OR_GGUF  the folder of the target's 22 parts (the .bin files or the packages' wheels: the recipe's
#                  target.gguf_parts.folder), or the joined GGUF file (its sha256 is checked against the recipe's)
#   DATA           the folder with gsm8k_train.jsonl, new_codealpaca.json, code_alpaca_2k.json (evaluated on, never
#                  trained on) and vicuna_bench_questions.jsonl
#   OUT            where the results go: timeline.txt, log.txt, qwen2.5_coder_1.5b.json/.md, bandwidth.json,
#                  bench_runtime_KIND[_TAG].json, reports.tar.gz; the run itself (rows, checkpoints) goes to RUN
#                  (OUT/run)
# Environment: KIND=eagle3|peagle|dflash (the recipe recipes/qwen2.5_coder_1.5b_KIND.yaml; default eagle3), RUNTIME=1,
# SERVE (requests served, default 64), PROMPTS / GSM8K / EPOCHS (the synthesized prompts, gsm8k rows and training
# epochs, to retune the budget once a run has measured its rates; give every kind the same PROMPTS and GSM8K, or its
# data differs), TRAIN_MINUTES (train.max_minutes: the training loop's wall-clock budget, its last step re-planned
# from the measured rate and the LR decayed by it; EPOCHS is then the most it trains), EVAL_LIMIT (prompts of each
# eval set, default 40: the four sets' first 40 fit the 20-minute budget, 933 s in all on an H100; EVAL_LIMIT= for
# all of the mixed set and 80 / 64 / 64 of the others, ~10 minutes more), BATCHES (default 1,8,32), SETS (the
# eval sets, default "mixed vicuna gsm8k_holdout code_holdout"), MERGE="F ..." (earlier
# summaries whose heads join this one's), EXTRA_OV (more overrides for every stage), LR (train.lr of this head
# alone), TAG (a suffix of the head's files and stages, as eagle3_TAG: variants of one kind on the same rows, e.g.
# TAG=lr1e-3 LR=1e-3 beside the recipe's head; the summary lists them, its goals judge the untagged head),
# SWEEP=1 (step 7; SWEEP_K, SWEEP_LIMIT, SWEEP_DTYPE, SWEEP_REPEAT), SMALL=1 DEVICE=cpu (a CPU smoke test of
# this script: every count tiny).
# Run from the repository root with the project installed. Every stage resumes: a second run after a kill skips the
# stages that finished with the same command and goes on from there (training from its last checkpoint).
set -u
SRC=${1:-${GGUF:-}}; DATA=${2:-${DATA:-data}}; OUT=${3:-${OUT:-out}}
KIND=${KIND:-eagle3}
case $KIND in eagle3|peagle|dflash) ;; *) echo "KIND=$KIND: one of eagle3, peagle, dflash" >&2; exit 2 ;; esac
[[ -z "${TAG:-}" || $TAG =~ ^[A-Za-z0-9.-]+$ ]] ||
  { echo "TAG: '$TAG' must be letters, digits, '.' or '-' (it names the head's files after KIND_)" >&2; exit 2; }
HN=$KIND${TAG:+_$TAG}   # the head's name: its stages, folders and runtime JSON
# another learning rate is another head: without a TAG it would resume the recipe's head's finished checkpoints
[ -n "${LR:-}" ] && [ -z "${TAG:-}" ] && { echo "LR=$LR needs a TAG: it trains a variant beside the recipe's head" >&2
  exit 2; }
. "$(dirname "$0")/gpu_setup.sh"
RD=recipes/qwen2.5_coder_1.5b_eagle3.yaml   # the data stages' recipe: the rows every kind trains on
R=recipes/qwen2.5_coder_1.5b_$KIND.yaml
require_files "$DATA" gsm8k_train.jsonl new_codealpaca.json code_alpaca_2k.json vicuna_bench_questions.jsonl
use_gguf_parts "$SRC" "$RD"
mkdir -p "$OUT"
RUN=${RUN:-$OUT/run}; DEVICE=${DEVICE:-cuda}; S="python3 -m specheads.cli"
OV=(run_dir=$RUN target.device=$DEVICE "${TARGET_OV[@]}" "data.sources.0.path=$DATA/gsm8k_train.jsonl"
    "data.sources.1.path=$DATA/new_codealpaca.json" "data.sources.2.path=$RUN/data/synthesized.jsonl")
[ -n "${PROMPTS:-}" ] && OV+=(data.synthesize.num_prompts=$PROMPTS)
[ -n "${GSM8K:-}" ] && OV+=(data.sources.0.limit=$GSM8K)
# TOV: the overrides of the head's own stages, kept out of the data stages' commands (a change re-runs only those)
TOV=(); [ -n "${EPOCHS:-}" ] && TOV+=(train.epochs=$EPOCHS)
[ -n "${TRAIN_MINUTES:-}" ] && TOV+=(train.max_minutes=$TRAIN_MINUTES)
[ -n "${LR:-}" ] && TOV+=(train.lr=$LR)
TD=$RUN/train_$HN; ED=$RUN/export_$HN
K=3; [ $KIND = peagle ] && K=4; [ $KIND = dflash ] && K=15
SETS=${SETS:-mixed vicuna gsm8k_holdout code_holdout}; ML=null; VL=80; GL=64; CL=64
EVAL_LIMIT=${EVAL_LIMIT-40}
[ -n "$EVAL_LIMIT" ] && { ML=$EVAL_LIMIT; VL=$EVAL_LIMIT; GL=$EVAL_LIMIT; CL=$EVAL_LIMIT; }
NEW=128; BATCHES=${BATCHES:-1,8,32}; ENGINES=compiled; REPEAT=${REPEAT:-3}; LIMIT_TRAIN=1800; GIB=2
if [ -n "${SMALL:-}" ]; then
  # a handful of prompts and tokens: the 1.5B target in fp32 decodes about a token a second on a small CPU
  OV+=(data.synthesize.num_prompts=3 data.synthesize.batch_size=3 data.synthesize.max_new_tokens=40
       data.synthesize.copy_tasks.document_tokens=24 data.sources.0.limit=6 data.sources.1.limit=6 data.max_length=512
       data.regenerate.max_new_tokens=12 data.regenerate.batch_size=8 data.regenerate.max_prompt_tokens=256
       vocab.draft_vocab_size=2048)
  TOV+=(train.max_steps=2 train.ttt_steps=2 train.max_tokens_per_batch=1024 train.warmup_steps=0 train.save_every=1
        train.eval_every=2 train.eval_fraction=0.1 train.precision=fp32 eval.max_new_tokens=8 eval.batch_size=2
        head.num_layers=1 head.num_depths=2 head.block_size=4 train.dflash_anchors=16)
  [ $KIND = peagle ] && K=2; [ $KIND = dflash ] && K=3
  ML=2; VL=2; GL=2; CL=2; NEW=8; BATCHES=1; ENGINES=eager; REPEAT=1; GIB=0.25   # eager: no CPU compilation
fi
OV+=(${EXTRA_OV:-})
# the kind's own outputs in the shared run directory
KO=(${TOV[@]+"${TOV[@]}"} train.out=$TD export.out=$ED export.k=$K eval.k=$K)
T0=$(date +%s)
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/timeline.txt"; }
# a stage that finished with the same command (train.resume aside) and the same recipe and prompt files (inputs_key)
# is skipped, unless an earlier stage ran again in this invocation: what it wrote may have changed
DONE=$RUN/.stages; RAN=; SKIPPED=
stage() { local name=$1; shift
  local key a args=(); for a in "$@"; do [[ $a == train.resume=* ]] || args+=("$a"); done
  key=$(inputs_key "$RUN" "${args[@]}")
  finished_before "$name" "$key" && { SKIPPED=1; return 0; }
  log "start $name"; local t=$(date +%s)
  timeout "${LIMIT:-900}" "$@" >> "$OUT/log.txt" 2>&1; local rc=$?
  log "end $name rc=$rc $(( $(date +%s) - t ))s"
  [ $rc -eq 0 ] && echo "$key" > "$DONE/$name"
  return $rc; }
# measurements run every time (their inputs, e.g. a later bench_runtime JSON, are not in their command)
measure() { local name=$1; shift; log "start $name"; local t=$(date +%s)
  timeout "${LIMIT:-900}" "$@" >> "$OUT/log.txt" 2>&1; local rc=$?
  log "end $name rc=$rc $(( $(date +%s) - t ))s"; return $rc; }
summary() {
  local merge=() f; for f in ${MERGE:-}; do merge+=(--merge "$f"); done
  local rt=()
  for f in "$OUT"/bench_runtime_*.json; do
    [ -f "$f" ] && rt+=(--runtime "$(basename "$f" .json | sed 's/^bench_runtime_//')=$f")
  done
  python3 benchmarks/qwen_summary.py summary --run "$RUN" --out "$OUT/qwen2.5_coder_1.5b.json" \
    --md "$OUT/qwen2.5_coder_1.5b.md" --timeline "$OUT/timeline.txt" --bandwidth "$OUT/bandwidth.json" \
    ${rt[@]+"${rt[@]}"} ${merge[@]+"${merge[@]}"} >> "$OUT/log.txt" 2>&1
  tar czf "$OUT/reports.tar.gz" "$RUN"/eval_*/report.* "$RUN"/eval_*/sweep_partial.json "$RUN"/train_*/metrics.jsonl \
    "$RUN"/train_*/plots \
    "$RUN"/train_*/final/head_config.json "$RUN"/train_*/diverged.json \
    "$RUN"/data/*summary*.json "$RUN"/data/rows/summary.json \
    "$RUN"/vocab/vocab.json "$RUN"/export_*/config.json "$RUN"/export_*/README.md 2>/dev/null
}
trap summary EXIT
log "gpu_qwen.sh KIND=$KIND ${TAG:+TAG=$TAG }${SMALL:+SMALL=1 }DEVICE=$DEVICE"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee -a "$OUT/timeline.txt"
df -h "$OUT" 2>/dev/null | tail -1 | tee -a "$OUT/timeline.txt"

# 1. join (or check) and de-quantise the target once: its own line in the timeline, not hidden in synthesize's
stage target python3 -c "import sys; from specheads.config import load_recipe; from specheads.target import \
load_target_for; load_target_for(load_recipe(sys.argv[1], sys.argv[2:]), device='cpu')" $RD "${OV[@]}" || exit 1
# the name the joined file goes by in the GGUF cache, or the joined file's path
TGT=$(python3 -c "import sys; from specheads.config import load_recipe; \
print(load_recipe(sys.argv[1], sys.argv[2:]).target.source)" $RD "${OV[@]}")
# plain decoding has no head: the latest runtime JSON with a plain row at batch 1 serves
bandwidth() { local rtj; rtj=$(ls -t "$OUT"/bench_runtime_*.json 2>/dev/null | head -1)
  measure bandwidth python3 benchmarks/bandwidth.py --target "$TGT" --device $DEVICE --gib $GIB \
    ${rtj:+--bench-runtime "$rtj"} --out "$OUT/bandwidth.json"
  grep -E "^(device copy|plain decoding|matmul peak)" "$OUT/log.txt" | tail -3 | tee -a "$OUT/timeline.txt"; }
# 1b. RUNTIME=1: plain, n-gram and suffix decoding first (k 3), and plain beside the memory-bandwidth bound: none of
#     it needs a head, so a run cut short in its data stages or training still has them. Once per OUT.
FREE_S=0
if [ -n "${RUNTIME:-}" ] && [ ! -f "$OUT/bench_runtime_model_free.json" ]; then
  t_free=$(date +%s)
  LIMIT=600 measure runtime_model_free python3 benchmarks/bench_runtime.py --target "$TGT" --device $DEVICE \
    --cuda-graphs --batches $BATCHES --new-tokens $NEW --k 3 --engines $ENGINES --drafters plain,ngram,suffix \
    --repeat $REPEAT --serve ${SERVE:-64} --out "$OUT/bench_runtime_model_free.json"
  bandwidth; summary
  FREE_S=$(( $(date +%s) - t_free ))   # not part of "prompts to an evaluated head"
fi
# 2. the data stages (the EAGLE-3 recipe's for every kind) and the held-out code set
stage synthesize $S data synthesize $RD "${OV[@]}" && stage regenerate $S data regenerate $RD "${OV[@]}" && \
stage prepare $S data prepare $RD "${OV[@]}" && stage vocab $S vocab $RD "${OV[@]}" && \
stage code_holdout python3 benchmarks/qwen_summary.py code-holdout --src "$DATA/code_alpaca_2k.json" \
  --exclude "$DATA/new_codealpaca.json" --out "$RUN/data/code_holdout.json" || exit 1
# 3. the head, trained online, from its last checkpoint after a kill
LIMIT=$LIMIT_TRAIN stage train_$HN $S train $R "${OV[@]}" "${KO[@]}" \
  train.resume=$([ -d "$TD/checkpoints" ] && echo true || echo false) || exit 1
stage export_$HN $S export $R "${OV[@]}" "${KO[@]}" || exit 1
# 4. the eval sets (the four by default), each with n-gram, suffix decoding and both hybrids beside the head
#    (the recipe's compare)
for set in $SETS; do
  case $set in
    mixed) src=(eval.prompts=builtin:eval_mixed eval.split=all eval.limit=$ML) ;;
    vicuna) src=("eval.prompts=$DATA/vicuna_bench_questions.jsonl" eval.split=all eval.limit=$VL) ;;
    gsm8k_holdout) src=("eval.prompts=$DATA/gsm8k_train.jsonl" eval.split=holdout eval.limit=$GL) ;;
    code_holdout) src=("eval.prompts=$RUN/data/code_holdout.json" eval.split=all eval.limit=$CL) ;;
  esac
  stage eval_${HN}_$set $S eval $R "${OV[@]}" "${KO[@]}" "${src[@]}" "eval.head=[$ED]" \
    eval.out=$RUN/eval_${HN}_$set
  summary
done
# the wall time of a run that did every stage itself (a resumed one's stages are in the summary's sum)
[ -z "$SKIPPED" ] && log "end prompts_to_eval_$HN rc=0 $(( $(date +%s) - T0 - FREE_S ))s (wall time, prompts to the \
last eval, less the model-free runtime's ${FREE_S}s)"

# 5-6. decode speed with the head (plain again: the speedups compare within one run; n-gram and suffix are in the
#      model-free run), then plain decoding beside its memory-bandwidth bound once more
if [ -n "${RUNTIME:-}" ]; then
  LIMIT=600 measure runtime_$HN python3 benchmarks/bench_runtime.py --target "$TGT" --device $DEVICE --cuda-graphs \
    --batches $BATCHES --new-tokens $NEW --head "$ED" --k $K --engines $ENGINES \
    --drafters ${RUNTIME_DRAFTERS:-plain,head,hybrid,hybrid_suffix} --repeat $REPEAT --serve ${SERVE:-64} \
    --out "$OUT/bench_runtime_$HN.json"
fi
# 7. SWEEP=1: eval --sweep on the held-out code set's first SWEEP_LIMIT prompts (default 32): the head, n-gram and
#    suffix decoding at every k of SWEEP_K (default 2,3,4; a parallel head at its own k) served with continuous
#    batching at concurrency 1, 8 and 32, plain beside them; the recommended vLLM --speculative-config and SGLang
#    flags go to RUN/eval_sweep_KIND[_TAG]/report.md and into the exported head's model card. The target runs in
#    SWEEP_DTYPE (default bfloat16, the dtype it is served in; in float32 every output stays identical to plain
#    decoding's, but plain decoding served one request at 227 tok/s against 372 in bfloat16 on an H100: not a
#    server's speeds)
if [ -n "${SWEEP:-}" ]; then
  # two serving passes a point, 3 x (1 + drafters x k) points: well past a stage's default 900 s on this target
  LIMIT=2400 stage sweep_$HN $S eval $R "${OV[@]}" "${KO[@]}" target.dtype=${SWEEP_DTYPE:-bfloat16} \
    "eval.prompts=$RUN/data/code_holdout.json" \
    eval.split=all eval.limit=${SWEEP_LIMIT:-32} "eval.head=[$ED]" "eval.compare=[ngram,suffix]" \
    eval.sweep.enabled=true "eval.sweep.k=[${SWEEP_K:-2,3,4}]" eval.sweep.repeat=${SWEEP_REPEAT:-1} \
    eval.update_card=true eval.out=$RUN/eval_sweep_$HN
fi
bandwidth
summary; trap - EXIT
grep -E "^goal " "$OUT/log.txt" | tail -6 | tee -a "$OUT/timeline.txt"
log done
