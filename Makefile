# twophase — set-up, tests, server. Every target creates what it needs on a fresh machine.
VENV      ?= .venv
PYTHON    ?= python3
PY        := $(VENV)/bin/python
TWOPHASE  := $(VENV)/bin/twophase
MODEL     ?= smollm2-135m-instruct
HOST      ?= 127.0.0.1
PORT      ?= 8000
# CPU machines take the CPU build of torch that pip finds locally; with a GPU, any torch >= 2.5.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.5' || echo 'torch==2.13.0')
PYTEST_ARGS ?=

.PHONY: setup model test test-all serve generate bench bench-compare clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q '$(TORCH_SPEC)'
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# our C++ CPU kernels, compiled once into $$TWOPHASE_HOME/extensions (the engine falls back to plain torch without them)
$(VENV)/.kernels: $(VENV)/.installed $(wildcard src/twophase/model/ops/csrc/*)
	$(PY) -m twophase.model.ops.extension
	touch $@

# the package's bytecode, written ahead: where PYTHONDONTWRITEBYTECODE is set, every start would otherwise compile
# every twophase module again (~0.25 s of `twophase generate`'s 3.5-4 s on a 2-core machine)
$(VENV)/.bytecode: $(VENV)/.installed $(shell find src/twophase -name '*.py')
	$(PY) -m compileall -q src/twophase
	touch $@

setup: $(VENV)/.installed $(VENV)/.kernels $(VENV)/.bytecode

model: setup
	$(TWOPHASE) pull $(MODEL)

test: setup model
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-all: setup model
	$(PY) -m pytest -q -m '' $(PYTEST_ARGS)

serve: setup model
	$(TWOPHASE) serve --model $(MODEL) --host $(HOST) --port $(PORT)

generate: setup model
	$(TWOPHASE) generate --model $(MODEL) --temperature 0 "What is the capital of France?"

bench: setup model
	$(PY) benchmarks/bench_engine.py --model $(MODEL)

# twophase vs llama.cpp vs vLLM CPU, one table; builds / installs the peers under $TWOPHASE_HOME/peers on first use.
# e.g. make bench-compare COMPARE_ARGS='--quick'   or   COMPARE_ARGS='--only llamacpp --precisions f32,bf16,q8_0,q4_1'
bench-compare: setup model
	$(PY) benchmarks/compare.py --model $(MODEL) --install $(COMPARE_ARGS)

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
