#!/usr/bin/env bash
# Thirteenth sitting (2026-12-04): the graphed prefill, in one call with the wheels only (random weights, no GGUF):
# Ran on the working tree of graphed_prefill.patch.txt (a graphed, padded prefill and bench_runtime --eager-prefill, the
# control); the patch did not land (BENCHMARKS.md, thirteenth sitting), so --eager-prefill is not in the code.
#   `bash benchmarks/device_call.sh bash $0` (carry .carry/whl). Results go straight to $OUT, so a call cut short
#   still returns what finished: the GPU tests of the prefill and the graph paths, then bench_runtime at batch 1
#   and 8 with the graphed prefill and with --eager-prefill (the control), each in a process of its own.
log() { echo "[$(date +%T)] $*" | tee -a $OUT/timeline.txt; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > $OUT/machine.txt; date -u >> $OUT/machine.txt
t=$(date +%s); timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_runtime_cuda.py \
  -k "graphed_prefill or graphs_match_eager" > $OUT/pytest.txt 2>&1
log "pytest rc=$? $(( $(date +%s) - t ))s: $(tail -1 $OUT/pytest.txt)"
B="python3 benchmarks/bench_runtime.py --random-weights --random-head --device cuda --cuda-graphs --batches 1,8
   --new-tokens 128 --engines compiled --drafters ngram,head --repeat 3"
for v in "graphed:" "eager_prefill:--eager-prefill"; do n=${v%%:*}; t=$(date +%s)
  timeout 170 $B ${v#*:} --out $OUT/$n.json > $OUT/$n.txt 2>&1
  log "bench $n rc=$? $(( $(date +%s) - t ))s"; grep -E "^\| compiled|identical" $OUT/$n.txt; done
python3 - <<'PY' 2>&1 | tee $OUT/prefill_ab.txt
import json, os
for n in ("graphed", "eager_prefill"):
    try: rows = json.load(open(os.path.join(os.environ["OUT"], n + ".json")))["rows"]
    except Exception as e: print(n, "missing", e); continue
    for r in rows:
        print(f"{n:14s} b{r['batch']:<3d} {r['drafter']:16s} prefill {1000 * r['prefill_s']:6.1f} ms  "
              f"tok/s {r['tokens_per_s']:9,.0f}  after prefill {r['decode_tokens_per_s']:9,.0f}  lossless {r['lossless']}")
PY
log FINISHED
