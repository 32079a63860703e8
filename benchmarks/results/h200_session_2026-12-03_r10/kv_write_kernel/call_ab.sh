#!/usr/bin/env bash
# call 1 of the pair: bpart00 to /tmp/b; then, random SmolLM2 weights and an untrained head, the step times of
# plain / n-gram / head at batch 1 and 8 with the KV write kernel (new) and with the code of a3157de (old), in
# this one call; the profile at batch 8 (new); the attention kernel tests natively.
T0=$(date +%s); left() { echo $(( T0 + ${BUDGET:-330} - $(date +%s) )); }
mkdir -p /tmp/b /tmp/site && cp .carry/c0/bpart00 /tmp/b/
pip install -q --no-deps --target /tmp/site .carry/whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt; date -u | tee -a $OUT/machine.txt
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r specheads /tmp/old/ && (cd /tmp/old && patch -s -R -p1 < $OLDPWD/.carry/tools/kvwrite.patch) && echo "old tree: $(grep -c kv_write_index /tmp/old/specheads/runtime/model.py) kv_write_index lines" | tee -a $OUT/machine.txt
PYTHONPATH=$PWD:/tmp/site python3 .carry/tools/random_head.py /tmp/rhead > /dev/null 2>&1
B="benchmarks/bench_runtime.py --random-weights --device cuda --cuda-graphs --batches 1,8 --new-tokens 128 --head /tmp/rhead --engines compiled --drafters ngram,head --repeat 2"
t=$(date +%s); PYTHONPATH=$PWD:/tmp/site timeout 170 python3 $B --profile --profile-all --profile-batch 8 --out $OUT/new.json > $OUT/new.txt 2>&1
echo "new rc=$? $(( $(date +%s) - t ))s" | tee -a $OUT/machine.txt; grep -E "^\| compiled" $OUT/new.txt | head -24
t=$(date +%s); PYTHONPATH=/tmp/old:/tmp/site timeout $(( $(left) - 5 )) python3 $B --out $OUT/old.json > $OUT/old.txt 2>&1
echo "old rc=$? $(( $(date +%s) - t ))s" | tee -a $OUT/machine.txt; grep -E "^\| compiled" $OUT/old.txt | head -24
[ $(left) -gt 50 ] && t=$(date +%s) && PYTHONPATH=$PWD:/tmp/site TRITON_INTERPRET=0 timeout $(( $(left) - 2 )) python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_attention.py > $OUT/attention_tests_cuda.txt 2>&1
echo "attention tests rc=$? $(( $(date +%s) - t ))s" | tee -a $OUT/machine.txt; tail -2 $OUT/attention_tests_cuda.txt
