#!/usr/bin/env bash
# Eleventh sitting, call 1 (random SmolLM2 weights, no GGUF): the small-row linear kernel natively tested, against
# cuBLAS per shape (bench_linear --sweep), and in the runtime (new) against the code of 63d3a4d (old) at batch 1 and 8.
T0=$(date +%s); left() { echo $(( T0 + ${BUDGET:-540} - $(date +%s) )); }
mkdir -p /tmp/site && pip install -q --no-deps --target /tmp/site .carry/whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt; date -u | tee -a $OUT/machine.txt
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r specheads /tmp/old/ && (cd /tmp/old && patch -s -R -p1 < $OLDPWD/.carry/tools/linear.patch) && echo "old tree: $(ls /tmp/old/specheads/kernels | grep -c linear) linear files" | tee -a $OUT/machine.txt
t=$(date +%s); PYTHONPATH=$PWD:/tmp/site TRITON_INTERPRET=0 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_linear.py tests/test_kernels_attention.py > $OUT/kernel_tests_cuda.txt 2>&1
echo "kernel tests rc=$? $(( $(date +%s) - t ))s" | tee -a $OUT/machine.txt; tail -3 $OUT/kernel_tests_cuda.txt
t=$(date +%s); PYTHONPATH=$PWD:/tmp/site timeout 150 python3 benchmarks/bench_linear.py --sweep --out $OUT/bench_linear.json > $OUT/bench_linear.txt 2>&1
echo "bench_linear rc=$? $(( $(date +%s) - t ))s" | tee -a $OUT/machine.txt; grep -A8 "^| rows" $OUT/bench_linear.txt
B="benchmarks/bench_runtime.py --random-weights --random-head --device cuda --cuda-graphs --batches 1,8 --new-tokens 128 --engines compiled --drafters ngram,head --repeat 2"
t=$(date +%s); PYTHONPATH=$PWD:/tmp/site timeout 180 python3 $B --profile --profile-all --profile-batch 1 --out $OUT/new.json > $OUT/new.txt 2>&1
echo "new rc=$? $(( $(date +%s) - t ))s" | tee -a $OUT/machine.txt; grep -E "^\| compiled|^### Profile" $OUT/new.txt | head -24
t=$(date +%s); PYTHONPATH=/tmp/old:/tmp/site timeout $(( $(left) - 3 )) python3 $B --out $OUT/old.json > $OUT/old.txt 2>&1
echo "old rc=$? $(( $(date +%s) - t ))s" | tee -a $OUT/machine.txt; grep -E "^\| compiled" $OUT/old.txt | head -24
