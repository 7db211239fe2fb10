"""Triton forward kernels of batch-invariant causal GQA attention, and helpers shared with the backward.

Forward math and block order: see ``rlkernel.reference.attention`` (the oracle) and
``rlkernel.invariant.attention`` (why it is invariant). In short, for a row = (query at key position
p, q head h) of a sequence whose first real key is s, with c = scale·log2 e (one fp32 constant), a
two-level online softmax: splits of S = SPLIT_N keys anchored at s (S a multiple of BN = BLOCK_N,
``split_keys``: 2048 by default; the option ``attention_split_keys``), each split an online softmax
over its key blocks from a fresh state, the splits merged in order:

    (M, L, A) = (−inf, 0, 0)
    for splits [s + i·S, s + (i+1)·S), i = 0, 1, …:                              (``_attend_splits``)
        (m, l, acc) = (−inf, 0, 0)
        for key blocks [s + i·S + j·BN, …), j = 0 … S/BN − 1 (all masked alike):  (``_attend_block``)
            t = where(key ≤ p, c·(q·kᵀ), −inf);  m' = max(m, rowmax t);  α = 2^(m − m');  P = 2^(t − m')
            l = α·l + rowsum P;   acc = α·acc + P·V
        (M, L, A) = merge((M, L, A), (m, l, acc))                                          (``_merge``)
    out = A / L,   lse2 = M + log2 L (saved for backward; +inf for rows that see no key)  (``_finish``)

    merge: M' = max(M, m); μ = M' (0 if −inf); a = 2^(M − μ), b = 2^(m − μ); L' = a·L + b·l;
           A' = a·A + b·acc; with (a, b) = (0, 1) exactly while L = 0 (the first split) and (1, 0)
           for a split the row sees no key of (l = 0: an exact no-op).

A row with at most S keys (counted from s) has one split, taken as it is: its bits are those of the
one-level loop (the formula before the splits, commit 9b86671). A row with more keys changes bits
with S (consistently on every path and both backends): S is part of the formula, like BN.

Two ways to run it, same bits by construction. The one-pass kernel (``_attn_fwd_kernel``, prefill,
chunked prefill, decode at large batch): a program walks its tile's splits in order and merges after
each. Split-decode (``use_split_decode``: a decode step at small batch, whose one-pass grid would
leave SMs idle): one program per (row tile, split, sequence × kv head) computes that split's state
with the same block loop and stores it in fp32 (``WRITE_PARTIAL``), then ``_attn_combine_kernel``
merges each row's splits in split order with the same ``_merge``, from the same fresh state, and
finishes with the same ``_finish``. The stored partials are the fp32 values the prefill keeps in
registers, and every kernel is launched with ``enable_fp_fusion=False`` (no mul+add → fma
contraction, in the block loop, the merge or the finish), so each product and sum rounds on its own,
identically in the three kernels. A row's splits past its last key (a prefill tile reaches further
than its early rows) are empty for it (l = 0): exact no-ops in ``_merge``, so the combine merges only
the splits that hold a key the row sees.

Non-finite values (NaN/±Inf) reach exactly the rows that see them, and make them NaN. P·V is a
matrix product, so in a block that some row of the tile does not see whole (the tile's diagonal:
one or two blocks per tile) a key hidden from a row would still turn it to NaN through 0·NaN. There,
and only there, V enters the product with its non-finite entries read as 0 and the rows that do see
such a value row get a NaN P for it in P·V alone (``_attend_block``, DIAGONAL; l and lse2 keep the
scores' values). The other blocks, seen whole by every row of the tile, run the plain body, where a
non-finite value reaches its own columns of the rows (all of which see it); ``_finish`` then makes
NaN every row with a non-finite column, so the result does not depend on which loop a block fell
in. The diagonal's extra work is not paid per block of a long sequence, and both loops do the same
arithmetic in the same order on the same values: finite inputs give the same bits whichever loop a
block falls in (a decode tile and a prefill tile split a sequence's blocks differently). A NaN/Inf
query or key gives non-finite scores for exactly its (row, key) pairs, which the causal ``where``
hides from the rows that do not see them; a row that sees one has l = NaN and outputs NaN
(``_finish`` tests l ≠ 0, not l > 0, so it is not taken for a row that sees no key). The merge
carries both: a NaN l poisons L, and a non-finite acc reaches A (even through b = 0: NaN·0 = NaN).

A block that a row's mask fully hides is an exact no-op for that row (α = 1, P = 0), so how far a
tile's other rows reach changes nothing; a decode step is the prefill tile with only its last
query's rows active.

Rows are (query, q head of the GQA group) pairs: row r of a (sequence, kv head) program covers
query r // G and q head kv·G + r % G, so each K/V block is loaded once for the G heads that share it.
The deterministic backward lives in ``rlkernel.kernels.attention_bwd`` and shares this module's
helpers (sequence bounds, strides, operand handling); it recomputes P from the saved lse2 (the
row's log-sum-exp whichever way its splits were merged).

Memory traffic (forward, bf16, B·T tokens, causal): Q and O once, K/V once per query tile per group;
FLOPs 2·2·B·Hq·T²·D/2. Decode reads the whole K/V cache once per (sequence, kv head); split-decode
spreads it over ⌈T/S⌉ programs per (sequence, kv head) and adds fp32 partials of (D + 2)·4 bytes per
(row, split), written once and read once by the combine.

The split-decode combine and the split policy live in ``rlkernel.kernels.attention_split``; the
helpers the three kernel modules share in ``rlkernel.kernels._attention_common``. The bitwise claims
rest on ``tests/gpu/test_attention_long.py`` (32k tokens, split edges, both decode paths) and
``tests/gpu/test_attention.py`` passing on the target GPU.

Provenance: FlashAttention-2 (Dao 2023), the Triton fused-attention tutorial and flash-decoding
(split-KV), written anew here with the key-block anchoring, the single masked loop, the fixed
split positions and the fixed configuration that invariance needs.

Caveats:
    * One launch configuration per (head_dim, dtype) for forward (prefill, split partials and
      decode alike), plus decode tiles proven bitwise equal on the GPU (``DECODE_TILES``, empty):
      it fixes the bits. The combine has its own row tiling (elementwise only: no bit depends on
      it). The backward is free to differ.
    * BLOCK_N and S are part of the formula: changing BLOCK_N changes the bits of every row with
      more than BLOCK_N keys, changing S those with more than S keys (consistently on all paths;
      the reference's BLOCK_N and SPLIT_KEYS follow the 16-bit GPU ones).
    * The prefill pays per split of S keys one merge and one software-pipeline restart: on sm_90
      (Triton 3.9, static count, no GPU run) ~770 instructions per thread per split outside the
      key-block loop, whose body is unchanged (~680 per block): about +3.5 % instructions for rows
      past the first split at S = 2048; timed on an H200 (2026-11-28): prefill B = 1, T = 8192
      +3.2 % against the one-split formula. The running total (64 fp32 per thread at BLOCK_M 64) is
      live across the inner loop: ptxas spills around that loop, not inside it. A flat loop with
      the merge behind a branch was tried and rejected: reading the accumulator in the branch
      made ptxas serialize every wgmma of the kernel (C7514), and with the merge moved after the
      next QK product it put spill reloads in the loop body (+38 instructions per block).
    * The forward runs one warpgroup per program (64 rows, 4 warps, 3 stages): 255 registers with a
      ~180-byte stack per thread on sm_90 (Triton 3.9, static; ~400 bytes before the row and key
      indices were int32), two programs per SM (shared memory allows two either way). H100
      (2026-11-28): 0.65-0.72x SDPA's speed at T >= 8192
      (benchmarks/results/attn_bwd_sweep_h100_2026-11-28.log): softmax and MMAs do not overlap
      (no warp specialization) — what stands between it and SDPA: under Nsight Compute (H200,
      2026-11-28) the tensor pipe is active 50 % of the time here, 73 % in cuDNN's warp-specialized
      kernel (benchmarks/results/attn_ncu_h200_2026-11-28.txt).
    * FP contraction is off in the forward kernels: c·(q·k) − m is a multiply and a subtract
      rather than one fma (slightly more ALU work per score; the MMAs and exp2 dominate).
    * fp32 inputs use IEEE fp32 dots (no tf32): accuracy over speed for the fp32 path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels._attention_common import (
    LOG2E,
    _block_d,
    _common,
    _finish,
    _fresh,
    _merge,
    _non_finite,
    _precision,
    _seq_bounds,
    _store_rows,
    _strides4,
    _tile_rows,
    _unit_last,
)
from rlkernel.kernels._dot import dot, interpreted
from rlkernel.kernels._launch import FastLauncher
from rlkernel.kernels._launch import cdiv as _cdiv
from rlkernel.kernels._launch import device_guard as _device_guard
from rlkernel.kernels.attention_config import (  # noqa: F401 - re-exported
    DECODE_TILES,
    FwdConfig,
    fwd_config,
    launch_config,
)
from rlkernel.kernels.attention_split import (  # noqa: F401 - re-exported: the split policy's public names
    SPLIT_DECODE_CHOICES,
    _launch_combine,
    check_split_keys,
    split_keys,
    use_split_decode,
)


@triton.jit
def _attend_block(
    m_i,
    l_i,
    acc,
    q,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    offs_d,
    mask_d,
    qpos,
    start,
    len_k,
    scale,
    BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    DIAGONAL: tl.constexpr,
):
    """One key block [start, start + BN) of the online softmax (see ``_attend_blocks``). A plain
    block (not DIAGONAL) is seen whole by every row of the tile, so its keys are all below len_k
    and the causal ``where`` would keep every score: it is skipped there (same values, less ALU
    work per score and no per-key load predicate)."""
    # ``start`` is int64, the loop's induction variable: the row offsets below stay affine in it, so
    # the compiler advances the load addresses by a stride per block instead of recomputing 64-bit
    # products; the masks compare int32 keys (positions in a sequence fit int32).
    rows_kv = start + tl.arange(0, BLOCK_N)
    keys = rows_kv.to(tl.int32)
    if DIAGONAL:
        kv_ok = (keys < len_k)[:, None] & mask_d[None, :]
    else:
        kv_ok = mask_d[None, :]  # the d mask alone, broadcast over the keys
    k = tl.load(k_base + rows_kv[:, None] * stride_kt + offs_d[None, :], mask=kv_ok, other=0.0)
    v = tl.load(v_base + rows_kv[:, None] * stride_vt + offs_d[None, :], mask=kv_ok, other=0.0)
    s = dot(q, tl.trans(k), None, INPUT_PRECISION, INTERPRETED)
    if DIAGONAL:
        visible = keys[None, :] <= qpos[:, None]
        t = tl.where(visible, s * scale, float("-inf"))
    else:
        t = s * scale
    m_new = tl.maximum(m_i, tl.max(t, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: 2^(−inf) = 0
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(t - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DIAGONAL:  # some rows do not see some keys: their P = 0 must not meet a NaN/Inf value
        v, v_bad = _non_finite(v)
        p = tl.where(visible & v_bad[None, :], float("nan"), p)  # P·V only (l has its sum)
    acc = dot(p.to(v_base.dtype.element_ty), v, acc, INPUT_PRECISION, INTERPRETED)
    return m_new, l_i, acc


@triton.jit
def _attend_range(
    m_i,
    l_i,
    acc,
    q,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    offs_d,
    mask_d,
    qpos,
    lo,
    hi,
    len_k,
    scale,
    BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    DIAGONAL: tl.constexpr,
):
    """The state (m, l, acc) continued over the key blocks [lo, lo+BN), … below ``hi``, in order
    (``lo``, ``hi``: int32 key positions; the loop runs in int64, see ``_attend_block``)."""
    for start in range(tl.cast(lo, tl.int64), tl.cast(hi, tl.int64), BLOCK_N):
        m_i, l_i, acc = _attend_block(
            m_i, l_i, acc, q, k_base, v_base, stride_kt, stride_vt, offs_d, mask_d, qpos, start, len_k,
            scale, BLOCK_N, INPUT_PRECISION, INTERPRETED, DIAGONAL,
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _attend_blocks(
    q,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    offs_d,
    mask_d,
    qpos,
    lo,
    mid,
    hi,
    len_k,
    scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Online softmax from a fresh state over the key blocks [lo, lo+BN), [lo+BN, lo+2BN), … below
    ``hi`` (one split, or part of one), every block masked alike (keys ≥ ``len_k`` read zeros, keys
    after a row's query get −inf). The blocks below ``mid`` are seen whole by every row of the
    tile; the others (the tile's diagonal) also read V's non-finite entries as 0 and make NaN the
    outputs that see one (see the module header). Same arithmetic, same order, either way. Returns
    the rows' (m, l, acc): running max, sum of 2^(t − m) and Σ P·V, all fp32."""
    m_i, l_i, acc = _fresh(BLOCK_M, BLOCK_D)
    m_i, l_i, acc = _attend_range(
        m_i, l_i, acc, q, k_base, v_base, stride_kt, stride_vt, offs_d, mask_d, qpos, lo, mid, len_k, scale,
        BLOCK_N, INPUT_PRECISION, INTERPRETED, False,
    )  # fmt: skip
    m_i, l_i, acc = _attend_range(
        m_i, l_i, acc, q, k_base, v_base, stride_kt, stride_vt, offs_d, mask_d, qpos, mid, hi, len_k, scale,
        BLOCK_N, INPUT_PRECISION, INTERPRETED, True,
    )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _attend_splits(
    q,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    offs_d,
    mask_d,
    qpos,
    ks,
    full_end,
    key_end,
    len_k,
    scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """The prefill's two-level online softmax over the key blocks [ks, key_end): splits of
    ``SPLIT_N`` keys from ``ks``, each from a fresh state (``_attend_blocks``, exactly as a
    split-decode program computes it alone), merged into the total in order (``_merge``). The
    splits below ``full_end`` (seen whole by every row of the tile: most of a long sequence) run
    the one plain loop; the last few (the tile's diagonal) both loops, as ``_attend_blocks``. A
    nested loop: the inner one has the one-level loop's block body (its arithmetic unchanged, its
    sm_90 code the same size); each split adds a software-pipeline restart and one merge (ptxas
    keeps the total, live across the inner loop, out of it: spilled around it, not inside).
    A block is in the same loop (plain or diagonal) as in the one-level kernel, so a row with at
    most ``SPLIT_N`` keys, merged once into the fresh total, keeps that kernel's bits."""
    m_t, l_t, acc_t = _fresh(BLOCK_M, BLOCK_D)
    bulk_end = ks + (full_end - ks) // SPLIT_N * SPLIT_N
    for lo in range(ks, bulk_end, SPLIT_N):
        m_s, l_s, acc_s = _fresh(BLOCK_M, BLOCK_D)
        m_s, l_s, acc_s = _attend_range(
            m_s, l_s, acc_s, q, k_base, v_base, stride_kt, stride_vt, offs_d, mask_d, qpos, lo, lo + SPLIT_N,
            len_k, scale, BLOCK_N, INPUT_PRECISION, INTERPRETED, False,
        )  # fmt: skip
        m_t, l_t, acc_t = _merge(m_t, l_t, acc_t, m_s, l_s, acc_s)
    for lo in range(bulk_end, key_end, SPLIT_N):
        hi = tl.minimum(lo + SPLIT_N, key_end)
        m_s, l_s, acc_s = _attend_blocks(
            q, k_base, v_base, stride_kt, stride_vt, offs_d, mask_d, qpos, lo,
            tl.minimum(tl.maximum(full_end, lo), hi), hi, len_k, scale,
            BLOCK_M, BLOCK_N, BLOCK_D, INPUT_PRECISION, INTERPRETED,
        )  # fmt: skip
        m_t, l_t, acc_t = _merge(m_t, l_t, acc_t, m_s, l_s, acc_s)
    return m_t, l_t, acc_t


@triton.jit
def _attn_fwd_kernel(
    # outputs
    o_ptr,
    stride_ob,
    stride_ot,
    stride_oh,
    lse_ptr,  # fp32 [Hq, total query rows]
    part_acc_ptr,  # WRITE_PARTIAL: fp32 [n_splits, total query rows, Hq, head_dim]
    part_ml_ptr,  # WRITE_PARTIAL: fp32 [n_splits, 2, Hq, total query rows] (m, then l)
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
    n_splits,  # WRITE_PARTIAL: splits per row tile in the grid
    # runtime scalars
    qk_scale,
    # meta
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_N: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    HAS_KEY_START: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """One row tile of one (sequence, kv head). Prefill (``WRITE_PARTIAL`` False): the tile's splits
    in order, each merged into the running state, then out and lse2. Split-decode (True): program
    (row tile, split) computes that one split's state and stores it in fp32 for
    ``_attn_combine_kernel``."""
    # int32 row, query and key indices (a sequence's rows and keys fit int32): on sm_90 the int64
    # ones cost registers held across the block loops (stack spills around them) and int64 compares
    # in the diagonal blocks. Offsets are widened where they are formed (``.to(tl.int64)``).
    pid0 = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    if WRITE_PARTIAL:
        pid_m = pid0 // n_splits
        split = pid0 % n_splits
    else:
        # Last row tile first: a causal tile's work grows with its rows, so the longest start first
        # and the short ones fill the last wave (as the dQ kernel's query blocks). Order only: each
        # program computes the same tile, so no bit moves.
        pid_m = tl.num_programs(0) - 1 - pid0
        split = pid0 * 0
    b = pid_bh // n_kv_heads
    hk = pid_bh % n_kv_heads
    q_row0, q_tok0, len_q, k_tok0, len_k, ks, ks_ok = _seq_bounds(
        b, key_start_ptr, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, HAS_KEY_START, IS_VARLEN
    )
    n_rows = len_q * group
    row0 = pid_m * BLOCK_M
    if row0 < n_rows:
        row_ok, qi, hq, qpos, offs_d, mask_d = _tile_rows(
            row0, n_rows, len_q, len_k, hk, group, head_dim, BLOCK_M, BLOCK_D
        )

        q_base = q_ptr + b * stride_qb + q_tok0 * stride_qt
        k_base = k_ptr + b * stride_kb + k_tok0 * stride_kt + hk * stride_kh
        v_base = v_ptr + b * stride_vb + k_tok0 * stride_vt + hk * stride_vh
        q = tl.load(
            q_base + qi.to(tl.int64)[:, None] * stride_qt + hq[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None] & mask_d[None, :],
            other=0.0,
        )
        scale = tl.cast(qk_scale, tl.float32)
        last_row = tl.minimum(row0 + BLOCK_M, n_rows) - 1
        key_end = len_k - len_q + last_row // group + 1  # one past the last key any row of the tile sees
        # Blocks before full_end are seen whole by every row of the tile (its first row's query
        # position is len_k − len_q + row0 // group): no non-finite value can reach a row that does
        # not see it there.
        full_end = ks + tl.maximum(len_k - len_q + row0 // group + 1 - ks, 0) // BLOCK_N * BLOCK_N
        if WRITE_PARTIAL:
            lo = ks + split * SPLIT_N
            if lo < key_end:
                hi = tl.minimum(lo + SPLIT_N, key_end)
                m_s, l_s, acc_s = _attend_blocks(
                    q, k_base, v_base, stride_kt, stride_vt, offs_d, mask_d, qpos, lo,
                    tl.minimum(tl.maximum(full_end, lo), hi), hi, len_k, scale,
                    BLOCK_M, BLOCK_N, BLOCK_D, INPUT_PRECISION, INTERPRETED,
                )  # fmt: skip
                n_q_heads = n_kv_heads * group
                flat = q_row0 + qi
                split64 = split.to(tl.int64)
                ml = part_ml_ptr + (split64 * 2 * n_q_heads + hq) * total_q + flat
                tl.store(ml, m_s, mask=row_ok)
                tl.store(ml + n_q_heads * total_q, l_s, mask=row_ok)
                pa = part_acc_ptr + ((split64 * total_q + flat) * n_q_heads + hq) * head_dim
                tl.store(pa[:, None] + offs_d[None, :], acc_s, mask=row_ok[:, None] & mask_d[None, :])
        else:
            # The tile's key blocks, anchored at ks, in order (see the module header), merged split by
            # split.
            m_i, l_i, acc = _attend_splits(
                q, k_base, v_base, stride_kt, stride_vt, offs_d, mask_d, qpos, ks, full_end, key_end, len_k,
                scale, BLOCK_M, BLOCK_N, BLOCK_D, SPLIT_N, INPUT_PRECISION, INTERPRETED,
            )  # fmt: skip
            out, lse = _finish(m_i, l_i, acc)
            if HAS_KEY_START:  # a key_start outside [0, Tk] (validate=False): NaN rows, not a guess
                out = tl.where(ks_ok, out, float("nan"))
                lse = tl.where(ks_ok, lse, float("nan"))
            o_base = o_ptr + b * stride_ob + q_tok0 * stride_ot
            _store_rows(
                o_base,
                stride_ot,
                stride_oh,
                lse_ptr,
                total_q,
                q_row0 + qi,
                qi.to(tl.int64),
                hq,
                offs_d,
                mask_d,
                row_ok,
                out,
                lse,
            )


# ------------------------------------------------------------------------------------ launchers
_launch_fwd = FastLauncher(_attn_fwd_kernel)  # one launch per layer per decode step


def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    key_start: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    config: FwdConfig | None = None,
    heads_first: bool = False,
    split: int | None = None,
    split_decode: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward. Inputs as ``rlkernel.invariant.attention`` (validated there). Returns ``out``
    (contiguous, shaped like q, q's dtype) and ``lse2`` (fp32 ``[Hq, total query rows]``, base 2,
    +inf for rows that see no key). ``config`` overrides ``fwd_config`` for tests and tuning only.
    ``heads_first``: padded q, k, v come as ``[B, H, T, D]`` (HF's layout, read through their
    strides: no transposed views); ``out`` is ``[B, Tq, Hq, D]`` either way. ``split``: the split
    size S in keys (default ``split_keys(head_dim, dtype)``; it changes the bits of rows with more
    than S keys). ``split_decode``: ``"auto"`` | ``"always"`` | ``"never"`` (``use_split_decode``;
    same bits). ``max_seqlen_k``: packed form, a bound on the longest key sequence (sizes the
    split-decode grid; default the packed length)."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    if heads_first:
        (n_seq, hq, seqlen_q, d), (hkv, seqlen_k) = q.shape, k.shape[1:3]
        packed, total_q = False, n_seq * seqlen_q
        out = torch.empty((n_seq, seqlen_q, hq, d), dtype=q.dtype, device=q.device)
        strides = [_strides4(out, False)] + [(st[0], st[2], st[1]) for st in (t.stride() for t in (q, k, v))]
    else:
        packed, n_seq, hq, hkv, d, seqlen_q, seqlen_k, total_q = _common(
            q, k, key_start, cu_seqlens_q, max_seqlen_q
        )
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        strides = [_strides4(t, packed) for t in (out, q, k, v)]
    group = hq // hkv
    lse = torch.empty((hq, total_q), dtype=torch.float32, device=q.device)
    if n_seq == 0 or seqlen_q == 0 or total_q == 0:
        return out, lse
    cfg = config or launch_config(d, q.dtype, seqlen_q * group)
    split = split_keys(d, q.dtype) if split is None else split
    check_split_keys(split, cfg.block_n)
    if split_decode not in SPLIT_DECODE_CHOICES:
        raise ValueError(f"attention_split_decode must be one of {SPLIT_DECODE_CHOICES}: {split_decode!r}")
    if n_seq * hkv > 65535:
        raise ValueError(f"batch × kv heads = {n_seq * hkv} exceeds the 65,535 programs of grid axis 1")
    row_tiles = _cdiv(seqlen_q * group, cfg.block_m)
    # The most splits a row tile can span: its keys run from key_start (>= 0) to at most the
    # sequence's key length (packed: max_seqlen_k, or every key of the stream without it).
    max_keys = seqlen_k if not packed else (k.shape[0] if max_seqlen_k is None else max_seqlen_k)
    n_splits = max(1, _cdiv(max_keys, split))
    partial = use_split_decode(split_decode, n_splits, row_tiles * n_seq * hkv, q.device)
    dummy = lse
    if partial:
        n_part = n_splits * total_q * hq * d
        buf = torch.empty(n_part + 2 * n_splits * hq * total_q, dtype=torch.float32, device=q.device)
        part_acc, part_ml = buf[:n_part], buf[n_part:]
        grid = (row_tiles * n_splits, n_seq * hkv)
    else:
        part_acc = part_ml = dummy  # unused
        grid = (row_tiles, n_seq * hkv)
    block_d = _block_d(d)
    seq_args = (
        key_start if key_start is not None else dummy,
        cu_seqlens_q if packed else dummy,
        cu_seqlens_k if packed else dummy,
        seqlen_q,
        seqlen_k,
        hkv,
        group,
        d,
        total_q,
    )
    # enable_fp_fusion=False: no mul+add -> fma contraction, so every product and sum of the online
    # softmax and of the split merge rounds on its own, as in the reference, whatever the compiler
    # would contract, and the same in the prefill kernel and in the split-decode pair (and it is the
    # configuration verified on the H100).
    with _device_guard(q):
        _launch_fwd(
            grid,
            (out, *strides[0], lse, part_acc, part_ml, q, *strides[1], k, *strides[2], v, *strides[3],
             *seq_args, n_splits, scale * LOG2E),
            {
                "BLOCK_M": cfg.block_m,
                "BLOCK_N": cfg.block_n,
                "BLOCK_D": block_d,
                "SPLIT_N": split,
                "WRITE_PARTIAL": partial,
                "HAS_KEY_START": key_start is not None,
                "IS_VARLEN": packed,
                "INPUT_PRECISION": _precision(q.dtype),
                "INTERPRETED": interpreted(q),
            },
            {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "enable_fp_fusion": False},
        )  # fmt: skip
        if partial:
            # The combine's own row tiles: few rows per program (a decode step has G per sequence
            # and kv head); elementwise work only, so any tiling gives the same bits.
            block_mc = min(16, 1 << (seqlen_q * group - 1).bit_length())
            _launch_combine(
                (_cdiv(seqlen_q * group, block_mc), n_seq * hkv),
                (out, *strides[0], lse, part_acc, part_ml, *seq_args),
                {
                    "BLOCK_M": block_mc,
                    "BLOCK_D": block_d,
                    "SPLIT_N": split,
                    "HAS_KEY_START": key_start is not None,
                    "IS_VARLEN": packed,
                },
                {"num_warps": max(1, min(4, block_mc * block_d // 512)), "num_stages": 1,
                 "enable_fp_fusion": False},
            )  # fmt: skip
    return out, lse
