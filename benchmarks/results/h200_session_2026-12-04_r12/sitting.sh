#!/usr/bin/env bash
# Twelfth sitting (2026-12-04), run through benchmarks/device_call.sh:
#   call 1 (carry .carry/c0): `bash benchmarks/device_call.sh bash $0 replay` starts the graph-replay probes
#          (random weights, no GGUF) in the background and returns;
#   call 2 (carry .carry/c1): `... bash $0 real` - with the GGUF joined: once the probes are done, the demo head
#          trained on the GPU, then bench_runtime --isolate on the real weights (every row its own process);
#   later calls: `bash $0 poll` waits up to WAIT s for the job and copies what exists to $OUT.
O=/tmp/o12; mkdir -p $O
log() { echo "[$(date +%T)] $*" | tee -a $O/timeline.txt; }
case $1 in
replay)
  cat > /tmp/replay.sh <<'EOS'
O=/tmp/o12; log() { echo "[$(date +%T)] $*" | tee -a $O/timeline.txt; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > $O/machine.txt; date -u >> $O/machine.txt
R="timeout 240 python3 benchmarks/bench_graph_replay.py --graphs 6"
for v in "eager:" "eager_shared:--shared-pool" "compiled_new:--compile --new-kernels --shared-pool" \
         "compiled_new_nocapture:--compile --new-kernels --no-capture" "compiled_same:--compile --shared-pool" \
         "eager_nocapture:--no-capture"; do
  n=${v%%:*}; t=$(date +%s); $R ${v#*:} --out $O/replay_$n.json > $O/replay_$n.txt 2>&1
  log "replay $n rc=$? $(( $(date +%s) - t ))s"; done
log REPLAY_FINISHED
EOS
  setsid nohup bash /tmp/replay.sh > $O/replay_job.log 2>&1 < /dev/null &
  sleep 5; cat $O/timeline.txt 2>/dev/null; exit 0;;
real)
  [ -n "${GGUF:-}" ] || { echo "no GGUF: the machine went back between the calls"; exit 3; }
  cat > /tmp/real.sh <<'EOS'
O=/tmp/o12; log() { echo "[$(date +%T)] $*" | tee -a $O/timeline.txt; }
for i in $(seq 1 60); do grep -q REPLAY_FINISHED $O/timeline.txt 2>/dev/null && break; sleep 5; done
S="python3 -m specheads.cli"; R=recipes/smollm2_eagle3.yaml
OV=(run_dir=/tmp/demo target.device=cuda data.regenerate.batch_size=64 train.epochs=4 train.logging.wandb=disabled)
for st in "data regenerate" "data prepare" vocab dump train export; do t=$(date +%s)
  timeout 300 $S $st $R "${OV[@]}" >> $O/pipeline.txt 2>&1; log "$st rc=$? $(( $(date +%s) - t ))s"; done
grep -E "regenerated|token rows|draft vocab|trained|held-out" $O/pipeline.txt | tail -8 >> $O/timeline.txt
t=$(date +%s); timeout 900 python3 benchmarks/bench_runtime.py --head /tmp/demo/export/speculators --device cuda \
  --cuda-graphs --batches 1,8,48 --new-tokens 128 --engines compiled --drafters ngram,head,hybrid --repeat 2 \
  --isolate --out $O/isolated.json > $O/isolated.txt 2>&1; log "isolated bench rc=$? $(( $(date +%s) - t ))s"
log JOB_FINISHED
EOS
  setsid nohup bash /tmp/real.sh > $O/real_job.log 2>&1 < /dev/null &
  ;;
esac
W=${WAIT:-530}; for i in $(seq 1 $((W / 10))); do grep -q JOB_FINISHED $O/timeline.txt 2>/dev/null && break; sleep 10; done
cat $O/timeline.txt
for f in $O/replay_*.txt; do echo "== $f"; grep "^|" $f; done 2>/dev/null
grep -E "^\| compiled|identical" $O/isolated.txt 2>/dev/null
tar czf $OUT/o12.tgz -C /tmp o12 2>/dev/null; cp $O/timeline.txt $O/isolated.txt $OUT/ 2>/dev/null; true
