"""Triton kernels of the deterministic backward of ``rlkernel.invariant.attention``.

Math (s = scale, c = s·log2 e, P recomputed from the forward's base-2 LSE, delta = rowsum(dO·O)):

    P = 2^(c·q·kᵀ − lse2),   dV = Pᵀ·dO,   dP = dO·Vᵀ,   dS = P·(dP − delta),
    dQ = s·dS·K,   dK = s·dSᵀ·Q

``_attn_bwd_dkdv_kernel``: one program per (key block, sequence × kv head), key blocks anchored at
the sequence's first real key like the forward's; it loops over the GQA group's q heads (g = 0..G−1)
and, for each, over the query blocks that see the block, in that fixed order, accumulating dK and dV
in fp32 registers. ``_attn_bwd_dq_kernel``: one program per (query block, sequence × q head) loops
over the visible key blocks. Every output element is written once by one program: deterministic
without atomics. The backward need not be batch-invariant (training computes it once per step).

Memory: reads Q, K, V, O, dO once per program family plus K/V once per query block (dQ) and Q/dO
once per key block per group head (dK/dV), as in FlashAttention-2.

Masked-out pairs never reach a gradient, whatever the values there (NaN/±Inf in a query, key, value
or output gradient that a row or key does not see): as in the forward, the blocks that pair some
rows with keys they do not see (the diagonal ones) zero P and dS outside the visible pairs with a
``where`` (not a product with 0) and read the operand summed over the other side of those pairs
(dO and Q for dK/dV, K for dQ) with its non-finite entries as 0; the pairs that do see such a row
get a NaN P or dS instead, so the gradients they feed are NaN (whole rows, where the plain product
would give NaN in that entry's columns only). The other blocks run the plain body.

Caveats:
    * Keys before ``key_start`` get exact zeros (the gradients are allocated zeroed).
    * delta (rowsum(dO·O), fp32 [Hq, total query rows]) is computed by the dQ kernel, which runs
      first, and read by the dK/dV kernel: 4 bytes per (row, q head).
    * Two kernels cost matmuls: 7 per (query block, key block) pair (dK/dV: S, dP, dV, dK; dQ
      recomputes S and dP) where an atomic dQ needs 5. A deterministic one-kernel form (dQ parts
      added in key-block order under a lock per query tile) was built and measured 2.5-6x slower
      on an H200 (2026-11-28): its fp32 dQ traffic and lock hand-offs outweigh the two matmuls
      (``docs/guides/invariance.md``, "What is left").
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from rlkernel._dispatch import interpreter_enabled
from rlkernel.kernels._attention_common import (
    LOG2E,
    _block_d,
    _common,
    _non_finite,
    _precision,
    _seq_bounds,
    _strides4,
    _unit_last,
)
from rlkernel.kernels._dot import dot, interpreted
from rlkernel.kernels._launch import FP_FUSION
from rlkernel.kernels._launch import device_guard as _device_guard


@dataclasses.dataclass(frozen=True)
class KernelTiles:
    """One backward kernel's launch configuration."""

    block_m: int  # queries per block
    block_n: int  # keys per block
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    """Backward launch configuration, one per kernel (any choice is deterministic; it need not be
    invariant): ``dkdv`` (a program owns ``block_n`` keys and walks query blocks of ``block_m``),
    ``dq`` (a program owns ``block_m`` queries and walks key blocks of ``block_n``)."""

    dkdv: KernelTiles
    dq: KernelTiles


def bwd_config(head_dim: int, dtype: torch.dtype) -> BwdConfig:
    if interpreter_enabled():
        return BwdConfig(KernelTiles(16, 16, 1, 1), KernelTiles(16, 16, 1, 1))
    d = _block_d(head_dim)
    if dtype == torch.float32 or d > 128:
        tiles = KernelTiles(32, 32, 4, 1)
    elif d <= 64:
        # 16-bit, D <= 64 (the anchor model's heads): H200, Hq/Hkv = 16/8, B = 1, T = 8192 and 32768
        # (2026-11-28, benchmarks/results/attn_tiles_d64_h200_2026-11-28.txt): against 64/64 at 4 warps
        # and 2 stages for both kernels, 3 stages for dK/dV took 1.262 vs 1.327 ms and 16.5 vs 17.5 ms,
        # dQ over 128-key blocks at 3 stages 1.202 ms and 16.2 ms; the same gradients, bit for bit.
        return BwdConfig(KernelTiles(64, 64, 4, 3), KernelTiles(64, 128, 4, 3))
    else:
        # 16-bit, D <= 128: one warpgroup per program. H100, B = 1, T = 8192, Hq/Hkv = 32/8, D = 128
        # (2026-11-28, benchmarks/results/attn_bwd_sweep_h100_2026-11-28.log): the backward took
        # 9.23 ms at 64/64 with 8 warps (the former default: 255 registers and a 648-byte stack
        # per thread on sm_90) against 7.06 ms with dK/dV at 4 warps and 7.21 ms with dQ at 4.
        tiles = KernelTiles(64, 64, 4, 2)
    return BwdConfig(tiles, tiles)


