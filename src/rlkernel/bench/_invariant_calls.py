"""Call helpers of the ``invariant`` suite's setups: seeded inputs and forward-only or
forward + backward calls that return a :class:`~rlkernel.bench.suite.CallResult`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlkernel.bench.suite import CallResult


def randn(shape, device, gen, dtype, scale=1.0) -> torch.Tensor:
    """fp32 normal samples (``gen``), scaled, cast to ``dtype``."""
    return torch.randn(shape, device=device, generator=gen, dtype=torch.float32).mul_(scale).to(dtype)


def fwd_only(fn: Callable[[], torch.Tensor]) -> CallResult:
    """``fn()`` without autograd, as a one-value result."""
    with torch.no_grad():
        return CallResult((fn(),))


def grad_call(fn: Callable, leaves: list[tuple[torch.Tensor, ...]], grads_out: list[torch.Tensor],
               options: dict[str, Any] | None = None, keep: int | None = None):  # fmt: skip
    """``fn(*leaves[i])`` forward + backward with upstream gradient ``grads_out[i]`` (under
    ``rk.use_options(**options)``); the result keeps the first ``keep`` input gradients."""

    def call(i: int) -> CallResult:
        import rlkernel as rk

        with rk.use_options(**(options or {})):
            out = fn(*leaves[i])
            grads = torch.autograd.grad(out, leaves[i], grads_out[i])
        return CallResult((out.detach(),), tuple(grads[:keep]))

    return call
