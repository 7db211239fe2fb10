# The two commands of the README:
#   make demo   set up a fresh machine (virtualenv in .venv) and run the main job, `rlkernel demo`
#   make test   set up the same way and run the whole test suite, the interpreter's tests again under
#               other CPU instruction sets (scripts/test_cpu_variants.sh), and the strict docs build
# and three more:
#   make docs          serve the documentation site on http://127.0.0.1:8000 (mkdocs)
#   make verl-example  examples/verl_policy_loss.py: rlkernel's rk_* losses next to verl 0.9.1's own,
#                      on the CPU, with verl installed without ray/tensordict/wandb (not needed there)
#   make clean         remove .venv and the run outputs
# pip prints its progress (a fresh setup downloads ~1 GB for `make test`, ~300 MB for `make demo`).
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

PIP := $(BIN)/python -m pip install --progress-bar on

.PHONY: demo test setup-demo setup-dev setup-verl verl-example docs clean

$(BIN)/python:
	@echo "==> creating the virtualenv $(VENV)"
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PIP) --upgrade pip

setup-demo: $(BIN)/python
	@echo "==> installing $(or $(TORCH_SPEC),the system torch) and rlkernel[demo] (transformers, matplotlib) into $(VENV)"
	$(PIP) $(TORCH_SPEC) -e ".[demo]"

setup-dev: $(BIN)/python
	@echo "==> installing $(or $(TORCH_SPEC),the system torch) and rlkernel[dev] into $(VENV)"
	$(PIP) $(TORCH_SPEC) -e ".[dev]"
	@echo "==> installing the frameworks the integration tests compare with: TRL, OpenRLHF, verl"
	$(PIP) $(TORCH_SPEC) $(TRL_SPEC)
	$(PIP) --no-deps $(OPENRLHF_SPEC)
	$(PIP) --no-deps $(VERL_SPEC)
	$(PIP) $(VERL_DEPS)

setup-verl: setup-demo
	@echo "==> installing $(VERL_SPEC) without its dependencies (ray, tensordict, wandb: not on the loss path)"
	$(PIP) --no-deps $(VERL_SPEC)
	$(PIP) $(VERL_DEPS)

demo: setup-demo
	@echo "==> rlkernel demo: 400 GRPO steps (~40 s on an idle 2-core CPU, minutes on a busy one; each line shows an ETA)"
	$(BIN)/rlkernel demo $(DEMO_ARGS)

verl-example: setup-verl
	$(BIN)/python examples/verl_policy_loss.py

test: setup-dev
	$(BIN)/ruff check src tests scripts examples
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
	scripts/test_cpu_variants.sh $(BIN)/python
	$(BIN)/mkdocs build --strict --quiet --site-dir $(VENV)/site

docs: setup-dev
	$(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) site runs .pytest_cache .hypothesis
