#!/usr/bin/env bash
# Two GPUs of one host: ZeRO-2/3 scaling and memory of the 8B-shaped head (real trainer),
# 1 vs 2 GPUs at the same global batch, a run killed on 2 GPUs resumed on 1 and back (ZeRO-2/3),
# ZeRO-3 gathering of the final head, and
# recipes/llama8b_eagle3.yaml end to end on a randomly initialised Llama-3.1-8B-shaped target
# (prepare -> vocab -> 2-rank dump (+ a 1-rank dump to compare) -> ZeRO-3 training on 2 GPUs ->
# export + validation -> eval). No GGUF or prompt files: the target is random.
# Usage:  bash benchmarks/gpu_multigpu.sh [OUT]   (or OUT=...; default ./out), from the repository root with the
# project installed. Results go to OUT/results, the runs (checkpoints of the 8B-shaped head: ~25 GB each, the 16 GB
# random target) to WORK, default OUT/work.
# PARTS picks the parts (default "1 1b 2 3"); stage 1b compares against stage 1's curves, which
# BASELINE=<an earlier results dir> can supply when stage 1 is not rerun.
set -u
OUT=${1:-${OUT:-out}}; mkdir -p "$OUT/results"
W=${WORK:-$OUT/work}; mkdir -p "$W"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
# NVLink multicast stays off: a program using it can take some hosts' GPUs down
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/timeline.txt"; }
stage() { local name=$1; shift; log "start $name"; local t=$(date +%s)
  timeout "${LIMIT:-300}" "$@" >> "$OUT/log.txt" 2>&1; local rc=$?
  log "end $name rc=$rc $(( $(date +%s) - t ))s"; return $rc; }
