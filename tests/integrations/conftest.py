"""The frameworks' real code for the integration tests, imported without their GPU stacks.

OpenRLHF: ``make setup-dev`` installs the 0.11.2 wheel with ``pip install --no-deps`` (its declared
dependencies include deepspeed, flash-attn, vLLM and ray: CUDA builds, gigabytes). What
``openrlhf/models/loss.py`` needs to import is torch and two modules it never calls, stubbed below
for the duration of the import only. The tests skip when OpenRLHF is not installed, except under
``CI`` (set by ``.ci/run``'s callers), where a missing or wrong OpenRLHF fails them: CI must never pass
without comparing against the real code.

verl: ``make setup-dev`` installs the 0.9.1 wheel the same way (plus omegaconf and codetiming); the
``verl`` fixture imports it with import-time stubs for ray, tensordict and orjson
(tests/integrations/verl_env.py says what and why), under the same skip/fail rule.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import types
import warnings

import pytest

OPENRLHF_VERSION = "0.11.2"  # the version the Makefile installs and the integration is tested with


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"{reason}; CI must run the OpenRLHF comparison (make setup-dev installs it)")
    pytest.skip(reason)


@contextlib.contextmanager
def _without_openrlhf_gpu_stack(package_dir: str):
    """Import ``openrlhf.models.<module>`` from the installed files, with two stubs in ``sys.modules``
    while the block runs; afterwards ``sys.modules`` holds no stub and no ``openrlhf`` module (the
    imported classes keep working: their functions hold their module's globals)."""
    stubs = {}
    # openrlhf.models: the package's __init__ imports Actor and the reward-model factory, which
    # import transformers, peft, flash_attn, bitsandbytes and deepspeed at the top; loss.py uses
    # none of them. A bare package whose path is the real directory loads `openrlhf.models.loss`
    # and its `.utils` from the installed files, unchanged, without running that __init__.
    models = types.ModuleType("openrlhf.models")
    models.__path__ = [os.path.join(package_dir, "models")]
    stubs["openrlhf.models"] = models
    # deepspeed: openrlhf/models/utils.py imports it at the top for set_z3_leaf_modules (ZeRO-3 leaf
    # marking of MoE / hybrid models), which the loss never calls. Stubbed only where it is not
    # installed (a GPU machine with deepspeed imports the real one).
    if importlib.util.find_spec("deepspeed") is None:
        stubs["deepspeed"] = types.ModuleType("deepspeed")
    saved = {name: sys.modules[name] for name in stubs if name in sys.modules}
    before = set(sys.modules)
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for name in set(sys.modules) - before:
            if name.split(".")[0] == "openrlhf":
                del sys.modules[name]
        for name in stubs:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


@pytest.fixture(scope="session")
def openrlhf_policy_loss() -> type:
    """OpenRLHF's own ``openrlhf.models.loss.PolicyLoss`` class (the installed 0.11.2 wheel)."""
    spec = importlib.util.find_spec("openrlhf")
    if spec is None:
        _unavailable(f"OpenRLHF is not installed (pip install --no-deps openrlhf=={OPENRLHF_VERSION})")
    version = importlib.metadata.version("openrlhf")
    if version != OPENRLHF_VERSION:
        _unavailable(f"OpenRLHF {version} is installed; these tests compare with {OPENRLHF_VERSION}")
    with _without_openrlhf_gpu_stack(next(iter(spec.submodule_search_locations))), warnings.catch_warnings():
        # models/utils.py decorates a function with @torch.compile at import, which imports
        # torch._inductor, whose torch.utils.mkldnn warns that torch.jit.script_method is deprecated.
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module("openrlhf.models.loss")
    return module.PolicyLoss


@pytest.fixture(scope="session")
def verl() -> types.SimpleNamespace:
    """verl 0.9.1's real modules, with ``rlkernel.integrations.verl`` imported (its losses registered):
    ``core_algos`` (the registry, agg_loss and verl's own losses), ``ActorConfig`` and
    ``PolicyLossConfig`` (verl's), ``dense_common``
    (verl's fused forwards), ``monkey_patch`` and ``integration`` (tests/integrations/verl_env.py)."""
    from . import verl_env

    reason = verl_env.unavailable_reason()
    if reason is not None:
        if verl_env.in_ci():
            pytest.fail(f"{reason}; CI must run the verl comparison (make setup-dev installs it)")
        pytest.skip(reason)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        core_algos, config, dense_common, monkey_patch, integration = verl_env.import_verl(
            "verl.trainer.ppo.core_algos",
            "verl.workers.config",
            "verl.models.transformers.dense_common",
            "verl.models.transformers.monkey_patch",
            "rlkernel.integrations.verl",
        )
    return types.SimpleNamespace(
        core_algos=core_algos,
        ActorConfig=config.ActorConfig,
        PolicyLossConfig=config.PolicyLossConfig,  # verl's (the actor's nested policy_loss settings)
        dense_common=dense_common,
        monkey_patch=monkey_patch,
        integration=integration,
    )
