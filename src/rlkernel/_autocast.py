"""Every public op's numbers are independent of an enclosing ``torch.autocast`` (CPU and CUDA).

Autocast rewrites eligible ops by dtype lists (``mm`` to bf16/fp16, ``log_softmax`` to fp32, ...).
Applied inside rlkernel it would, e.g., round the reference path's fp32 logits GEMM to bf16 while
the Triton path's kernels ignore autocast, so the two backends would disagree and the documented
"logits stay fp32" would be false. So the public entry points and the ``backward`` of every
``torch.autograd.Function`` run with autocast disabled (:func:`without_autocast`): their numerics
are those of their inputs' dtypes. The one deliberate exception is ``rlkernel.invariant.linear`` /
``matmul``, which first cast their inputs to the autocast dtype as ``F.linear`` does (a patched
model must run the GEMMs its unpatched self runs) and then compute with autocast disabled.

This module imports nothing from rlkernel, so the reference modules may use it too.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

_F = TypeVar("_F", bound=Callable)


def autocast_enabled() -> bool:
    """Whether CPU or CUDA autocast is on in this thread."""
    return torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")


@contextlib.contextmanager
def autocast_disabled() -> Iterator[None]:
    """CPU and CUDA autocast off for the enclosed code (the previous state is restored on exit)."""
    with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
        yield


def without_autocast(fn: _F) -> _F:
    """``fn`` run with CPU and CUDA autocast disabled; two flag reads when autocast is off."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not autocast_enabled():
            return fn(*args, **kwargs)
        with autocast_disabled():
            return fn(*args, **kwargs)

    return wrapper
