"""The batch-invariant GEMM (``rlkernel.invariant.linear``) and RMSNorm at real sizes on the GPU.

The tuned GEMM table is invariant across M only because every configuration of a dtype's table
gives the same bits (the same k16 tensor-core steps in the same K order; ``kernels/matmul_table.py``):
a property of the GPU and the compiler, not of the code, so ``test_table_configs_are_one_bitwise_class``
re-verifies it here for every dtype, at K = N = 4096 and at a K-tail shape. A failure there means:
run ``rk.use_options(matmul_table="single")`` on this GPU / Triton until the table is fixed.

Then the public ``linear`` (both tables): rows of M = 1 … 100,000 (bucket edges, offsets, bias) and
of every Qwen3-8B layer shape (every weight class of the table) equal the rows of the full
product; accuracy against fp64 next to cuBLAS's own error; forward + backward twice bitwise with
both backward GEMMs; RMSNorm bitwise the reference, accurate, deterministic and row invariant.

Inputs: ``randn`` activations, weights ``randn/√K``, bias ``randn``, bf16 unless the test says.
Tolerances: ‖out − exact‖/‖exact‖ ≤ 1e-5 (fp32), 1e-2 (bf16, fp16) and ≤ 2× cuBLAS's error
(DESIGN's numerical contract); gradients 1e-2.
"""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk
from rlkernel.invariant import linear, rms_norm
from rlkernel.kernels import matmul as km
from rlkernel.kernels import matmul_table as mt
from rlkernel.reference import rmsnorm as ref_rms

from .conftest import DEVICE, SIZES, SMOKE, generator, no_tf32, rel_err

pytestmark = pytest.mark.gpu

S = SIZES.invariant_ops
BF16 = torch.bfloat16
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
GRAD_RTOL = 1e-2
# Error allowed relative to cuBLAS's. The CPU interpreter (smoke mode) rounds fp32 -> bf16/fp16 by
# truncation, which doubles the rounding error: 3x there.
VS_CUBLAS = 3.0 if SMOKE else 2.0
TABLES = ("tuned", "single")

compiled_only = pytest.mark.skipif(
    SMOKE, reason="the CPU interpreter casts fp32 -> bf16 by truncation: not bitwise the reference there"
)


def rand(*shape, dtype=BF16, seed=0, scale=1.0):
    return (torch.randn(*shape, device=DEVICE, generator=generator(seed)) * scale).to(dtype)


def weight(n, k, dtype=BF16, seed=1):
    return rand(n, k, dtype=dtype, seed=seed, scale=k**-0.5)


def table_options(table: str) -> dict:
    """``rk.use_options`` arguments: the GEMM table, and in smoke mode thresholds small enough that
    tiny shapes reach every weight class and cell of the table."""
    opts = {"matmul_table": table}
    if S.thresholds is not None:
        opts["matmul_thresholds"] = S.thresholds
    return opts


def row_mismatches(run, x, ms=S.ms, offsets=(0, S.offset)):
    """``run(x[a:a+m])`` against rows a:a+m of ``run(x)`` for every m in ``ms`` (< M) at each offset
    and at the end of x; returns the full output and the ``m@a`` that differ."""
    full = run(x)
    bad = []
    for m in ms:
        for start in sorted({*offsets, x.shape[0] - m}):
            if 0 <= start and start + m <= x.shape[0] and m < x.shape[0]:
                if not torch.equal(run(x[start : start + m]), full[start : start + m]):
                    bad.append(f"m={m}@{start}")
    return full, bad


