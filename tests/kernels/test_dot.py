"""The interpreter's ``dot`` (kernels/_dot.py): the documented order, bit for bit, on any CPU.

``tl.dot`` in the CPU interpreter is a numpy matmul whose BLAS kernel (and so the bits) depends on
the CPU model, the tile shape and the alignment; ``dot`` with ``INTERPRETED`` must not. These tests
compare it with the order written out in torch (products rounded to fp32, a pairwise tree over each
16-wide chunk, chunks added in increasing k), which involves no BLAS at all, so they fail on any
machine if the kernel's order changes, and they run again under other BLAS core types in
``make test`` (scripts/test_cpu_variants.sh).
"""

from __future__ import annotations

import zlib

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from rlkernel.kernels._dot import dot  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's product (CPU only)")


@triton.jit
def _dot_tile_kernel(
    c_ptr,
    a_ptr,
    b_ptr,
    acc_ptr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    BN: tl.constexpr,
    HAS_ACC: tl.constexpr,
):
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    offs_n = tl.arange(0, BN)
    a = tl.load(a_ptr + offs_m[:, None] * BK + offs_k[None, :])
    b = tl.load(b_ptr + offs_k[:, None] * BN + offs_n[None, :])
    if HAS_ACC:
        acc = tl.load(acc_ptr + offs_m[:, None] * BN + offs_n[None, :])
        out = dot(a, b, acc, "ieee", True)
    else:
        out = dot(a, b, None, "ieee", True)
    tl.store(c_ptr + offs_m[:, None] * BN + offs_n[None, :], out)


def _kernel_dot(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None) -> torch.Tensor:
    (bm, bk), bn = a.shape, b.shape[1]
    out = torch.empty(bm, bn, dtype=torch.float32)
    _dot_tile_kernel[(1,)](out, a, b, acc if acc is not None else out, bm, bk, bn, acc is not None)
    return out


def _documented_order(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None) -> torch.Tensor:
    """The order of kernels/_dot.py written out with elementwise fp32 torch ops only (no BLAS)."""
    a32, b32 = a.float(), b.float()
    out = torch.zeros(a.shape[0], b.shape[1]) if acc is None else acc.clone()
    for c0 in range(0, a.shape[1], 16):
        terms = [a32[:, k, None] * b32[None, k, :] for k in range(c0, c0 + 16)]  # each rounded once
        while len(terms) > 1:
            terms = [terms[i] + terms[i + 1] for i in range(0, len(terms), 2)]
        out = out + terms[0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(16, 16, 16), (32, 64, 16), (16, 128, 32)])
@pytest.mark.parametrize("with_acc", [False, True])
def test_dot_follows_the_documented_order_bitwise(dtype, shape, with_acc):
    g = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{shape}{with_acc}".encode()))
    bm, bk, bn = shape
    a = torch.randn(bm, bk, generator=g).to(dtype)
    b = torch.randn(bk, bn, generator=g).to(dtype)
    acc = torch.randn(bm, bn, generator=g) * 4 if with_acc else None
    got = _kernel_dot(a, b, acc)
    want = _documented_order(a, b, acc)
    assert torch.equal(got, want)
    # the order is a real constraint: a plain sequential sum over k gives other bits for these inputs
    if bk > 16:
        sequential = acc.clone() if acc is not None else torch.zeros(bm, bn)
        for k in range(bk):
            sequential = sequential + a.float()[:, k, None] * b.float()[None, k, :]
        assert not torch.equal(sequential, want)
    # and it is a matrix product (fp64 oracle), so the order test cannot pass on a wrong product
    exact = (a.double() @ b.double()) + (acc.double() if acc is not None else 0)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-4)


def test_an_element_depends_on_its_row_and_column_only():
    """The same row of ``a`` in a 16-row and a 64-row tile, at another position: the same bits."""
    g = torch.Generator().manual_seed(7)
    a = torch.randn(64, 64, generator=g)
    b = torch.randn(64, 32, generator=g)
    big = _kernel_dot(a, b, None)
    small = _kernel_dot(a[37:53].clone(), b, None)
    assert torch.equal(big[37:53], small)


def test_the_order_is_the_tile_k_chunks_so_block_k_does_not_matter():
    """Two K tiles of 32 chained through the accumulator == one K tile of 64 (the kernels' K loop)."""
    g = torch.Generator().manual_seed(11)
    a = torch.randn(16, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(64, 16, generator=g).to(torch.bfloat16)
    one = _kernel_dot(a, b, None)
    first = _kernel_dot(a[:, :32].contiguous(), b[:32].contiguous(), None)
    two = _kernel_dot(a[:, 32:].contiguous(), b[32:].contiguous(), first)
    assert torch.equal(one, two)
