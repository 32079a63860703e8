#!/usr/bin/env bash
# A poll of a run started in the background on the lent GPU (setsid, writing to DIR): waits until DIR/timeline.txt
# says `done`, or SECONDS (default 540) have passed, then copies the run's small outputs into $OUT, which is what
# one call brings back (a machine that goes back between two calls keeps nothing):
#   bash benchmarks/device_wait.sh DIR [SECONDS]
# Prints the timeline and the log's last lines (progress bars cut at their carriage returns).
set -u
DIR=$1; SECS=${2:-540}; OUT=${OUT:-out}; mkdir -p "$OUT"
end=$(( $(date +%s) + SECS ))
while [ "$(date +%s)" -lt $end ] && ! grep -q '\] done$' "$DIR/timeline.txt" 2>/dev/null; do sleep 5; done
for f in timeline.txt reference.json partial_reports.tar.gz reference_run.tar.gz bench_runtime.json bench_train.json; do
  [ -f "$DIR/$f" ] && cp "$DIR/$f" "$OUT/"
done
[ -f "$DIR/log.txt" ] && tr '\r' '\n' < "$DIR/log.txt" | grep -v '^\s*$' | tail -n 3000 > "$OUT/log_tail.txt"
cat "$DIR/timeline.txt" 2>/dev/null
echo "--- log"; tail -n 8 "$OUT/log_tail.txt" 2>/dev/null | cut -c1-300
