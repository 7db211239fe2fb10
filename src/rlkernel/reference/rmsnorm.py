"""Reference RMSNorm in the HF Qwen3/Llama cast order, batch invariant by construction.

This is the CPU backend of :func:`rlkernel.invariant.rms_norm` and the oracle of its tests.

HF ``Qwen3RMSNorm`` / ``LlamaRMSNorm`` forward::

    input_dtype = x.dtype
    x = x.to(float32)
    var = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(var + eps)
    return weight * x.to(input_dtype)

This module follows that cast order step by step, with two deliberate, documented differences that
make every backend give the *same bits*:

1. The sum of squares is a fixed pairwise tree (:func:`pairwise_sum_last`): the row is zero-padded
   to the next power of two and adjacent pairs are added level by level. That order depends only on
   the hidden size, never on the number of rows or the threading of ``torch.mean`` (batch invariance
   by construction), and it is exactly the order of the Triton kernel's ``_pairwise_sum_rows``.
2. The scale is ``1 / sqrt(var + eps)`` with correctly rounded division and sqrt (``_ieee``)
   instead of ``rsqrt``, whose last bits differ between CPU, CUDA and Triton (``rsqrt.approx``).

So this reference and the Triton kernel agree bitwise on the forward (both are IEEE fp32 step by
step), and either differs from HF's own module (another summation order, ``rsqrt``) by a few ulps
of the fp32 scale, i.e. at most one rounding step of the output dtype (checked in the tests).

Backward (x̂ = x·r, r = 1/sqrt(mean(x²) + eps), g = dy·w in fp32, H the hidden size)::

    dx      = r·(g − x̂·Σ_j(g_j·x̂_j)/H)
    dweight = Σ_rows dy·cast(x̂)          (cast(x̂): x̂ rounded to x's dtype, as the forward uses it)

Caveats:
    * fp64 inputs are computed in fp64 (the "fp32" steps become fp64).
    * The tree costs log2(H) elementwise passes over the row: fine for the CPU path and the oracle.
"""

from __future__ import annotations

import torch


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def pairwise_sum_last(x: torch.Tensor) -> torch.Tensor:
    """Σ over the last dim in a fixed pairwise order: zero-pad to a power of two, then add adjacent
    pairs level by level (``x[..., 0::2] + x[..., 1::2]``). Returns ``[..., 1]``."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x


def _ieee(op, *args: torch.Tensor) -> torch.Tensor:
    """``op`` correctly rounded in fp32: computed in fp64, rounded once. For +, /, sqrt of fp32
    values that equals the IEEE fp32 result (fp64 has more than 2·24 + 2 bits, so the double
    rounding is innocuous), whatever the backend: PyTorch's CPU ``sqrt`` (SLEEF, < 1 ulp) is not
    always correctly rounded, the Triton kernel's ``sqrt_rn``/``div_rn`` are."""
    if args[0].dtype == torch.float64:
        return op(*args)
    return op(*(a.double() for a in args)).float()


def inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``r = 1 / sqrt(Σ x² / H + eps)`` per row, ``[..., 1]``, in the accumulation dtype, every
    step IEEE (correctly rounded), the sum in the fixed pairwise order."""
    xf = x.to(_acc_dtype(x.dtype))
    total = pairwise_sum_last(xf * xf)
    var = _ieee(torch.div, total, torch.full_like(total, x.shape[-1]))
    shifted = var + eps  # one fp32 add: IEEE on every backend
    return _ieee(torch.div, torch.ones_like(var), _ieee(torch.sqrt, shifted))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``weight * (x.float() * r).to(x.dtype)``, r = 1/sqrt(mean(x²) + eps) (HF cast order).

    Args:
        x: ``[..., H]`` float tensor.
        weight: ``[H]``.
        eps: added to the mean of squares.

    Returns:
        ``[..., H]`` in ``promote_types(weight.dtype, x.dtype)`` (as HF's ``weight * x``).
    """
    xf = x.to(_acc_dtype(x.dtype))
    x_hat = xf * inv_rms(x, eps)
    return weight * x_hat.to(x.dtype)


def rms_norm_hf(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF's ``Qwen3RMSNorm.forward`` verbatim (``torch.mean``, ``torch.rsqrt``): for comparisons."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def rms_norm_backward(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)`` of :func:`rms_norm` by the closed form in the module header, in fp32
    (fp64 for fp64); ``dx`` in ``x``'s dtype, ``dweight`` in ``weight``'s dtype."""
    acc = _acc_dtype(x.dtype)
    h = x.shape[-1]
    xf = x.to(acc).reshape(x.shape[:-1].numel(), h)
    dy = grad_out.to(acc).reshape(x.shape[:-1].numel(), h)
    r = inv_rms(xf, eps)
    x_hat = xf * r
    g = dy * weight.to(acc)
    dot = (g * x_hat).sum(-1, keepdim=True)
    dx = r * (g - x_hat * (dot / h))
    dweight = (dy * x_hat.to(x.dtype).to(acc)).sum(0)
    return dx.to(x.dtype).reshape(x.shape), dweight.to(weight.dtype)