@triton.jit
def _dkdv_block(
    dk,
    dv,
    k,
    v,
    keys,
    q_base,
    do_base,
    stride_qt,
    stride_qh,
    stride_dot,
    stride_doh,
    hq,
    m0,
    offs_d,
    mask_d,
    len_q,
    offset,
    lse_ptr,
    delta_ptr,
    total_q,
    q_row0,
    scale,
    BLOCK_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    DIAGONAL: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The contribution of queries [m0, m0 + BM) of q head ``hq`` to a key block's (dK, dV).
    DIAGONAL: some of those queries do not see some of the keys (see the module header). MASKED:
    the causal/range ``where`` on P; off only for a plain block whose queries are all below len_q
    (every pair visible: the ``where`` would keep every value).

    Addressing: ``m0`` is int64, the loop's induction variable; the block's first row is addressed
    in int64 (a scalar per block) and its elements by int32 offsets from there, loop invariants
    (``_int32_rows`` makes them fit): on sm_90 each thread's 8 q and 8 dO row offsets then take 16
    registers instead of 32 (the int64 form spilled in the loop at D = 128). The masks compare
    int32 queries and keys (positions in a sequence fit int32). A plain block's queries are all
    below len_q: its loads take the d mask alone (no per-query predicate)."""
    r = tl.arange(0, BLOCK_M)
    qi = tl.cast(m0, tl.int32) + r
    if MASKED or DIAGONAL:
        q_ok = qi < len_q
        ld = q_ok[:, None] & mask_d[None, :]
    else:
        ld = mask_d[None, :]  # the d mask alone, broadcast over the queries
    q_blk = q_base + hq * stride_qh + m0 * stride_qt
    do_blk = do_base + hq * stride_doh + m0 * stride_dot
    q = tl.load(q_blk + (r[:, None] * stride_qt + offs_d[None, :]), mask=ld, other=0.0)
    do = tl.load(do_blk + (r[:, None] * stride_dot + offs_d[None, :]), mask=ld, other=0.0)
    if DIAGONAL:  # one copy of each, finite; the pairs that see a bad row get NaN P below
        q, q_bad = _non_finite(q)
        do, do_bad = _non_finite(do)
    if MASKED or DIAGONAL:
        lse = tl.load(lse_ptr + hq * total_q + q_row0 + m0 + r, mask=q_ok, other=float("inf"))
        delta = tl.load(delta_ptr + hq * total_q + q_row0 + m0 + r, mask=q_ok, other=0.0)
    else:
        lse = tl.load(lse_ptr + hq * total_q + q_row0 + m0 + r)
        delta = tl.load(delta_ptr + hq * total_q + q_row0 + m0 + r)
    s_t = dot(k, tl.trans(q), None, INPUT_PRECISION, INTERPRETED)  # [BLOCK_N, BLOCK_M]
    p_t = tl.math.exp2(s_t * scale - lse[None, :])
    if DIAGONAL:
        visible = (keys[:, None] <= (offset + qi)[None, :]) & q_ok[None, :]
        p_t = tl.where(visible, p_t, 0.0)
    elif MASKED:
        # Past the diagonal every query sees every real key of the block: the causal compare could
        # only drop keys past len_k, whose rows of dK/dV are never stored (as in a plain block).
        p_t = tl.where(q_ok[None, :], p_t, 0.0)
    if DIAGONAL:
        p_t = tl.where(visible & (q_bad | do_bad)[None, :], float("nan"), p_t)
    dv = dot(p_t.to(do_base.dtype.element_ty), do, dv, INPUT_PRECISION, INTERPRETED)
    dp_t = dot(v, tl.trans(do), None, INPUT_PRECISION, INTERPRETED)
    ds_t = p_t * (dp_t - delta[None, :])
    if DIAGONAL:
        ds_t = tl.where(visible, ds_t, 0.0)
    dk = dot(ds_t.to(q_base.dtype.element_ty), q, dk, INPUT_PRECISION, INTERPRETED)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    # outputs
    dk_ptr,
    stride_dkb,
    stride_dkt,
    stride_dkh,
    dv_ptr,
    stride_dvb,
    stride_dvt,
    stride_dvh,
    # inputs
    q_ptr,
    stride_qb,
    stride_qt,
    stride_qh,
    k_ptr,
    stride_kb,
    stride_kt,
    stride_kh,
    v_ptr,
    stride_vb,
    stride_vt,
    stride_vh,
    do_ptr,
    stride_dob,
    stride_dot,
    stride_doh,
    lse_ptr,  # fp32 [Hq, total query rows], base 2
    delta_ptr,  # fp32 [Hq, total query rows], rowsum(dO·O)
    key_start_ptr,
    cu_q_ptr,
    cu_k_ptr,
    # sizes
    seqlen_q,
    seqlen_k,
    n_kv_heads,
    group,
    head_dim,
    total_q,
    # runtime scalars
    qk_scale,
    sm_scale,
    # meta
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_KEY_START: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """dK, dV of one key block of one kv head: Σ over the group's q heads (in order g = 0..G−1)
    and over the query blocks that see the block (in order), accumulated in fp32 registers."""
    # int32 query and key indices (a sequence's queries and keys fit int32): on sm_90 int64 ones cost
    # registers held across the query-block loops and int64 compares in the masks. Offsets are
    # widened where they are formed (``.to(tl.int64)``); the query-block loops run in int64.
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // n_kv_heads
    hk = pid_bh % n_kv_heads
    q_row0, q_tok0, len_q, k_tok0, len_k, ks, _ = _seq_bounds(
        b, key_start_ptr, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, HAS_KEY_START, IS_VARLEN
    )
    start = ks + pid_n * BLOCK_N
    if start < len_k:
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < head_dim
        keys = start + tl.arange(0, BLOCK_N)
        kv_ok = (keys < len_k)[:, None] & mask_d[None, :]
        k_base = k_ptr + b * stride_kb + k_tok0 * stride_kt + hk * stride_kh
        v_base = v_ptr + b * stride_vb + k_tok0 * stride_vt + hk * stride_vh
        rows_k = keys.to(tl.int64)
        k = tl.load(k_base + rows_k[:, None] * stride_kt + offs_d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_base + rows_k[:, None] * stride_vt + offs_d[None, :], mask=kv_ok, other=0.0)
        dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        scale = tl.cast(qk_scale, tl.float32)
        offset = len_k - len_q
        qi_lo = tl.maximum(start - offset, 0)  # the first query that sees a key of this block
        q_base = q_ptr + b * stride_qb + q_tok0 * stride_qt
        do_base = do_ptr + b * stride_dob + q_tok0 * stride_dot
        # Query blocks from qi_mid on see every key of this block (the last key is below len_k).
        qi_full = tl.minimum(start + BLOCK_N, len_k) - 1 - offset
        qi_mid = qi_lo + tl.cdiv(tl.maximum(qi_full - qi_lo, 0), BLOCK_M) * BLOCK_M
        # Blocks from qi_mid to qi_whole also lie below len_q whole: no mask at all.
        qi_whole = tl.maximum(qi_mid + tl.maximum(len_q - qi_mid, 0) // BLOCK_M * BLOCK_M, qi_mid)
        for g in range(0, group):
            hq = hk * group + g
            for m0 in range(tl.cast(qi_lo, tl.int64), tl.cast(tl.minimum(qi_mid, len_q), tl.int64), BLOCK_M):
                dk, dv = _dkdv_block(
                    dk, dv, k, v, keys, q_base, do_base, stride_qt, stride_qh, stride_dot, stride_doh, hq, m0,
                    offs_d, mask_d, len_q, offset, lse_ptr, delta_ptr, total_q, q_row0, scale,
                    BLOCK_M, INPUT_PRECISION, INTERPRETED, True, True,
                )  # fmt: skip
            for m0 in range(tl.cast(qi_mid, tl.int64), tl.cast(qi_whole, tl.int64), BLOCK_M):
                dk, dv = _dkdv_block(
                    dk, dv, k, v, keys, q_base, do_base, stride_qt, stride_qh, stride_dot, stride_doh, hq, m0,
                    offs_d, mask_d, len_q, offset, lse_ptr, delta_ptr, total_q, q_row0, scale,
                    BLOCK_M, INPUT_PRECISION, INTERPRETED, False, False,
                )  # fmt: skip
            # the last query block, partly past len_q
            for m0 in range(tl.cast(qi_whole, tl.int64), tl.cast(len_q, tl.int64), BLOCK_M):
                dk, dv = _dkdv_block(
                    dk, dv, k, v, keys, q_base, do_base, stride_qt, stride_qh, stride_dot, stride_doh, hq, m0,
                    offs_d, mask_d, len_q, offset, lse_ptr, delta_ptr, total_q, q_row0, scale,
                    BLOCK_M, INPUT_PRECISION, INTERPRETED, False, True,
                )  # fmt: skip
        dk = dk * sm_scale
        dk_base = dk_ptr + b * stride_dkb + k_tok0 * stride_dkt + hk * stride_dkh
        dv_base = dv_ptr + b * stride_dvb + k_tok0 * stride_dvt + hk * stride_dvh
        tl.store(
            dk_base + rows_k[:, None] * stride_dkt + offs_d[None, :],
            dk.to(dk_ptr.dtype.element_ty),
            mask=kv_ok,
        )
        tl.store(
            dv_base + rows_k[:, None] * stride_dvt + offs_d[None, :],
            dv.to(dv_ptr.dtype.element_ty),
            mask=kv_ok,
        )


@triton.jit
def _dq_block(
    dq,
    q,
    do,
    lse,
    delta,
    qpos,
    q_ok,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    offs_d,
    mask_d,
    start,
    len_k,
    scale,
    BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    DIAGONAL: tl.constexpr,
):
    """The contribution of key block [start, start + BN) to a query block's dQ. DIAGONAL: some of
    the queries do not see some of the keys (see the module header). A plain block's keys are all
    seen by every query row of the block, so P takes no ``where`` there; the block's rows past
    len_q (q = 0, lse = +inf) are never stored, and a row's dQ depends on no other row. ``start`` is
    int64, the loop's induction variable: the block's first key is addressed in int64, its elements
    by int32 offsets from there (as in ``_dkdv_block``); the masks compare int32 keys. A plain
    block's keys are all below len_k: its loads take the d mask alone (no per-key predicate)."""
    r = tl.arange(0, BLOCK_N)
    keys = tl.cast(start, tl.int32) + r
    if DIAGONAL:
        kv_ok = (keys < len_k)[:, None] & mask_d[None, :]
    else:
        kv_ok = mask_d[None, :]  # the d mask alone, broadcast over the keys
    k_blk = k_base + start * stride_kt
    v_blk = v_base + start * stride_vt
    k = tl.load(k_blk + (r[:, None] * stride_kt + offs_d[None, :]), mask=kv_ok, other=0.0)
    v = tl.load(v_blk + (r[:, None] * stride_vt + offs_d[None, :]), mask=kv_ok, other=0.0)
    if DIAGONAL:  # one copy, finite; the pairs that see a bad key get NaN P below
        k, k_bad = _non_finite(k)
    s = dot(q, tl.trans(k), None, INPUT_PRECISION, INTERPRETED)
    p = tl.math.exp2(s * scale - lse[:, None])
    if DIAGONAL:
        visible = (keys[None, :] <= qpos[:, None]) & q_ok[:, None]
        p = tl.where(visible, p, 0.0)
        p = tl.where(visible & k_bad[None, :], float("nan"), p)
    dp = dot(do, tl.trans(v), None, INPUT_PRECISION, INTERPRETED)
    ds = p * (dp - delta[:, None])
    if DIAGONAL:
        ds = tl.where(visible, ds, 0.0)
    return dot(ds.to(k_base.dtype.element_ty), k, dq, INPUT_PRECISION, INTERPRETED)


@triton.jit
def _attn_bwd_dq_kernel(
    # outputs
    dq_ptr,
    stride_dqb,
    stride_dqt,
    stride_dqh,
    o_ptr,  # the forward's output, read for delta (written to delta_ptr for the dK/dV kernel)
    stride_ob,
    stride_ot,
    stride_oh,
    # inputs
    q_ptr,
    stride_qb,
    stride_qt,
    stride_qh,
    k_ptr,
    stride_kb,
    stride_kt,
    stride_kh,
    v_ptr,
    stride_vb,
    stride_vt,
    stride_vh,
    do_ptr,
    stride_dob,
    stride_dot,
    stride_doh,
    lse_ptr,
    delta_ptr,
    key_start_ptr,
    cu_q_ptr,
    cu_k_ptr,
    # sizes
    seqlen_q,
    seqlen_k,
    n_kv_heads,
    group,
    head_dim,
    total_q,
    # runtime scalars
    qk_scale,
    sm_scale,
    # meta
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_KEY_START: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """dQ of one query block of one q head: Σ over its visible key blocks, in order; and its rows'
    delta = rowsum(dO·O) (fp32, summed by ``tl.sum``), stored for the dK/dV kernel launched next,
    which reads it, so that dO and O are read once for it (no fp32 copies). Programs are
    numbered last query block first: the causal work grows with the block, so the longest start
    first and the short ones fill the tail."""
    # int32 query and key indices, the key-block loops in int64 (see ``_attn_bwd_dkdv_kernel``).
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    n_q_heads = n_kv_heads * group
    b = pid_bh // n_q_heads
    hq = pid_bh % n_q_heads
    hk = hq // group
    q_row0, q_tok0, len_q, k_tok0, len_k, ks, _ = _seq_bounds(
        b, key_start_ptr, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, HAS_KEY_START, IS_VARLEN
    )
    m0 = pid_m * BLOCK_M
    if m0 < len_q:
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < head_dim
        qi = m0 + tl.arange(0, BLOCK_M)
        rows_q = qi.to(tl.int64)
        q_ok = qi < len_q
        ld = q_ok[:, None] & mask_d[None, :]
        q_base = q_ptr + b * stride_qb + q_tok0 * stride_qt + hq * stride_qh
        do_base = do_ptr + b * stride_dob + q_tok0 * stride_dot + hq * stride_doh
        q = tl.load(q_base + rows_q[:, None] * stride_qt + offs_d[None, :], mask=ld, other=0.0)
        do = tl.load(do_base + rows_q[:, None] * stride_dot + offs_d[None, :], mask=ld, other=0.0)
        lse = tl.load(lse_ptr + hq * total_q + q_row0 + rows_q, mask=q_ok, other=float("inf"))
        o_base = o_ptr + b * stride_ob + q_tok0 * stride_ot + hq * stride_oh
        o = tl.load(o_base + rows_q[:, None] * stride_ot + offs_d[None, :], mask=ld, other=0.0)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # rowsum(dO·O), fp32
        tl.store(delta_ptr + hq * total_q + q_row0 + rows_q, delta, mask=q_ok)
        qpos = len_k - len_q + qi
        key_end = len_k - len_q + tl.minimum(m0 + BLOCK_M, len_q)
        k_base = k_ptr + b * stride_kb + k_tok0 * stride_kt + hk * stride_kh
        v_base = v_ptr + b * stride_vb + k_tok0 * stride_vt + hk * stride_vh
        scale = tl.cast(qk_scale, tl.float32)
        dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        # Key blocks below key_mid are seen whole by every query of the block (the first sits at
        # key position len_k − len_q + m0).
        key_mid = ks + tl.maximum(len_k - len_q + m0 + 1 - ks, 0) // BLOCK_N * BLOCK_N
        for start in range(tl.cast(ks, tl.int64), tl.cast(key_mid, tl.int64), BLOCK_N):
            dq = _dq_block(
                dq, q, do, lse, delta, qpos, q_ok, k_base, v_base, stride_kt, stride_vt, offs_d, mask_d,
                start, len_k, scale, BLOCK_N, INPUT_PRECISION, INTERPRETED, False,
            )  # fmt: skip
        for start in range(tl.cast(key_mid, tl.int64), tl.cast(key_end, tl.int64), BLOCK_N):
            dq = _dq_block(
                dq, q, do, lse, delta, qpos, q_ok, k_base, v_base, stride_kt, stride_vt, offs_d, mask_d,
                start, len_k, scale, BLOCK_N, INPUT_PRECISION, INTERPRETED, True,
            )  # fmt: skip
        dq = dq * sm_scale
        dq_base = dq_ptr + b * stride_dqb + q_tok0 * stride_dqt + hq * stride_dqh
        tl.store(
            dq_base + rows_q[:, None] * stride_dqt + offs_d[None, :], dq.to(dq_ptr.dtype.element_ty), mask=ld
        )


_INT32_MAX = 2**31 - 1


def _int32_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` (``[..., tokens, heads, D]``, unit last stride) such that the element offsets of a block
    of ``rows`` tokens from the block's first one in the same head, ``r · stride_t + d`` (r < rows,
    d < BLOCK_D), fit int32: the backward's loops form them in int32 (the block's first element is
    addressed in int64; on sm_90 int64 offsets cost registers, spilled in the dK/dV loop). A token
    stride too large for that (a view into a much larger tensor) is made contiguous: same values.
    Raises ValueError if even the contiguous layout does not fit."""

    def fits(x: torch.Tensor) -> bool:
        return (rows - 1) * x.stride(-3) + _block_d(x.shape[-1]) - 1 <= _INT32_MAX

    if fits(t):
        return t
    t = t.contiguous()
    if not fits(t):
        raise ValueError(
            f"attention backward: {rows} tokens of {t.shape[-2]} heads x {t.shape[-1]} elements exceed "
            "int32 offsets"
        )
    return t


def attention_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    key_start: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    config: BwdConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic backward: ``(dq, dk, dv)`` in the inputs' dtype, contiguous, shaped like
    q, k, v. Keys before ``key_start`` get exact zeros."""
    q, k, v, do = _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(grad_out.to(q.dtype))
    packed, n_seq, hq, hkv, d, seqlen_q, seqlen_k, total_q = _common(
        q, k, key_start, cu_seqlens_q, max_seqlen_q
    )
    group = hq // hkv
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    if n_seq == 0 or seqlen_q == 0 or total_q == 0:
        return dq, dk, dv
    # delta = rowsum(dO·O) in fp32, laid out like the LSE: [Hq, total query rows]; written by the
    # dQ kernel (every row of every sequence), read by the dK/dV kernel after it.
    out = _unit_last(out)
    delta = torch.empty((hq, total_q), dtype=torch.float32, device=q.device)
    cfg = config or bwd_config(d, q.dtype)
    # The loops address a block's tokens by int32 offsets from its first one (see ``_int32_rows``).
    q, do = _int32_rows(q, cfg.dkdv.block_m), _int32_rows(do, cfg.dkdv.block_m)
    k, v = _int32_rows(k, cfg.dq.block_n), _int32_rows(v, cfg.dq.block_n)
    max_len_k = seqlen_k
    if packed:
        max_len_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max().item())
    flags = dict(
        BLOCK_D=_block_d(d),
        HAS_KEY_START=key_start is not None,
        IS_VARLEN=packed,
        INPUT_PRECISION=_precision(q.dtype),
        INTERPRETED=interpreted(q),
        enable_fp_fusion=FP_FUSION,
    )
    tail = (
        q,
        *_strides4(q, packed),
        k,
        *_strides4(k, packed),
        v,
        *_strides4(v, packed),
        do,
        *_strides4(do, packed),
        lse,
        delta,
        key_start if key_start is not None else lse,
        cu_seqlens_q if packed else lse,
        cu_seqlens_k if packed else lse,
        seqlen_q,
        seqlen_k,
        hkv,
        group,
        d,
        total_q,
        scale * LOG2E,
        scale,
    )
    with _device_guard(q):
        t = cfg.dq  # first: it writes delta
        grid = (triton.cdiv(seqlen_q, t.block_m), n_seq * hq)
        _attn_bwd_dq_kernel[grid](
            dq, *_strides4(dq, packed), out, *_strides4(out, packed), *tail,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.num_warps, num_stages=t.num_stages, **flags,
        )  # fmt: skip
        if max_len_k > 0:
            t = cfg.dkdv
            grid = (triton.cdiv(max_len_k, t.block_n), n_seq * hkv)
            _attn_bwd_dkdv_kernel[grid](
                dk, *_strides4(dk, packed), dv, *_strides4(dv, packed), *tail,
                BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.num_warps, num_stages=t.num_stages, **flags,
            )  # fmt: skip
    return dq, dk, dv
