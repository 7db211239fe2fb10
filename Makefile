# The two commands of the README:
#   make demo   set up a fresh machine (virtualenv in .venv) and run the main job, `rlkernel demo`
#   make test   set up the same way and run the whole test suite, the interpreter's tests again under
#               other CPU instruction sets (scripts/test_cpu_variants.sh), and the strict docs build
#
# On CPU machines torch is pinned to the CPU build 2.13.0 (an unpinned torch pulls the multi-GB
# CUDA build). On a GPU machine that already has torch, reuse it: make demo TORCH_SPEC= VENV_FLAGS=--system-site-packages

PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
# OpenRLHF's real PolicyLoss is the reference of tests/integrations (rlkernel.integrations.openrlhf is
# tested against this version). Installed alone (--no-deps): its declared dependencies are deepspeed,
# flash-attn, vLLM, ray and a pinned transformers, and its loss module needs only torch (the tests
# stub the two imports it never calls, tests/integrations/conftest.py). The wheel also installs a
# top-level `tests` package of its own; nothing here imports `tests`.
OPENRLHF_SPEC ?= openrlhf==0.11.2
# verl's real policy losses and fused forward are the reference of tests/integrations/test_verl*.py
# (rlkernel.integrations.verl is tested against this version). Installed alone (--no-deps): its
# declared dependencies are ray, tensordict, wandb, a transformers pin and more; its losses and fused
# forward need only torch, transformers and the two light packages below (the tests stub ray,
# tensordict and orjson for the import of verl's package, tests/integrations/verl_env.py).
VERL_SPEC   ?= verl==0.9.1
VERL_DEPS   ?= omegaconf codetiming
# TRL's own GRPOTrainer is the reference of tests/integrations/test_trl_*.py (rlkernel.integrations.trl
# is tested against this version). Installed with its dependencies (transformers, accelerate, datasets)
# next to the torch pin, so that pip keeps the CPU torch.
TRL_SPEC    ?= trl==1.16.0
VENV_FLAGS  ?=
DEMO_ARGS   ?=
PYTEST_ARGS ?=

BIN := $(VENV)/bin

.PHONY: demo test setup-demo setup-dev docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

setup-demo: $(BIN)/python
	$(BIN)/python -m pip install -q $(TORCH_SPEC) -e ".[demo]"

setup-dev: $(BIN)/python
	$(BIN)/python -m pip install -q $(TORCH_SPEC) -e ".[dev]"
	$(BIN)/python -m pip install -q $(TORCH_SPEC) $(TRL_SPEC)
	$(BIN)/python -m pip install -q --no-deps $(OPENRLHF_SPEC)
	$(BIN)/python -m pip install -q --no-deps $(VERL_SPEC)
	$(BIN)/python -m pip install -q $(VERL_DEPS)

demo: setup-demo
	$(BIN)/rlkernel demo $(DEMO_ARGS)

test: setup-dev
	$(BIN)/ruff check src tests scripts examples
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
	scripts/test_cpu_variants.sh $(BIN)/python
	$(BIN)/mkdocs build --strict --quiet --site-dir $(VENV)/site

docs: setup-dev
	$(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) site runs .pytest_cache .hypothesis
