"""Batch-invariant RMSNorm in the HF Qwen3/Llama cast order, with a deterministic backward.

``rms_norm(x, weight, eps)`` serves the hidden-state norms and Qwen3's per-head QK-norm (``x`` of
shape ``[..., heads, head_dim]`` normalized over ``head_dim``).

Backends (``rlkernel._dispatch``): the Triton kernels of :mod:`rlkernel.kernels.rmsnorm` on CUDA for
fp16/bf16/fp32; :mod:`rlkernel.reference.rmsnorm` on CPU and for fp64. Both compute the sum of
squares in the same fixed pairwise order and the scale with IEEE sqrt and division, so they agree
bitwise on the forward, and every row is independent of the others (batch invariant by
construction). See the reference module for the exact formula and how it relates to HF's.

Backward: ``dx`` per row; ``dweight`` by a two-stage reduction (per-program fp32 partials over fixed
row ranges, then one fixed-order sum): deterministic, no atomics.

Caveats:
    * The output dtype is ``promote_types(weight.dtype, x.dtype)``, as HF's ``weight * x``.
    * The CPU reference backward goes through autograd on the reference (deterministic on CPU).
"""

from __future__ import annotations

import math

import torch

from rlkernel import _dispatch
from rlkernel import _validate as check
from rlkernel._autocast import without_autocast
from rlkernel.reference import rmsnorm as ref

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ------------------------------------------------------------------------------------ custom ops
@torch.library.custom_op("rlkernel::invariant_rms_norm_fwd", mutates_args=())
def _fwd_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [M, H], rstd [M] fp32)`` for 2-D contiguous ``x``."""
    from rlkernel.kernels import rmsnorm as kernels

    return kernels.rms_norm_fwd(x, weight, eps)


@_fwd_op.register_fake
def _(x, weight, eps):
    out = x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))
    return out, x.new_empty(x.shape[:1], dtype=torch.float32)


@torch.library.custom_op("rlkernel::invariant_rms_norm_bwd", mutates_args=())
def _bwd_op(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)``; deterministic two-stage ``dweight``."""
    from rlkernel.kernels import rmsnorm as kernels

    return kernels.rms_norm_bwd(grad_out, x, weight, rstd)


@_bwd_op.register_fake
def _(grad_out, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        out, rstd = _dispatch.call_op(_fwd_op, x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    @without_autocast
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = _dispatch.call_op(_bwd_op, grad_out.contiguous(), x, weight, rstd)
        return dx, dweight, None


# ---------------------------------------------------------------------------------------- public
@without_autocast
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Batch-invariant RMSNorm, HF cast order: ``weight * (x.float() * r).to(x.dtype)``,
    ``r = 1 / sqrt(mean(x.float()**2, -1) + eps)``. Differentiable in ``x`` and ``weight``.

    Args:
        x: ``[..., H]`` float16/bfloat16/float32/float64, normalized over the last dim.
        weight: ``[H]`` float, same device.
        eps: ``> 0``, added to the mean of squares.

    Returns:
        ``[..., H]`` in ``promote_types(weight.dtype, x.dtype)``.

    Raises:
        TypeError: non-float inputs, eps not a number.
        ValueError: weight not ``[H]``, devices differ, eps <= 0, H == 0.
    """
    if not _accepted(x, weight, eps):  # the full checks (they raise) only off the common path
        check.float_tensor("x", x, min_dim=1)
        check.float_tensor("weight", weight)
        check.same_shape("weight", weight, "x.shape[-1:]", x.shape[-1:])
        check.same_device("weight", weight, "x", x.device)
        eps = check.positive_float("eps", eps)
        if x.shape[-1] < 1:
            raise ValueError(f"x must have a hidden dimension >= 1, got {check.describe(x)}")
    has_kernel = x.dtype in KERNEL_DTYPES and weight.dtype in KERNEL_DTYPES
    backend = _dispatch.resolve_backend(x.device, has_kernel=has_kernel)
    if backend != "triton":
        return ref.rms_norm(x, weight, eps)
    wants_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if not wants_grad and x.is_contiguous() and weight.is_contiguous() and not torch.compiler.is_compiling():
        # No gradient wanted (a rollout / decode step): the kernel on x as it is, no views.
        from rlkernel.kernels import rmsnorm as kernels

        return kernels.rms_norm_forward(x, weight, float(eps))
    x2 = x.reshape(x.shape[:-1].numel(), x.shape[-1]).contiguous()
    if wants_grad:
        out = _RMSNormFunction.apply(x2, weight.contiguous(), eps)
    else:
        out = _dispatch.call_op(_fwd_op, x2, weight.contiguous(), eps)[0]
    return out.reshape(x.shape)


def _accepted(x: object, weight: object, eps: object) -> bool:
    """True when every check of :func:`rms_norm` passes (a few attribute reads; the common case)."""
    return (
        isinstance(x, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and type(eps) is float
        and 0.0 < eps < math.inf
        and x.dtype in check.FLOAT_DTYPES
        and weight.dtype in check.FLOAT_DTYPES
        and weight.dim() == 1
        and x.dim() >= 1
        and weight.shape[0] == x.shape[-1] >= 1
        and x.device == weight.device
    )
