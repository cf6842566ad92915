# The two commands of README.md. Each creates .venv on first use and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megarl-installed

.PHONY: demo test test-slow test-soak lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,nixl,math,tensorboard,bench]'
	# real SGLang as the reference of tests/conformance: pure Python, its CUDA deps left out
	$(PY) -m pip install -q --no-deps sglang==0.5.10
	# Triton for its interpreter (TRITON_INTERPRET=1: the engine's kernels on CPU tensors), beside
	# the venv's packages: on their path every megatron process would import it (~0.2 s of CPU)
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/triton-interpreter triton==3.8.0
	touch $(STAMP)

# Each Python process megarl starts (Ray workers, engines, CLIs) imports ~150 of its modules;
# where PYTHONDONTWRITEBYTECODE is set nothing caches their bytecode, so each process compiled
# them again (~0.3 s of CPU). Compiling once here is a no-op when nothing changed.
BYTECODE := $(PY) -m compileall -q megarl bridge > /dev/null

demo: $(STAMP)
	$(BYTECODE)
	$(VENV)/bin/megarl demo

# -X faulthandler: a crash of the test process prints every thread's stack. -n 2: two pytest-xdist
# workers, each running whole units of tests/xdist_units.py, costliest first; TEST_WORKERS=0
# runs the suite in this process alone.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BYTECODE)
	$(PY) -X faulthandler -m pytest -q -x -n $(TEST_WORKERS) --durations=40 tests

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow tests

# the load test of issue 10: thousands of requests against two engines under weight updates
test-soak: $(STAMP)
	$(PY) -m pytest -q -m slow -s tests/soak

lint: $(STAMP)
	$(VENV)/bin/ruff check megarl bridge tests benchmarks

clean:
	rm -rf $(VENV)
