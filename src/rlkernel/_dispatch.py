"""Backend choice per call: ``"auto"`` | ``"triton"`` | ``"reference"``.

Every public primitive asks :func:`resolve_backend` which implementation to run. The answer comes
from, in order: the innermost :func:`use_backend` context, the ``RLKERNEL_BACKEND`` environment
variable (read at call time, never at import), then ``"auto"``.

- ``auto``: Triton kernels for CUDA/ROCm tensors when Triton imports and a kernel exists for the op;
  the PyTorch reference otherwise (CPU tensors, no Triton, an op without a kernel yet).
- ``triton``: force the kernels. On CPU tensors this works only under ``TRITON_INTERPRET=1`` (that is
  how the test-suite exercises kernels on machines without a GPU); otherwise it raises.
- ``reference``: always the readable PyTorch path in :mod:`rlkernel.reference`.

An op with no kernel registered falls back to the reference under every mode, with no error, so
kernels can land op by op without changing any public signature.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Literal

import torch

Backend = Literal["auto", "triton", "reference"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "reference")
ENV_VAR = "RLKERNEL_BACKEND"

_local = threading.local()


def _check_backend(name: object, source: str) -> str:
    if not isinstance(name, str) or name.strip().lower() not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS}, got {name!r}")
    return name.strip().lower()


def requested_backend() -> str:
    """The backend asked for right now (context override, else env var, else ``"auto"``)."""
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    env = os.environ.get(ENV_VAR)
    if not env:  # unset or empty: the common case, no parsing (every op asks, per call)
        return "auto"
    return _check_backend(env, f"environment variable {ENV_VAR}")


@contextlib.contextmanager
def use_backend(name: Backend) -> Iterator[None]:
    """Run the enclosed calls with backend ``name`` (thread-local; nests; restored on exit).

    A block that ends out of order (two generators each holding a block across a ``yield``) removes
    its own entry, not the innermost one: the backend in force is always that of the innermost
    block still open."""
    name = _check_backend(name, "backend")
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
        _local.keys = []
    key = object()  # this block's identity (the names repeat)
    stack.append(name)
    _local.keys.append(key)
    try:
        yield
    finally:
        at = _local.keys.index(key)
        del stack[at], _local.keys[at]


def interpreter_enabled() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_triton_importable: bool | None = None


def triton_available() -> bool:
    """Whether ``import triton`` works. Cached in a module global (not ``lru_cache``, which
    ``torch.compile`` warns about when it traces through the dispatch)."""
    global _triton_importable
    if _triton_importable is None:
        try:
            import triton  # noqa: F401

            _triton_importable = True
        except Exception:
            _triton_importable = False
    return _triton_importable


def _kernel_can_run_on(device: torch.device) -> bool:
    if device.type == "cuda":  # also ROCm builds, which report "cuda"
        return True
    return device.type == "cpu" and interpreter_enabled()


def resolve_backend(device: torch.device, *, has_kernel: bool) -> str:
    """Pick ``"triton"`` or ``"reference"`` for an op on ``device``.

    Args:
        device: the device of the op's main input.
        has_kernel: whether a Triton kernel exists for this op.

    Raises:
        ValueError: ``triton`` was forced where kernels cannot run (no Triton, or a CPU tensor
            without ``TRITON_INTERPRET=1``).
    """
    mode = requested_backend()
    if mode == "reference" or not has_kernel:
        return "reference"
    if mode == "auto":
        if device.type == "cuda" and triton_available():
            return "triton"
        return "reference"
    # mode == "triton": forced
    if not triton_available():
        raise ValueError(f"{ENV_VAR}=triton but Triton cannot be imported; install rlkernel[triton]")
    if not _kernel_can_run_on(device):
        raise ValueError(
            f"{ENV_VAR}=triton needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors; "
            f"got a tensor on {device}"
        )
    return "triton"


def call_op(op, *args):
    """Run a ``torch.library.custom_op`` ``op``: in eager code its Python body directly (the
    dispatcher costs host time per call, and a decode step is host bound); under ``torch.compile``
    the registered op, so the trace sees it instead of breaking at a Triton launch."""
    return op(*args) if torch.compiler.is_compiling() else op._init_fn(*args)