pack() { tar czf "$OUT/multigpu.tar.gz" -C "$OUT" results timeline.txt 2>/dev/null; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/timeline.txt"
B=benchmarks/bench_multigpu.py; R=$OUT/results
PARTS=" ${PARTS:-1 1b 2 3} "; part() { [[ "$PARTS" == *" $1 "* ]]; }
if [ -n "${BASELINE:-}" ]; then cp "$BASELINE"/z*_w[12].rank*.json "$R"/; fi

# 1. scaling, memory and the loss curve at one global batch (2 sequences of 2048 tokens per step)
part 1 && for z in ${ZERO_STAGES:-2 3}; do
  stage z${z}_w1 torchrun --nproc_per_node 1 $B --zero $z --accum 2 --steps 12 --tag z${z}_w1 --out $R --run-dir $W/mg/z${z}_w1
  stage z${z}_w2 torchrun --nproc_per_node 2 $B --zero $z --accum 1 --steps 12 --tag z${z}_w2 --out $R --run-dir $W/mg/z${z}_w2
  pack
done
# 1b. resume on another number of GPUs (N -> M, same global batch): a run killed right after its step-6
# checkpoint continues on the other GPU count; the curve must follow the uninterrupted runs of stage 1
# (resume_n_to_m.json + .png). The first resume converts the ZeRO checkpoint to a universal one.
# The *_kill stages end rc=1 by design (torchrun reports the SIGKILLed ranks).
part 1b && for z in ${RESUME_ZERO_STAGES:-2 3}; do
  K="--zero $z --steps 12 --save-every 6"
  stage z${z}_2to1_kill torchrun --nproc_per_node 2 $B $K --accum 1 --kill-at-step 6 --tag z${z}_2to1_killed --out $R --run-dir $W/mg/z${z}_2to1
  stage z${z}_2to1_resume torchrun --nproc_per_node 1 $B $K --accum 2 --resume --tag z${z}_2to1 --out $R --run-dir $W/mg/z${z}_2to1
  stage z${z}_1to2_kill torchrun --nproc_per_node 1 $B $K --accum 2 --kill-at-step 6 --tag z${z}_1to2_killed --out $R --run-dir $W/mg/z${z}_1to2
  stage z${z}_1to2_resume torchrun --nproc_per_node 2 $B $K --accum 1 --resume --tag z${z}_1to2 --out $R --run-dir $W/mg/z${z}_1to2
  # ~25 GB a run dir (8B-head optimizer states, their universal copy): keep the sizes, free the disk
  du -sh $W/mg/z${z}_*to*/train/checkpoints/* >> $R/resume_checkpoint_sizes.txt 2>&1; rm -rf $W/mg/z${z}_*to*
done
part 1b && { stage resume_report python3 $B --resume-report --out $R; pack; }

part 2 || part 3 || { log done; exit 0; }
# 2. ZeRO-3: the gathered final/ head against the head DeepSpeed re-assembles from the step-12 shards
stage zero3_gather python3 benchmarks/compare_heads.py $W/mg/z3_w2/train/final $W/mg/z3_w2/train/checkpoints/step_12 \
  --out $R/zero3_gather.json; pack

# 3. recipes/llama8b_eagle3.yaml end to end on a random 8B-shaped target
LIMIT=400 stage make_target python3 benchmarks/make_random_target.py --shape ${SHAPE:-llama-3.1-8b} --out $W/l8 \
  --data $W/l8data --conversations 128 --prompts 8
RCP=recipes/llama8b_eagle3.yaml
OV=(run_dir=$W/l8run target.source=$W/l8 "data.sources=[{path: $W/l8data/conversations.jsonl}]"
    data.regenerate.enabled=false head.aux_layer_ids=null vocab.draft_vocab_size=${VOCAB:-32000} data.max_length=1024 data.holdout_fraction=0.05 dump.shard_tokens=16384
    train.epochs=1 train.max_steps=20 train.warmup_steps=2 train.save_every=10 train.eval_every=10
    train.eval_fraction=0.05 train.zero_stage=${E2E_ZERO:-3} train.micro_batch_size=2 train.grad_accum=1 train.logging.wandb=disabled
    eval.prompts=$W/l8data/prompts.jsonl eval.limit=4 eval.max_new_tokens=32 eval.batch_size=1)
S="python3 -m specheads.cli"
stage prepare $S data prepare $RCP "${OV[@]}" && stage vocab $S vocab $RCP "${OV[@]}" && \
stage dump_2ranks torchrun --nproc_per_node 2 -m specheads.dump.writer $RCP "${OV[@]}" && \
stage dump_1rank $S dump $RCP "${OV[@]}" dump.dir=$W/l8run/dump1 && \
R=$R W=$W stage dump_compare python3 - <<'EOF'
import json, filecmp, os, pathlib
w = pathlib.Path(os.environ["W"])
a, b = w / "l8run" / "dump", w / "l8run" / "dump1"
ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
sa = [(s["file"], s["sha256"]) for s in ma["shards"]]
sb = [(s["file"], s["sha256"]) for s in mb["shards"]]
same_bytes = all(filecmp.cmp(a / f, b / f, shallow=False) for f, _ in sa)
res = {"shards": len(sa), "sha256_equal": sa == sb, "bytes_equal": same_bytes, "counts_2ranks": ma["counts"],
       "counts_1rank": mb["counts"]}
print(json.dumps(res))
pathlib.Path(os.environ["R"], "dump_2ranks_vs_1.json").write_text(json.dumps(res, indent=1))
EOF
$S dump --inspect $W/l8run/dump > $R/dump_inspect.txt 2>&1; pack
LIMIT=500 stage train_zero3_2gpu torchrun --nproc_per_node 2 -m specheads.cli train $RCP "${OV[@]}"
cp $W/l8run/train/metrics.jsonl $R/l8_train_metrics.jsonl 2>/dev/null
stage export $S export $RCP "${OV[@]}" && \
stage export_vs_trained python3 benchmarks/compare_heads.py $W/l8run/train/final $W/l8run/train/checkpoints/step_20 \
  --export $W/l8run/export/speculators --out $R/l8_gather_export.json
cp $W/l8run/export/speculators/README.md $R/l8_model_card.md 2>/dev/null; pack
LIMIT=400 stage eval $S eval $RCP "${OV[@]}"
cp $W/l8run/eval/report.json $R/l8_eval_report.json 2>/dev/null; cp $W/l8run/eval/report.md $R/l8_eval_report.md 2>/dev/null
grep -E "tok/s|peak|MFU|dump complete|trained|held-out|report:|τ=" $OUT/log.txt > $R/highlights.txt
pack; log done
