#!/usr/bin/env bash
# call 1: bpart00 to /tmp/b, the wheels, then the trainer step benchmark (synthetic states, SmolLM2 shapes,
# eager) with the in-place loss kernel (triton) against the gathering reference (torch)
mkdir -p /tmp/b /tmp/site && cp .carry/c0/bpart00 /tmp/b/
pip install -q --no-deps --target /tmp/site .carry/whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt; date -u | tee -a $OUT/machine.txt
for be in triton torch; do t=$(date +%s)
  timeout 75 python3 benchmarks/bench_train.py --only smollm2 --smollm2-device cuda --backend $be \
    --smollm2-shapes 64x512,128x256,32x1024 --steps 5 --modes eager --out $OUT/bench_train_$be.json \
    > $OUT/bench_train_$be.txt 2>&1; echo "bench_train $be rc=$? $(( $(date +%s) - t ))s" | tee -a $OUT/machine.txt
  grep -E "^\| smollm2" $OUT/bench_train_$be.txt
done
