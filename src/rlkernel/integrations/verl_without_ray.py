"""Import verl 0.9.1's loss and model code in a process without verl's distributed stack.

verl declares ray, tensordict, wandb, vLLM-era pins of transformers and more as dependencies, but its
policy losses and fused forwards need only torch, transformers, omegaconf and codetiming. Importing
any ``verl`` module still runs the package ``__init__``, which imports ``verl.protocol`` (``ray``,
``tensordict``) and, through ``verl.utils.tracking``, ``orjson``; the loss path calls none of them but
for one ``TensorDict`` (below). :func:`import_verl` imports the modules you name with stubs for those
three in ``sys.modules`` for the duration of the import only, each only where it is *not* installed,
with exactly the names the import reads (``ray.ObjectRef``, ``tensordict.TensorDict``,
``tensordict.tensorclass.NonTensorData`` / ``NonTensorStack``). ``TensorDict``'s stub is a dict with
a ``batch_size``: verl's ``bypass_mode`` loss wraps its IS weights in a ``DataProto`` (one
``TensorDict``) and reads them back, at call time, through the class ``verl.protocol`` imported.
Afterwards no stub is left in ``sys.modules`` (``importlib.util.find_spec("ray")`` keeps saying "not
installed" to other libraries); verl's modules stay imported.

What it is for: comparing rlkernel's ``rk_*`` losses and fused forward with verl's own on a CPU
(``examples/verl_policy_loss.py``, ``make verl-example``, the tests) after ``pip install --no-deps
verl==0.9.1 omegaconf codetiming``. Training with verl needs its real stack (``pip install
"rlkernel[verl]"``, Ray workers importing ``rlkernel.integrations.verl`` through ``external_lib``):
where ray and tensordict are installed nothing is stubbed and this is a plain import.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Iterator

__all__ = ["VERL_VERSION", "import_verl", "unavailable_reason"]

VERL_VERSION = "0.9.1"  # the version rlkernel.integrations.verl is tested with
INSTALL = f"pip install --no-deps verl=={VERL_VERSION} && pip install omegaconf codetiming"


def unavailable_reason() -> str | None:
    """Why verl's loss code cannot be imported here (``None``: it can), with the install command."""
    if importlib.util.find_spec("verl") is None:
        return f"verl is not installed ({INSTALL})"
    version = importlib.metadata.version("verl")
    if version != VERL_VERSION:
        return f"verl {version} is installed; rlkernel.integrations.verl is tested with {VERL_VERSION}"
    missing = [name for name in ("omegaconf", "codetiming") if importlib.util.find_spec(name) is None]
    if missing:
        return f"verl's loss path needs {' and '.join(missing)} ({INSTALL})"
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
def _import_stubs() -> Iterator[None]:
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
    """``rlkernel.integrations.verl`` imported (once per process: it registers the ``rk_*`` losses in
    verl's registry), then each of ``modules`` (verl's, e.g. ``"verl.trainer.ppo.core_algos"``), with
    the stubs in place during the imports.

    Returns:
        the modules named, in order.

    Raises:
        RuntimeError: verl 0.9.1 or its two light dependencies are not installed
            (:func:`unavailable_reason`, with the install command).
    """
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)
    with _import_stubs():
        importlib.import_module("rlkernel.integrations.verl")
        return [importlib.import_module(name) for name in modules]
