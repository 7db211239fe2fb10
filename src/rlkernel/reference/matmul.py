"""Reference batch-invariant GEMM: ``matmul(a, b)`` and ``linear(x, weight, bias)`` in readable PyTorch.

This is the CPU backend of :mod:`rlkernel.invariant.matmul` and the oracle of its tests.

Math: ``out[m, n] = Σ_k a[m, k]·b[k, n]`` (``linear``: ``b = weight.T``, plus ``bias[n]``), computed
in fp32 (fp64 for fp64 inputs) and rounded once to the input dtype.

Batch invariance by construction. A library GEMM (MKL, oneDNN, OpenBLAS) picks its kernel and its
K-blocking from the shape, so the bits of row ``m`` can change with the number of rows M (M = 1
typically takes a GEMV path). Here every row is computed by the *same* call: a ``[1, K] @ [K, N]``
product on a freshly allocated (so equally aligned) copy of the row, whatever M is. Row ``m``'s
result therefore depends only on its own values, ``b`` and the process's thread count. It costs one
GEMV launch per row: fine for the tiny models this path serves (tests, ``rlkernel consistency`` on
CPU), far too slow for real sizes, which run the Triton kernel.

Caveats:
    * Bits depend on the BLAS library and the thread count (``torch.get_num_threads()``): invariant
      within one process, not across machines.
    * Not bitwise equal to the Triton kernel (different summation order); both are within the
      accuracy contract of the fp32 result.
"""

from __future__ import annotations

import torch


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rowwise_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D ``a [M, K]``, ``b [K, N]`` of one dtype, one fixed-shape GEMV per row.

    Every row goes through an identical ``[1, K] @ [K, N]`` call on an aligned copy, so its result
    is bitwise independent of M and of the row's position (batch invariance by construction)."""
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    for i in range(m):
        row = a[i : i + 1].clone(memory_format=torch.contiguous_format)  # fresh, aligned storage
        out[i : i + 1] = torch.mm(row, b)
    return out


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with fp32 accumulation, batch invariant.

    Args:
        a: ``[..., K]`` float tensor (leading dims are rows).
        b: ``[K, N]`` tensor of ``a``'s dtype.

    Returns:
        ``[..., N]`` in ``a``'s dtype.
    """
    acc = _acc_dtype(a.dtype)
    a2 = a.reshape(a.shape[:-1].numel(), a.shape[-1]).to(acc)  # rows by count: K may be 0
    out = rowwise_mm(a2, b.to(acc))
    return out.to(a.dtype).reshape(*a.shape[:-1], b.shape[1])


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` with fp32 accumulation (bias added before the one rounding), batch
    invariant.

    Args:
        x: ``[..., K]`` float tensor.
        weight: ``[N, K]`` (as in ``nn.Linear``), ``x``'s dtype.
        bias: optional ``[N]``.
        out_dtype: the output dtype (None: ``x``'s). ``torch.float32`` for half inputs returns the
            fp32 accumulator itself, without the rounding to 16 bits (an LM head's fp32 logits).

    Returns:
        ``[..., N]`` in ``out_dtype`` (``x``'s dtype by default).
    """
    acc = _acc_dtype(x.dtype)
    x2 = x.reshape(x.shape[:-1].numel(), x.shape[-1]).to(acc)  # rows by count: K may be 0
    out = rowwise_mm(x2, weight.to(acc).t())
    if bias is not None:
        out = out + bias.to(acc)
    return out.to(out_dtype or x.dtype).reshape(*x.shape[:-1], weight.shape[0])
