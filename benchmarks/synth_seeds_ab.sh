#!/usr/bin/env bash
# Two seed files, one synthesis each, same recipe and seed: near-duplicate rates side by side (issue 12).
#   bash benchmarks/synth_seeds_ab.sh OLD_SEEDS.yaml [NEW_SEEDS (default builtin:synthesize_seeds)]
# e.g. OLD_SEEDS from `git show 15bc370:specheads/assets/synthesize_seeds.yaml > /tmp/old.yaml`.
# The demo recipe on the CPU: the open-ended categories (chat, qa, code, writing), no copy-heavy tasks,
# N prompts (default 400) of at most 64 tokens; writes $OUT/{old,new} (default /tmp/seeds_ab) and prints
# each run's summary line and where its duplicates came from (benchmarks/synth_duplicates.py).
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=${1:?usage: synth_seeds_ab.sh OLD_SEEDS.yaml [NEW_SEEDS]}; NEW=${2:-builtin:synthesize_seeds}
OUT=${OUT:-/tmp/seeds_ab}; N=${N:-400}; PY=${PY:-.venv/bin/python}
for v in old new; do
  seeds=$OLD; [ $v = new ] && seeds=$NEW
  $PY -m specheads.cli data synthesize recipes/smollm2_eagle3.yaml run_dir=$OUT/$v target.device=cpu \
    data.synthesize.seeds=$seeds data.synthesize.num_prompts=$N data.synthesize.batch_size=64 \
    data.synthesize.copy_tasks.fraction=0 data.synthesize.categories.math.weight=0 \
    data.synthesize.categories.reasoning.weight=0 data.synthesize.max_new_tokens=64 2>&1 | grep "^synthesized "
  $PY benchmarks/synth_duplicates.py $OUT/$v/data/synthesized.jsonl --seeds $seeds --top 6 \
    --out $OUT/$v/duplicates.json
done