# ------------------------------------------------------------------------------ the table's class
@pytest.mark.parametrize("shape", ["square", "k_tail"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_table_configs_are_one_bitwise_class(dtype_name, shape):
    """Every configuration the tuned table can pick for the dtype (``table_configs``) is invariant
    across M on its own (rows and offset slices), and all of them give bitwise the same product:
    the premise of the tuned table's batch invariance (fp16 runs bf16's table)."""
    dtype = DTYPES[dtype_name]
    if shape == "square":
        k, n, m_full = S.k, S.n, S.class_m[dtype_name]
    else:
        (k, n), m_full = S.k_tail, min(512, S.class_m[dtype_name])
    x = rand(m_full, k, dtype=dtype, seed=2)
    w = weight(n, k, dtype=dtype)
    configs = mt.table_configs(dtype, "tuned")[: S.class_configs]
    outs, not_invariant = {}, {}
    for cfg in configs:
        full, bad = row_mismatches(
            lambda a, cfg=cfg: km.matmul(a, w.t(), config=cfg), x, [m for m in S.ms if m <= m_full]
        )
        outs[cfg.name] = full
        if bad:
            not_invariant[cfg.name] = bad[:4]
    first = configs[0].name
    other_class = [name for name, out in outs.items() if not torch.equal(out, outs[first])]
    assert not not_invariant, f"configs not invariant across M: {not_invariant}"
    assert not other_class, f"configs not bitwise equal to {first} (M={m_full}, K={k}, N={n}): {other_class}"


# ----------------------------------------------------------------------------- the public linear
@pytest.mark.parametrize("width", ["wide", "narrow"])
@pytest.mark.parametrize("table", TABLES)
def test_linear_rows_equal_across_m(table, width):
    """``linear(x[a:a+m], W, b)`` equals rows a:a+m of ``linear(x, W, b)`` for M = 100,000 and m at
    every bucket edge, at offsets 0, 37 and the end; a wide (N = 4096) and a narrow (N = 1024,
    GQA k/v) weight."""
    n = S.n if width == "wide" else S.n // 4
    x = rand(S.big_m, S.k, seed=3)
    w = weight(n, S.k, seed=4)
    b = rand(n, seed=5)
    with rk.use_options(**table_options(table)):
        _, bad = row_mismatches(lambda a: linear(a, w, b), x)
    assert not bad, f"rows differ at {bad[:8]}"


@pytest.mark.parametrize("layer", list(S.shapes))
@pytest.mark.parametrize("table", TABLES)
def test_linear_layer_shapes_rows_equal_the_full_batch(table, layer):
    """At each Qwen3-8B layer shape (and the LM head: every weight class of the table), the rows of
    ``linear(x[:m], W)`` for the decode and mid M equal the first rows of M = 8192."""
    k, n = S.shapes[layer]
    x = rand(S.layer_ms[-1], k, seed=6)
    w = weight(n, k, seed=7)
    with rk.use_options(**table_options(table)):
        full = linear(x, w)
        bad = [m for m in S.layer_ms[:-1] if not torch.equal(linear(x[:m], w), full[:m])]
    assert not bad, f"rows differ at M = {bad}"


@pytest.mark.cpu_smoke
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_linear_accuracy_vs_fp64_and_cublas(dtype_name):
    """‖linear(x, W, b) − exact‖/‖exact‖ (fp64 exact) within the dtype's tolerance and at most
    twice cuBLAS's own error on the same inputs (TF32 off for the fp32 baseline)."""
    dtype = DTYPES[dtype_name]
    m = S.accuracy_m
    x = rand(m, S.k, dtype=dtype, seed=8)
    w = weight(S.n, S.k, dtype=dtype, seed=9)
    b = rand(S.n, dtype=dtype, seed=10)
    exact = x.double() @ w.double().T + b.double()
    err = rel_err(linear(x, w, b), exact)
    with no_tf32():
        base = rel_err(torch.nn.functional.linear(x, w, b), exact)
    assert err <= REL_TOL[dtype], f"rel err {err:.2e}"
    assert err <= VS_CUBLAS * base + 1e-7, f"rel err {err:.2e}, cuBLAS {base:.2e}"


@pytest.mark.parametrize("backward", ["kernel", "torch"])
def test_linear_fwd_bwd_twice_bitwise_and_accurate(backward):
    """Forward + backward (dx, dW, db) twice on the same inputs: bitwise equal, with the invariant
    kernel or cuBLAS for the two backward GEMMs; dx and dW against fp64."""
    m = min(4096, S.m_full)

    def once():
        x = rand(m, S.k, seed=16).requires_grad_()
        w = weight(S.n, S.k, seed=17).requires_grad_()
        b = rand(S.n, seed=18).requires_grad_()
        out = linear(x, w, b)
        out.backward(rand(m, S.n, seed=19))
        return out.detach(), x.grad, w.grad, b.grad

    with rk.use_options(invariant_backward=backward):
        first, second = once(), once()
    differ = [
        n for n, a, c in zip(("out", "dx", "dw", "db"), first, second, strict=True) if not torch.equal(a, c)
    ]
    assert not differ, f"not bitwise equal across two runs: {differ}"
    x, w = rand(m, S.k, seed=16).double(), weight(S.n, S.k, seed=17).double()
    gy = rand(m, S.n, seed=19).double()
    assert rel_err(first[1], gy @ w) <= GRAD_RTOL
    assert rel_err(first[2], gy.T @ x) <= GRAD_RTOL


# ------------------------------------------------------------------------------------------ RMSNorm
def rms_inputs(m, h, seed):
    return rand(m, h, seed=seed, scale=3.0), rand(h, seed=seed + 1, scale=0.1) + 1


@compiled_only
def test_rms_norm_kernel_is_bitwise_the_reference():
    """bf16 ``[8192, 4096]``: the Triton RMSNorm gives the reference's bits (IEEE 1/sqrt, pairwise
    sums, HF cast order)."""
    x, w = rms_inputs(S.rms_m, S.k, seed=11)
    assert torch.equal(rms_norm(x, w), ref_rms.rms_norm(x, w))


def test_rms_norm_fwd_bwd_accuracy_vs_fp64():
    """bf16 ``[2048, 4096]``: dx and dweight against fp64 autograd of HF's formula."""
    m = min(2048, S.rms_m)
    x, w = rms_inputs(m, S.k, seed=13)
    x.requires_grad_()
    w.requires_grad_()
    gy = rand(m, S.k, seed=15)
    rms_norm(x, w).backward(gy)
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    ref_rms.rms_norm_hf(xd, wd).backward(gy.double())
    assert rel_err(x.grad, xd.grad) <= GRAD_RTOL
    assert rel_err(w.grad, wd.grad) <= GRAD_RTOL


def test_rms_norm_fwd_bwd_twice_bitwise():
    """Forward + backward twice: out, dx and the two-stage dweight bitwise equal."""

    def once():
        x, w = rms_inputs(S.rms_m, S.k, seed=20)
        x.requires_grad_()
        w.requires_grad_()
        out = rms_norm(x, w)
        out.backward(rand(S.rms_m, S.k, seed=22))
        return out.detach(), x.grad, w.grad

    first, second = once(), once()
    differ = [n for n, a, c in zip(("out", "dx", "dw"), first, second, strict=True) if not torch.equal(a, c)]
    assert not differ, f"not bitwise equal across two runs: {differ}"


@pytest.mark.cpu_smoke
@pytest.mark.parametrize("kind", ["hidden", "qk_norm"])
def test_rms_norm_rows_equal_across_m(kind):
    """Rows of a slice equal the full batch's: hidden states ``[8192, 4096]`` and the per-head QK
    norm ``[4096, 32, 128]`` (normalized over head_dim)."""
    if kind == "hidden":
        x, w = rand(S.rms_m, S.k, seed=23), rand(S.k, seed=24) + 1
    else:
        heads, d = S.qk_heads
        x, w = rand(min(S.rms_m, 4096), heads, d, seed=25), rand(d, seed=26) + 1
    _, bad = row_mismatches(lambda t: rms_norm(t, w), x)
    assert not bad, f"rows differ at {bad[:8]}"
