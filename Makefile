# The two set-up commands of the README. Both build .venv from scratch when it is missing or stale.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

.PHONY: install test demo bench clean
install: $(VENV)/.installed

LINTED := hf_packing tests recipes benchmarks

test: $(VENV)/.installed
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(PY) -m pytest -q

demo: $(VENV)/.installed
	$(VENV)/bin/hf-packing demo --output-dir demo_out

bench: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[dev,bench]"
	$(PY) benchmarks/bench_packing.py
	$(PY) benchmarks/bench_step_cpu.py

clean:
	rm -rf $(VENV) demo_out .pytest_cache
