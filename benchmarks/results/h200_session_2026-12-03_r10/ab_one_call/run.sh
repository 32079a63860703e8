#!/usr/bin/env bash
# The third call of the sitting (H200, 2026-12-03 ~18:50 UTC), as sent: the attention kernel tests natively, then the
# same bench_runtime command on the code of a3157de (old, rebuilt from the tree by reversing kvwrite.patch) and on
# the KV write kernel (new). Each run had 150 s; the old one finished batch 1 only (its batch-8 compilation ran past).
T0=$(date +%s); mkdir -p /tmp/site; pip install -q --no-deps --target /tmp/site .carry/whl/*.whl
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r specheads /tmp/old/ && (cd /tmp/old && patch -s -R -p1 < $OLDPWD/.carry/tools/kvwrite.patch)
PYTHONPATH=$PWD:/tmp/site python3 .carry/tools/random_head.py /tmp/rhead
B="benchmarks/bench_runtime.py --random-weights --device cuda --cuda-graphs --batches 1,8 --new-tokens 128 --head /tmp/rhead --engines compiled --drafters ngram,head --repeat 2"
PYTHONPATH=$PWD:/tmp/site TRITON_INTERPRET=0 timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_attention.py > $OUT/attention_tests_cuda.txt 2>&1
for v in old new; do P=$PWD; [ $v = old ] && P=/tmp/old
  PYTHONPATH=$P:/tmp/site timeout 150 python3 $B --out $OUT/ab_$v.json > $OUT/ab_$v.txt 2>&1; done
# (today the same measurement needs no head file: bench_runtime.py --random-weights --random-head ...)
