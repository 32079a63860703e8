#!/usr/bin/env bash
# call A: no GGUF. The verify-cost probe; plain/ngram/head step times at batch 1 and 8 with random weights and an
# untrained head (speedup/tau = plain step / drafted step), profiled at batch 8; the kernel tests natively.
T0=$(date +%s); left() { echo $(( T0 + ${BUDGET:-570} - $(date +%s) )); }
pip install -q --no-deps --target /tmp/site .carry/whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt; date -u | tee -a $OUT/machine.txt
timeout 200 python3 .carry/tools/verify_probe.py > $OUT/verify_probe.txt 2>&1; echo "probe rc=$? $(( $(date +%s) - T0 ))s" | tee -a $OUT/machine.txt
grep -E "^forward|^linear|^attention" $OUT/verify_probe.txt
python3 .carry/tools/random_head.py /tmp/rhead > /dev/null 2>&1
t=$(date +%s); timeout $(( $(left) - 70 )) python3 benchmarks/bench_runtime.py --random-weights --device cuda --cuda-graphs --batches 1,8 --new-tokens 128 --head /tmp/rhead --engines compiled --drafters ngram,head --repeat 2 --profile --profile-all --profile-batch 8 --out $OUT/bench_random_head.json > $OUT/bench_random_head.txt 2>&1
echo "bench rc=$? $(( $(date +%s) - t ))s" | tee -a $OUT/machine.txt
grep -E "^\| compiled" $OUT/bench_random_head.txt | head -40
t=$(date +%s); TRITON_INTERPRET=0 timeout $(( $(left) - 3 )) python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_soft_ce.py tests/test_kernels_attention.py tests/test_kernels_verify.py tests/test_kernels_sampling.py > $OUT/kernel_tests_cuda.txt 2>&1
echo "kernel tests rc=$? $(( $(date +%s) - t ))s" | tee -a $OUT/machine.txt; tail -3 $OUT/kernel_tests_cuda.txt
