"""Import verl (and ``rlkernel.integrations.verl``) in the tests without verl's distributed stack.

``make setup-dev`` installs the verl 0.9.1 wheel with ``pip install --no-deps`` plus the two light
packages its loss path imports (omegaconf, codetiming): its declared dependencies include ray,
vLLM-era pins of transformers, tensordict, wandb and more. Importing ``verl`` runs its package
``__init__``, which imports ``verl.protocol`` — ``ray``, ``tensordict`` — and, through
``verl.utils.tracking``, ``orjson``; the policy losses and the fused forward call none of them, but
for one ``TensorDict``, below. They are stubbed in ``sys.modules`` for the duration of the import
only, each only where it is not installed, with exactly the names the import reads
(``ray.ObjectRef``, ``tensordict.TensorDict``, ``tensordict.tensorclass.NonTensorData`` /
``NonTensorStack``). ``TensorDict``'s stub is a dict with a ``batch_size``: verl's ``bypass_mode``
loss wraps its IS weights in a ``DataProto`` (one ``TensorDict``) and reads them back, at call time,
through the class ``verl.protocol`` imported. Afterwards no stub is left in ``sys.modules``
(``importlib.util.find_spec("ray")`` must keep saying "not installed" to other libraries); verl's
modules stay imported — the losses live in verl's registry, in those modules.

The verl tests skip when verl 0.9.1 is not installed, except under ``CI``, where they fail: CI must
never pass without comparing against the real code.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import types

VERL_VERSION = "0.9.1"  # the version the Makefile installs and the integration is tested with
INSTALL = f"pip install --no-deps verl=={VERL_VERSION} && pip install omegaconf codetiming"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def unavailable_reason() -> str | None:
    """Why the verl tests cannot run here (``None``: they can)."""
    if importlib.util.find_spec("verl") is None:
        return f"verl is not installed ({INSTALL})"
    version = importlib.metadata.version("verl")
    if version != VERL_VERSION:
        return f"verl {version} is installed; these tests compare with {VERL_VERSION}"
    return None


class _TensorDict(dict):
    """The one use of ``TensorDict`` on the loss path: verl's rollout-correction helper wraps its IS
    weights with ``DataProto.from_dict`` (``TensorDict(source=, batch_size=)``), and its
    ``bypass_mode`` loss reads them back by key and takes ``len`` of the wrapper (``batch_size``)."""

    def __init__(self, source=None, batch_size=None):
        super().__init__(source or {})
        self.batch_size = batch_size


def _stubs() -> dict[str, types.ModuleType]:
    stubs = {}
    if importlib.util.find_spec("ray") is None:
        ray = types.ModuleType("ray")
        ray.ObjectRef = type("ObjectRef", (), {})  # annotations and isinstance checks in verl.protocol
        stubs["ray"] = ray
    if importlib.util.find_spec("tensordict") is None:
        tensordict = types.ModuleType("tensordict")
        tensordict.__path__ = []
        tensordict.TensorDict = _TensorDict
        tensorclass = types.ModuleType("tensordict.tensorclass")
        tensorclass.NonTensorData = type("NonTensorData", (), {})
        tensorclass.NonTensorStack = type("NonTensorStack", (), {})
        tensordict.tensorclass = tensorclass
        stubs["tensordict"], stubs["tensordict.tensorclass"] = tensordict, tensorclass
    if importlib.util.find_spec("orjson") is None:
        stubs["orjson"] = types.ModuleType("orjson")  # verl.utils.tracking's JSONL writer, never called
    return stubs


@contextlib.contextmanager
def _verl_import_stubs():
    stubs = _stubs()
    saved = {name: sys.modules[name] for name in stubs if name in sys.modules}
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for name in stubs:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def import_verl(*modules: str) -> list[types.ModuleType]:
    """``rlkernel.integrations.verl`` imported (once per process), then each of ``modules`` (verl's,
    e.g. ``"verl.trainer.ppo.core_algos"``), with the stubs in place during the imports.

    Raises:
        RuntimeError: verl 0.9.1 cannot be used here (:func:`unavailable_reason`).
    """
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    with _verl_import_stubs():
        importlib.import_module("rlkernel.integrations.verl")
        return [importlib.import_module(name) for name in modules]
