"""Triton kernels for the batch-invariant RMSNorm (HF Qwen3/Llama cast order) and its backward.

Math (one row x of H values, weight w; see ``rlkernel.reference.rmsnorm``, the oracle)::

    r     = 1 / sqrt(Σ_j x_j² / H + eps)          fp32; IEEE sqrt and division (sqrt_rn, div_rn)
    x̂     = x·r                                   fp32
    out   = w · cast(x̂)                           cast(x̂) = x̂ rounded to x's dtype (HF order),
                                                  the product in promote(w, x) (exact in fp32)
    g     = dy·w,   dx = r·(g − x̂·Σ_j(g_j·x̂_j)/H)
    dw    = Σ_rows dy·cast(x̂)

Algorithm. Forward: a program normalizes ``ROWS`` rows, each loaded whole as one ``BLOCK_H =
next_pow2(H)`` block; the sum of squares is a fixed pairwise tree (``_pairwise_sum_rows``: adjacent
pairs, level by level, zero padding adds exact zeros), the order the reference uses too. The tree
and the block depend on H only, and rows never interact, so a row's bits are independent of the
batch (M, slicing, padding) and equal to the reference's bit for bit. It saves ``rstd = r`` (fp32,
``[M]``) for backward. Backward: ``P`` programs each own a contiguous, fixed range of rows; each
writes ``dx`` for its rows and one fp32 partial ``Σ dy·cast(x̂)`` over them into ``partial[P, H]``
(rows summed in increasing order); ``dweight = partial.sum(0)`` is then one fixed-order reduction.
``P`` depends on M and the SM count only, never on timing: no atomics, bitwise deterministic.

Memory traffic (b bytes per value): forward reads M·H·b, writes M·H·b (+4·M for rstd): 2 passes;
backward reads x and dy, writes dx: 3 passes, plus P·H·4 bytes of partials.

Caveats:
    * A row is one register block: H up to 65,536 (QK-norm 128, hidden sizes 1k–16k in practice).
    * Not bitwise equal to HF's own module, which uses ``torch.mean`` and ``rsqrt``: the scale may
      differ by an ulp of fp32, i.e. at most one rounding step of the output dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from rlkernel.kernels._launch import FP_FUSION, FastLauncher, num_sms
from rlkernel.kernels._launch import cdiv as _cdiv
from rlkernel.kernels._launch import device_guard as _device_guard

MAX_HIDDEN = 65536
_LOG2_MAX_BLOCK = tl.constexpr(16)


@dataclasses.dataclass(frozen=True)
class RMSNormConfig:
    """Launch configuration; ``block_h`` (the pairwise tree) is a function of H only."""

    block_h: int
    rows: int
    num_warps: int


@functools.lru_cache(maxsize=256)
def config_for(hidden: int) -> RMSNormConfig:
    """Rows per program and warps: ~2k–4k values per program, from H alone."""
    block_h = triton.next_power_of_2(hidden)
    rows = max(1, min(16, 2048 // block_h))
    warps = min(16, max(4, rows * block_h // 512))
    return RMSNormConfig(block_h, rows, warps)


def _num_sms(device: torch.device) -> int:
    return num_sms(device, interpreter=2)  # interpreter: two programs exercise the two-stage reduction


# --------------------------------------------------------------------------------------- kernels
@triton.jit
def _pairwise_sum_rows(x):
    """Σ over axis 1 of a ``[R, B]`` block (B a power of two) in a fixed pairwise order: adjacent
    pairs, level by level, so the result depends on B only (not on warps or vector width).
    Same order as ``reference.rmsnorm.pairwise_sum_last``."""
    for _ in tl.static_range(_LOG2_MAX_BLOCK):
        if x.shape[1] > 1:
            x = tl.sum(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)), axis=2)
    return tl.sum(x, axis=1)


@triton.jit
def _rms_norm_fwd_kernel(
    # outputs
    out_ptr,
    rstd_ptr,
    # inputs
    x_ptr,
    w_ptr,
    # sizes
    n_rows,
    n_cols,
    # runtime scalars
    eps,
    n_cols_f,
    # meta
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
    STORE_RSTD: tl.constexpr,
):
    """``ROWS`` contiguous rows per program; out = w·cast(x·r), rstd = r (if ``STORE_RSTD``: the
    backward needs it; a forward without gradient skips the store and the allocation)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    mask_c = cols < n_cols
    mask = (rows < n_rows)[:, None] & mask_c[None, :]
    offs = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    var = tl.math.div_rn(_pairwise_sum_rows(x * x), tl.cast(n_cols_f, tl.float32))
    # IEEE sqrt and division (not rsqrt.approx): the same bits as the PyTorch reference.
    r = tl.math.div_rn(tl.full(var.shape, 1.0, tl.float32), tl.sqrt_rn(var + tl.cast(eps, tl.float32)))
    # HF order: normalize in fp32, round to the input dtype, then multiply by the weight.
    x_hat = (x * r[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (w[None, :] * x_hat).to(out_ptr.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(rstd_ptr + rows, r, mask=rows < n_rows)


@triton.jit
def _rms_norm_bwd_kernel(
    # outputs
    dx_ptr,
    partial_ptr,
    # inputs
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    # sizes
    n_rows,
    n_cols,
    rows_per_program,
    # runtime scalars
    n_cols_f,
    # meta
    BLOCK_H: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Rows ``[pid·rows_per_program, (pid+1)·rows_per_program)``, ``ROWS`` at a time, in order:
    dx per row, and this program's fp32 ``Σ dy·cast(x̂)`` into ``partial[pid]``."""
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask_c = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask_c, other=0.0).to(tl.float32)
    inv_h = 1.0 / tl.cast(n_cols_f, tl.float32)
    dw = tl.zeros((BLOCK_H,), dtype=tl.float32)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    for r0 in range(first, last, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        mask_r = rows < last
        mask = mask_r[:, None] & mask_c[None, :]
        offs = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(rstd_ptr + rows, mask=mask_r, other=0.0)
        x_hat = x * r[:, None]
        g = dy * w[None, :]
        dot = _pairwise_sum_rows(g * x_hat)
        dx = r[:, None] * (g - x_hat * (dot * inv_h)[:, None])
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        # The value the forward multiplied w by: x̂ rounded to the input dtype.
        x_hat_c = x_hat.to(x_ptr.dtype.element_ty).to(tl.float32)
        dw += tl.sum(dy * x_hat_c, axis=0)
    tl.store(partial_ptr + pid * n_cols + cols, dw, mask=mask_c)


# ------------------------------------------------------------------------------------- launchers
_launch_fwd = FastLauncher(_rms_norm_fwd_kernel)  # a decode step calls it 4 times per layer


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    assert x.dim() == 2 and x.is_contiguous(), "x must be 2-D contiguous"
    assert weight.shape == (x.shape[1],) and weight.is_contiguous()
    assert x.shape[1] <= MAX_HIDDEN, f"hidden size {x.shape[1]} > {MAX_HIDDEN}"


def _rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, rstd: torch.Tensor, eps: float
) -> None:
    """Out-variant forward: fills contiguous ``out [M, H]`` and fp32 ``rstd [M]``."""
    _check(x, weight)
    _launch_rows(x, weight, out, rstd, eps, x.shape[0], x.shape[1])


def _launch_rows(x, weight, out, rstd, eps: float, n_rows: int, n_cols: int) -> None:
    """The forward launch over ``n_rows`` contiguous rows of ``n_cols`` (x, out of any rank);
    ``rstd`` None: not stored."""
    if n_rows == 0:
        return
    cfg = config_for(n_cols)
    with _device_guard(x):
        _launch_fwd(
            (_cdiv(n_rows, cfg.rows),),
            (out, rstd if rstd is not None else out, x, weight, n_rows, n_cols, float(eps), float(n_cols)),
            {"BLOCK_H": cfg.block_h, "ROWS": cfg.rows, "STORE_RSTD": rstd is not None},
            # No mul+add -> fma contraction: x*x is rounded before it is summed, as in the reference
            # (the compiler fuses by default, which would change the bits, not the invariance).
            {"num_warps": cfg.num_warps, "enable_fp_fusion": False},
        )


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocating forward: ``(out [M, H] in promote(w, x), rstd [M] fp32)`` for 2-D contiguous x."""
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    rstd = torch.empty(x.shape[:1], dtype=torch.float32, device=x.device)
    _rms_norm_fwd(x, weight, out, rstd, eps)
    return out, rstd


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``out`` only, shaped like a contiguous ``x [..., H]`` (any rank): the no-gradient forward of
    ``rlkernel.invariant.rms_norm`` with no reshape views (decode calls it ~4 times per layer).
    Inputs are validated by the caller (contiguous x and weight, H <= MAX_HIDDEN)."""
    n_cols = x.shape[-1]
    out_dtype = x.dtype if weight.dtype is x.dtype else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    _launch_rows(x, weight, out, None, eps, x.numel() // n_cols, n_cols)
    return out


def rms_norm_bwd(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx [M, H] in x's dtype, dweight [H] in weight's dtype)``; deterministic two-stage dweight."""
    _check(x, weight)
    assert grad_out.shape == x.shape and grad_out.is_contiguous()
    n_rows, n_cols = x.shape
    dx = torch.empty_like(x)
    if n_rows == 0:
        return dx, torch.zeros_like(weight)
    cfg = config_for(n_cols)
    programs = min(_cdiv(n_rows, cfg.rows), 4 * _num_sms(x.device))
    # Whole ROWS groups per program: every program's row range starts on a ROWS boundary.
    rows_per_program = _cdiv(_cdiv(n_rows, programs), cfg.rows) * cfg.rows
    programs = _cdiv(n_rows, rows_per_program)
    partial = torch.empty((programs, n_cols), dtype=torch.float32, device=x.device)
    with _device_guard(x):
        _rms_norm_bwd_kernel[(programs,)](
            dx,
            partial,
            grad_out,
            x,
            weight,
            rstd,
            n_rows,
            n_cols,
            rows_per_program,
            float(n_cols),
            BLOCK_H=cfg.block_h,
            ROWS=cfg.rows,
            num_warps=cfg.num_warps,
            enable_fp_fusion=FP_FUSION,
        )
    # Second stage: a fixed-order reduction over the P partials (CUDA's sum uses no atomics).
    return dx, partial.sum(0).to(weight.dtype)
