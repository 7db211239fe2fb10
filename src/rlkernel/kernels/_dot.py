"""``dot``: the tile product of every kernel, with a machine-independent order in the CPU interpreter.

Compiled (GPU), ``dot`` is ``tl.dot``: the tensor cores fix the order of each output's sum for a
given tile configuration, which is what the batch-invariance contract relies on.

Under ``TRITON_INTERPRET=1`` (CI, CPU tests) Triton's ``tl.dot`` is one ``numpy.matmul``. For fp32
that is a BLAS call, and BLAS chooses its kernel, its K blocking and so its rounding points from
the CPU model (AVX-512 or not, Intel or AMD, ``OPENBLAS_CORETYPE``), the shape and the memory
alignment of the operands: the bits of a row change with the number of rows in the tile or with
the offset of a slice, on one machine and not on another. (For 16-bit tiles the interpreter's
``tl.dot`` is worse: it returned garbage in Triton 3.9.) So in the interpreter ``dot`` computes the
product itself, with every rounding point fixed by the tile's K alone:

    acc + a @ b  =  ((acc + c_0) + c_1) + … ,   c_j = Σ_{k in chunk j} a[m, k]·b[k, n]  (16-wide chunks)

where each product is rounded once to fp32 (exact for 16-bit inputs) and each chunk is summed as a
pairwise tree (four rounds of adding pairs, so no reduction order is left for numpy to choose). The
chunks are k16 steps in increasing k, as the tensor cores take them, so tiles of different
``BLOCK_K`` (multiples of 16) agree bitwise, and an output element depends on its own row of ``a``
and column of ``b`` only: not on ``BLOCK_M``/``BLOCK_N``, the other rows, or alignment.

Launchers pass ``INTERPRETED=<the operands are on the CPU>`` (the interpreter is the only way a
kernel sees CPU tensors). The flag is a constexpr, so the compiled kernels contain ``tl.dot`` alone:
``python -m rlkernel._sm90_compile --digest`` shows their PTX is the same as with a bare
``tl.dot``.

Caveats:
    * The interpreter's bits are not the GPU's (different order; both within the accuracy
      contract). Tests compare the interpreter with itself, never with a GPU run.
    * K of a tile must be a multiple of 16 (it is for every kernel: ``tl.dot`` needs K ≥ 16 and
      our tiles are powers of two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def interpreted(t: torch.Tensor) -> bool:
    """The ``INTERPRETED`` flag of a launch whose operand is ``t``: kernels see CPU tensors only in
    the interpreter."""
    return t.is_cpu


@triton.jit
def _interpreted_dot(a, b, acc):
    """``acc + a @ b`` in fp32 with the order of the module docstring (interpreter only)."""
    BM: tl.constexpr = a.shape[0]
    BK: tl.constexpr = a.shape[1]
    BN: tl.constexpr = b.shape[1]
    tl.static_assert(BK % 16 == 0, "the tile's K must be a multiple of 16")
    C: tl.constexpr = BK // 16
    a3 = tl.reshape(a.to(tl.float32), (BM, C, 16))
    b3 = tl.reshape(b.to(tl.float32), (C, 16, BN))
    chunk = tl.arange(0, C)
    for c in tl.static_range(C):
        # Chunk c's 16 columns of a and rows of b (the other chunks are replaced by exact zeros).
        a16 = tl.sum(tl.where(chunk[None, :, None] == c, a3, 0.0), axis=1)
        b16 = tl.sum(tl.where(chunk[:, None, None] == c, b3, 0.0), axis=0)
        prods = tl.reshape(a16, (BM, 16, 1)) * tl.reshape(b16, (1, 16, BN))  # each rounded once
        # Pairwise tree over the 16 products: a sum of two has one rounding, whatever the order.
        part = tl.sum(tl.reshape(prods, (BM, 8, 2, BN)), axis=2)
        part = tl.sum(tl.reshape(part, (BM, 4, 2, BN)), axis=2)
        part = tl.sum(tl.reshape(part, (BM, 2, 2, BN)), axis=2)
        part = tl.sum(tl.reshape(part, (BM, 1, 2, BN)), axis=2)
        acc = acc + tl.reshape(part, (BM, BN))
    return acc


@triton.jit
def dot(a, b, acc, INPUT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """``acc + a @ b``: ``a [M, K]``, ``b [K, N]`` tiles of one dtype, ``acc [M, N]`` fp32 or None
    (zeros).

    ``tl.dot`` when compiled; the machine-independent product of the module docstring when
    ``INTERPRETED``. ``INPUT_PRECISION`` is ``tl.dot``'s (fp32 inputs: "ieee" or "tf32")."""
    if INTERPRETED:
        if acc is None:
            acc = tl.zeros((a.shape[0], b.shape[1]), tl.float32)
        acc = _interpreted_dot(a, b, acc)
    else:
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    return acc
