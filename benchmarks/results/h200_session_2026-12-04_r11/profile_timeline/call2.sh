#!/usr/bin/env bash
# Eleventh sitting, call 2: bpart00 to /tmp/b (for call 3); random SmolLM2 weights, untrained head: where the
# graphed step's device time goes at batch 1 and 8 (bench_runtime --profile-only, graph_timeline).
mkdir -p /tmp/b /tmp/site && cp .carry/c0/bpart00 /tmp/b/
pip install -q --no-deps --target /tmp/site .carry/whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD:/tmp/site
date -u | tee $OUT/machine.txt
for B in 1 8; do t=$(date +%s)
  timeout 200 python3 benchmarks/bench_runtime.py --random-weights --random-head --device cuda --cuda-graphs --batches $B \
    --new-tokens 128 --engines compiled --drafters ngram,head --profile-only --profile-all --profile-batch $B \
    --trace /tmp/trace_b$B --out $OUT/timeline_b$B.json > $OUT/timeline_b$B.txt 2>&1
  echo "b$B rc=$? $(( $(date +%s) - t ))s" | tee -a $OUT/machine.txt
  grep -E "^### Profile|^Graphed|^- " $OUT/timeline_b$B.txt | head -45
done
gzip -c /tmp/trace_b1_ngram.json > $OUT/trace_b1_ngram.json.gz 2>/dev/null; gzip -c /tmp/trace_b1_plain.json > $OUT/trace_b1_plain.json.gz 2>/dev/null
ls -la /tmp/b $OUT
