# The set-up commands of the README. test, demo and bench build .venv from scratch when it is missing or stale;
# gpu-wheels and gpu are for a GPU machine without network (benchmarks/gpu_check.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

.PHONY: install test demo bench gpu-wheels gpu clean
install: $(VENV)/.installed

LINTED := hf_packing tests recipes benchmarks

test: $(VENV)/.installed
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy
	$(PY) -m pytest -q --durations=15

demo: $(VENV)/.installed
	$(VENV)/bin/hf-packing demo --output-dir demo_out

bench: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[dev,bench]"
	$(PY) benchmarks/bench_packing.py
	$(PY) benchmarks/bench_step_cpu.py

# GPU check in one command (benchmarks/gpu_check.sh). Here, with network: the wheels the GPU machine lacks (its
# image has torch, transformers, accelerate, peft, pyarrow, pandas, ...; not datasets and what datasets needs), pinned
# to the versions .venv is tested with, for CPython 3.12 on x86-64. There, without network: `make gpu` (no .venv).
GPU_WHEELS := datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 liger-kernel==0.8.5
gpu-wheels:
	rm -rf .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)
	du -sh .whl

gpu:
	bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) demo_out gpu_out .pytest_cache
