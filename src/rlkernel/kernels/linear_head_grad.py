"""The gradient kernels of the LM head: the gradient GEMM (``_linear_head_grad_kernel``), which
recomputes the logits tile by tile and writes ∂L/∂x from the saved statistics, and the shifted
gradient kernel (``_shifted_grad_kernel``), which turns the statistics GEMM's stored tile-shifted
exponents into ∂L/∂x in one elementwise pass. Launchers, configuration and the math:
``kernels/linear_head.py``; shared tile pieces: ``kernels/_linear_head_tiles.py``.

GRAD: from the saved lse and entropy, per element ``lp2 = fma(acc, c, −lse·log2 e)``,
``p = exp2(lp2)`` and ``dx = [y == k]·g_logp/T − p·(a_r + b_r·lp2)`` with per-row
``a_r = (g_logp + g_H·H)/T``, ``b_r = g_H·ln 2/T``: two FMAs, one MUFU, one FMA and a select per
element; written in the output's dtype. The forward's sums are not needed: no partials, no
combine. It writes M·V·2 bytes (the bf16 gradient, 2.5 GB at M = 8192) and reads nothing but the
operands and 4 floats and an id per row. Cost (H100, 128×256 tile): one ``ex2`` and ~4 FMAs/selects
per logit plus the store, like the statistics epilogue (3-5 % of the mainloop); 255 registers
without spills, 213 KB of shared memory (the 64 KB staging buffer of the store included).

SHIFTED: program (row block, column tile t) reads ``d = (z − m_t)·log2 e`` (16 bits, stored by the
statistics GEMM with ``Z_SHIFTED``) and the tile's max ``m_t`` (the statistics' own partial):
``lp2 = d + (m_t − lse)·log2 e`` is GRAD's ``(z − lse)·log2 e`` and the formula is GRAD's; 2 bytes
read and 2 written per logit, in place.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rlkernel.kernels._linear_head_tiles import LN2, LOG2E, _acc_tile, _store_tile, _target_in_tile
from rlkernel.kernels.matmul import _tile_coords


@triton.jit
def _row_grad_terms(rows, mask_m, grad_logp_ptr, grad_entropy_ptr, entropy_ptr, inv_t,
                    HAS_GRAD_LOGP: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr):
    """Per row of a tile, the gradient's coefficients (module docstring): ``(g_y, a_r, b_r)`` with
    g_y = g_logp/T, a_r = (g_logp + g_H·H)/T, b_r = g_H·ln 2/T (zeros for an absent upstream)."""  # fmt: skip
    a_r = tl.zeros(rows.shape, tl.float32)
    b_r = tl.zeros(rows.shape, tl.float32)
    g_y = tl.zeros(rows.shape, tl.float32)
    if HAS_GRAD_LOGP:
        g_logp = tl.load(grad_logp_ptr + rows, mask=mask_m, other=0.0) * inv_t
        a_r += g_logp
        g_y = g_logp
    if HAS_GRAD_ENTROPY:
        g_ent = tl.load(grad_entropy_ptr + rows, mask=mask_m, other=0.0) * inv_t
        a_r += g_ent * tl.load(entropy_ptr + rows, mask=mask_m, other=0.0)
        b_r = g_ent * LN2
    return g_y, a_r, b_r


@triton.jit
def _grad_tile(lp2, is_target, active, g_y, a_r, b_r):
    """dx = [y == k]·g_y − p·(a_r + b_r·lp2), p = exp2(lp2), lp2 = (z − lse)·log2 e; exact zeros on
    ignored rows (even where exp2 overflowed: their lse is 0, not the row's)."""
    p = tl.exp2(lp2)
    dx = tl.where(is_target, g_y[:, None], 0.0) - p * (b_r[:, None] * lp2 + a_r[:, None])
    return tl.where(active[:, None], dx, 0.0)


@triton.jit(do_not_specialize=["M", "num_programs", "ignore_index"])
def _linear_head_grad_kernel(
    # output
    g_out,
    stride_gm,
    # inputs
    h_desc,
    w_desc,
    ids_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logp_ptr,
    grad_entropy_ptr,
    # sizes
    M,
    V,
    K,
    num_programs,
    # runtime scalars
    temperature,
    ignore_index,
    # meta
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_GRAD_LOGP: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    G_TMA: tl.constexpr,
    STORE_SPLIT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    FLATTEN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Persistent, as the stats kernel; each tile's epilogue writes
    dx = [y == k]·g_logp/T − p·(a_r + b_r·lp2), lp2 = (z − lse)·log2 e, p = exp2(lp2) (see the module
    docstring), and exact zeros on ignored rows."""
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(V, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    inv_t = 1.0 / tl.cast(temperature, tl.float32)
    c = inv_t * LOG2E
    cols = tl.arange(0, BLOCK_N)
    for tile_id in tl.range(
        start, num_pid_m * num_pid_n, num_programs, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE
    ):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        rows = off_m + tl.arange(0, BLOCK_M)
        mask_m = rows < M
        # Per-row inputs, loaded before the mainloop (their latency hides behind it).
        y = tl.load(ids_ptr + rows, mask=mask_m, other=-1).to(tl.int64)
        active = mask_m & (y != ignore_index)
        y_local = _target_in_tile(y, off_n, V, BLOCK_N)
        lse2 = tl.load(lse_ptr + rows, mask=mask_m, other=0.0) * LOG2E
        g_y, a_r, b_r = _row_grad_terms(rows, mask_m, grad_logp_ptr, grad_entropy_ptr, entropy_ptr, inv_t,
                                        HAS_GRAD_LOGP, HAS_GRAD_ENTROPY)  # fmt: skip

        acc = _acc_tile(h_desc, w_desc, off_m, off_n, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K,
                        INPUT_PRECISION, INTERPRETED)  # fmt: skip
        lp2 = acc * c - lse2[:, None]
        dx = _grad_tile(lp2, cols[None, :] == y_local[:, None], active, g_y, a_r, b_r)
        _store_tile(g_out, stride_gm, dx, off_m, off_n, M, V, G_TMA, STORE_SPLIT)


@triton.jit(do_not_specialize=["M", "ignore_index"])
def _shifted_grad_kernel(
    # in/out: the shifted exponents d [M, V] in, the gradient out (same buffer: in place)
    d_ptr,
    g_ptr,
    stride_dm,
    stride_gm,
    # inputs
    m_part_ptr,
    ids_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logp_ptr,
    grad_entropy_ptr,
    # sizes
    M,
    V,
    # runtime scalars
    temperature,
    ignore_index,
    # meta
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_GRAD_LOGP: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
):
    """Program (row block, column tile t): ∂L/∂x of the tile from the stored ``d = (z − m_t)·log2 e``
    and the tile's max ``m_t`` (the stats kernel's ``m[t, r]``): ``lp2 = d + (m_t − lse)·log2 e`` is
    the GRAD kernel's ``(z − lse)·log2 e``, and the formula is that kernel's. Every element is read
    and written by one program: in place is safe. Ignored rows get exact zeros."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    t = tl.program_id(1)
    off_n = t * BLOCK_N
    cols = off_n + tl.arange(0, BLOCK_N)
    mask_m = rows < M
    mask = mask_m[:, None] & (cols < V)[None, :]
    inv_t = 1.0 / tl.cast(temperature, tl.float32)
    y = tl.load(ids_ptr + rows, mask=mask_m, other=-1).to(tl.int64)
    active = mask_m & (y != ignore_index)
    shift2 = (tl.load(m_part_ptr + t.to(tl.int64) * M + rows, mask=mask_m, other=0.0)
              - tl.load(lse_ptr + rows, mask=mask_m, other=0.0)) * LOG2E  # fmt: skip
    g_y, a_r, b_r = _row_grad_terms(rows, mask_m, grad_logp_ptr, grad_entropy_ptr, entropy_ptr, inv_t,
                                    HAS_GRAD_LOGP, HAS_GRAD_ENTROPY)  # fmt: skip
    d = tl.load(d_ptr + rows[:, None] * stride_dm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dx = _grad_tile(d + shift2[:, None], cols[None, :] == y[:, None], active, g_y, a_r, b_r)
    tl.store(g_ptr + rows[:, None] * stride_gm + cols[None, :], dx.to(g_ptr.dtype.element_ty), mask=mask)
