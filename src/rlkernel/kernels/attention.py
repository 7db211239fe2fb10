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

The 2026-11-21 split-KV attempt (benchmarks/NOTES.md) failed the H100 "HF adapter decode vs
prefill" check in a run whose prefill tile was 128 rows / 8 warps (now 64 / 4) and gained little
at cache 4096 (S = 1024: 4 splits). This version fixes what the issue-25 rule asks: splits at
fixed absolute positions, the merge in one helper for both kernels, exact factors for the first and
the empty splits; its bitwise claims rest on ``tests/gpu/test_attention_long.py`` (32k tokens, split
edges, both decode paths) and ``tests/gpu/test_attention.py`` passing on the target GPU.

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
    * Split-decode runs when some row spans two splits or more and the one-pass grid is smaller
      than the SM count (``"auto"``): B = 1, Hkv = 8, cache 32k: 16 splits × 8 = 128 programs of 32
      blocks instead of 8 programs of 512. Its partials cost ⌈T/S⌉·rows·(D + 2)·4 bytes (B = 1,
      Hq = 32, D = 128, 32k: 266 KB).
    * FP contraction is off in the forward kernels: c·(q·k) − m is a multiply and a subtract
      rather than one fma (slightly more ALU work per score; the MMAs and exp2 dominate).
    * fp32 inputs use IEEE fp32 dots (no tf32): accuracy over speed for the fp32 path.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from rlkernel._dispatch import interpreter_enabled
from rlkernel.kernels._dot import dot, interpreted
from rlkernel.kernels._launch import FastLauncher, num_sms
from rlkernel.kernels._launch import cdiv as _cdiv
from rlkernel.kernels._launch import device_guard as _device_guard
from rlkernel.kernels._reduce import is_nonfinite

# Whether the kernels below run in the CPU interpreter: fixed when they are decorated (Triton reads
# TRITON_INTERPRET then), so read once here rather than from the environment on every launch.
_INTERPRET = interpreter_enabled()

LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    """Forward launch configuration. It sets the order of every sum of a row, so it must depend on
    (head_dim, dtype) only, never on the batch, the sequence lengths or the number of queries."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=64)
def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def fwd_config(head_dim: int, dtype: torch.dtype) -> FwdConfig:
    """The one forward configuration for (head_dim, dtype). BLOCK_N = 64 matches the reference's
    key blocks. Chosen for the H100 (D ≤ 128, 16-bit: BLOCK_M = 64 at 4 warps, measured fastest and
    bitwise equal to 128 at 8 warps; fp16 has no decode tiles, so any fixed tile is invariant)."""
    return _fwd_config(_block_d(head_dim), dtype, _INTERPRET)


@functools.lru_cache(maxsize=64)
def _fwd_config(d: int, dtype: torch.dtype, interpret: bool) -> FwdConfig:
    # Cached: a pure function of its arguments (saves host time per call).
    if interpret:  # the CPU interpreter: small tiles run faster; still fixed per mode
        return FwdConfig(16, 16, 1, 1)
    if dtype == torch.float32:
        return FwdConfig(64, 32 if d > 64 else 64, 4, 2)
    if d <= 64:
        return FwdConfig(128, 64, 4, 3)
    if d <= 128:
        # BM = 64 / 4 warps: bitwise equal to the former BM = 128 / 8 warps on an H100 (bf16) and
        # 0.864 vs 1.080 ms at B=8 T=2048 (SDPA 0.927), gpu_check_attention_h100_2026-11-21_final.log.
        return FwdConfig(64, 64, 4, 3)
    return FwdConfig(64, 32, 4, 2)


# Decode-only tiles: (block_d, dtype) -> (block_m, num_warps) for calls whose rows fit one such tile
# (seqlen_q·G ≤ block_m). EMPTY on purpose. (128, bf16) -> (16, 4) passed the short "decode BLOCK_M
# alternatives" comparison on an H100 but FAILED the full check on 2026-11-21 ("decode tile ==
# prefill tile": lse and outputs differ at positions 63, 64, 750, 1498, 1499;
# gpu_check_attention_h100_2026-11-21_decode_tile.log): with BLOCK_M = 16 the dots lower to mma.sync
# instead of the wgmma of the >= 64-row prefill tile, and the two accumulate differently for some
# inputs. A tile is allowed here only if the full check passes on the target GPU.
DECODE_TILES: dict[tuple[int, torch.dtype], tuple[int, int]] = {}


def launch_config(head_dim: int, dtype: torch.dtype, rows_per_seq: int) -> FwdConfig:
    """``fwd_config``, or a verified decode tile (``DECODE_TILES``) when every sequence's rows fit it."""
    cfg = fwd_config(head_dim, dtype)
    tile = DECODE_TILES.get((_block_d(head_dim), dtype))
    if tile is not None and rows_per_seq <= tile[0]:
        return FwdConfig(tile[0], cfg.block_n, tile[1], cfg.num_stages)
    return cfg


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _strides4(t: torch.Tensor, packed: bool) -> tuple[int, int, int]:
    """(batch, token, head) strides; the packed form [N, H, D] has batch stride 0."""
    st = t.stride()  # one call (each .stride(i) is a separate call into C++)
    return (0, st[0], st[1]) if packed else (st[0], st[1], st[2])


# ------------------------------------------------------------------------------------- kernels
@triton.jit
def _seq_bounds(
    b,
    key_start_ptr,
    cu_q_ptr,
    cu_k_ptr,
    seqlen_q,
    seqlen_k,
    HAS_KEY_START: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """(q_row0, q_tok0, len_q, k_tok0, len_k, key_start, key_start_ok) of sequence ``b``: its first
    row in the flat [total query rows] space of the LSE/delta, its first query and key token in the
    packed tensors (0 for the padded form, addressed through the batch stride instead), its lengths,
    its first valid key clamped to [0, len_k] (so that no key outside the sequence is ever read, even
    for a ``key_start`` the caller did not validate) and whether it was in range unclamped."""
    if IS_VARLEN:
        q_tok0 = tl.load(cu_q_ptr + b).to(tl.int64)
        len_q = (tl.load(cu_q_ptr + b + 1) - q_tok0).to(tl.int32)
        k_tok0 = tl.load(cu_k_ptr + b).to(tl.int64)
        len_k = (tl.load(cu_k_ptr + b + 1) - k_tok0).to(tl.int32)
        q_row0 = q_tok0
        ks = 0
        ks_ok = True
    else:
        q_row0 = b * seqlen_q
        q_tok0 = b * 0
        k_tok0 = b * 0
        len_q = seqlen_q
        len_k = seqlen_k
        if HAS_KEY_START:
            ks_given = tl.load(key_start_ptr + b).to(tl.int64)
            ks_ok = (ks_given >= 0) & (ks_given <= len_k)
            ks = tl.minimum(tl.maximum(ks_given, 0), len_k).to(tl.int32)
        else:
            ks = 0
            ks_ok = True
    return q_row0, q_tok0, len_q, k_tok0, len_k, ks, ks_ok


@triton.jit
def _non_finite(x):
    """``(x with its NaN/±Inf entries read as 0, [rows] flag: the row had one)``. Finite entries keep
    their bits."""
    bad = is_nonfinite(x)
    return tl.where(bad, tl.zeros_like(x), x), tl.max(bad.to(tl.int32), 1) > 0


@triton.jit
def _merge(m_run, l_run, acc_run, m_s, l_s, acc_s):
    """Merge one split's state (m, l, acc) into the running total: the one merge of the prefill
    (``_attend_splits``) and of the split-decode combine (``_attn_combine_kernel``), so that a row
    takes the same sums in the same order whichever kernel computes it (both launched without FP
    contraction: every product and sum below rounds on its own in both).

        m' = max(M, m);  μ = m' (0 if −inf);  a = 2^(M − μ);  b = 2^(m − μ)
        L' = a·L + b·l;  A' = a·A + b·acc

    Two cases take exact factors instead of 2^(…): a row that has merged nothing yet (L = 0: the
    first split) gets (a, b) = (0, 1), so L' = l and A' = acc, and a row with at most SPLIT_N keys
    keeps the one-level bits; a split that holds no key the row sees (l = 0: a prefill tile reaches
    past a row's last split, a decode does not) gets (1, 0), an exact no-op. A NaN/Inf of such a
    split's acc (a non-finite value of a key the row sees with score −inf) still reaches A' as
    NaN (·0), as the one-level loop would carry it. A NaN l (a NaN score the row sees) is neither
    case: it poisons L."""
    m_new = tl.maximum(m_run, m_s)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: 2^(−inf) = 0
    first = l_run == 0.0
    empty = l_s == 0.0
    alpha = tl.where(first, 0.0, tl.where(empty, 1.0, tl.math.exp2(m_run - m_use)))
    beta = tl.where(first, 1.0, tl.where(empty, 0.0, tl.math.exp2(m_s - m_use)))
    m_out = tl.where(first, m_s, tl.where(empty, m_run, m_new))
    l_out = l_run * alpha + l_s * beta
    acc_out = acc_run * alpha[:, None] + acc_s * beta[:, None]
    return m_out, l_out, acc_out


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
    keys = start + tl.arange(0, BLOCK_N)
    if DIAGONAL:
        kv_ok = (keys < len_k)[:, None] & mask_d[None, :]
    else:
        kv_ok = mask_d[None, :]  # the d mask alone, broadcast over the keys
    k = tl.load(k_base + keys[:, None] * stride_kt + offs_d[None, :], mask=kv_ok, other=0.0)
    v = tl.load(v_base + keys[:, None] * stride_vt + offs_d[None, :], mask=kv_ok, other=0.0)
    s = dot(q, tl.trans(k), None, INPUT_PRECISION, INTERPRETED)
    visible = keys[None, :] <= qpos[:, None]
    if DIAGONAL:
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
    """The state (m, l, acc) continued over the key blocks [lo, lo+BN), … below ``hi``, in order."""
    for start in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            m_i, l_i, acc, q, k_base, v_base, stride_kt, stride_vt, offs_d, mask_d, qpos, start, len_k,
            scale, BLOCK_N, INPUT_PRECISION, INTERPRETED, DIAGONAL,
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _fresh(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The state before any key: m = −inf, l = 0, acc = 0."""
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    return m_i, tl.zeros((BLOCK_M,), tl.float32), tl.zeros((BLOCK_M, BLOCK_D), tl.float32)


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
def _finish(m_i, l_i, acc):
    """(out, lse2) of a final state: acc / l, m + log2 l; 0 and +inf for rows that see no key (l = 0;
    a NaN l, from a NaN score the row sees, is not that: the row stays NaN). A row whose acc is not
    finite in some column (a NaN/Inf value it sees) is NaN as a whole, wherever that value's block
    fell (see the module header)."""
    has_keys = l_i != 0.0
    safe_l = tl.where(has_keys, l_i, 1.0)
    out = tl.where(has_keys[:, None], acc / safe_l[:, None], 0.0)
    seen_bad = tl.max(((acc != acc) | (tl.abs(acc) == float("inf"))).to(tl.int32), 1) > 0
    out = tl.where(seen_bad[:, None], float("nan"), out)
    lse = tl.where(has_keys, m_i + tl.math.log2(safe_l), float("inf"))
    return out, lse


@triton.jit
def _store_rows(
    o_base, stride_ot, stride_oh, lse_ptr, total_q, flat, qi, hq, offs_d, mask_d, row_ok, out, lse
):
    """Store a tile's output rows (rounded to the output dtype) and their lse2."""
    tl.store(
        o_base + qi[:, None] * stride_ot + hq[:, None] * stride_oh + offs_d[None, :],
        out.to(o_base.dtype.element_ty),
        mask=row_ok[:, None] & mask_d[None, :],
    )
    tl.store(lse_ptr + hq * total_q + flat, lse, mask=row_ok)


@triton.jit
def _tile_rows(row0, n_rows, len_q, len_k, hk, group, head_dim, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The rows of a tile starting at row ``row0`` of a (sequence, kv head): ``(row_ok, qi, hq,
    qpos, offs_d, mask_d)`` — row r is query r // G and q head hk·G + r % G, ``qpos`` the key
    position of its query (bottom-right alignment: the last query sees the last key)."""
    rows = row0 + tl.arange(0, BLOCK_M)
    qi = rows // group
    offs_d = tl.arange(0, BLOCK_D)
    return rows < n_rows, qi, hk * group + rows % group, len_k - len_q + qi, offs_d, offs_d < head_dim


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
    pid0 = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    if WRITE_PARTIAL:
        pid_m = pid0 // n_splits
        split = pid0 % n_splits
    else:
        pid_m = pid0
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
            q_base + qi[:, None] * stride_qt + hq[:, None] * stride_qh + offs_d[None, :],
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
                ml = part_ml_ptr + (split * 2 * n_q_heads + hq) * total_q + flat
                tl.store(ml, m_s, mask=row_ok)
                tl.store(ml + n_q_heads * total_q, l_s, mask=row_ok)
                pa = part_acc_ptr + ((split * total_q + flat) * n_q_heads + hq) * head_dim
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
                qi,
                hq,
                offs_d,
                mask_d,
                row_ok,
                out,
                lse,
            )


@triton.jit
def _load_split(ml, acc_ptrs, s, n_split_row, row_ok, mask_d, split_ml, split_acc):
    """Split ``s``'s stored state of the rows that see a key in it (the others read the empty state
    −inf, 0, 0, which ``_merge`` leaves as a no-op)."""
    ok = row_ok & (s < n_split_row)
    m_s = tl.load(ml + s * split_ml, mask=ok, other=float("-inf"))
    l_s = tl.load(ml + s * split_ml + split_ml // 2, mask=ok, other=0.0)
    acc_s = tl.load(acc_ptrs + s * split_acc, mask=ok[:, None] & mask_d[None, :], other=0.0)
    return m_s, l_s, acc_s


@triton.jit
def _attn_combine_kernel(
    o_ptr,
    stride_ob,
    stride_ot,
    stride_oh,
    lse_ptr,
    part_acc_ptr,
    part_ml_ptr,
    key_start_ptr,
    cu_q_ptr,
    cu_k_ptr,
    seqlen_q,
    seqlen_k,
    n_kv_heads,
    group,
    head_dim,
    total_q,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_N: tl.constexpr,
    HAS_KEY_START: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """Split-decode, second pass: each row merges its splits' stored states in split order with
    ``_merge`` (the prefill loop's merge, from the same fresh state) and writes out and lse2 with
    ``_finish``. A row merges the splits that hold a key it sees (those its partial tile wrote);
    the prefill's later splits are empty for it, exact no-ops there. Its own row tiling (no dot
    here: every operation is elementwise, so the tile shape does not change a bit)."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
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
        n_q_heads = n_kv_heads * group
        flat = q_row0 + qi
        # Splits of each row: those that start at or before its query's key position.
        n_split_row = tl.where(row_ok & (qpos >= ks), (qpos - ks) // SPLIT_N + 1, 0)
        n_split = tl.max(n_split_row, 0)
        split_ml = 2 * n_q_heads * total_q  # one split's (m, l) block; l is its second half
        split_acc = total_q * n_q_heads * head_dim
        ml = part_ml_ptr + hq * total_q + flat
        acc_ptrs = part_acc_ptr + ((flat * n_q_heads + hq) * head_dim)[:, None] + offs_d[None, :]
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        # Four splits' loads are issued before their four merges (in order): the merge chain waits
        # on one load latency per four splits, not per split.
        for s in range(0, n_split, 4):
            m0, l0, a0 = _load_split(ml, acc_ptrs, s, n_split_row, row_ok, mask_d, split_ml, split_acc)
            m1, l1, a1 = _load_split(ml, acc_ptrs, s + 1, n_split_row, row_ok, mask_d, split_ml, split_acc)
            m2, l2, a2 = _load_split(ml, acc_ptrs, s + 2, n_split_row, row_ok, mask_d, split_ml, split_acc)
            m3, l3, a3 = _load_split(ml, acc_ptrs, s + 3, n_split_row, row_ok, mask_d, split_ml, split_acc)
            m_i, l_i, acc = _merge(m_i, l_i, acc, m0, l0, a0)
            m_i, l_i, acc = _merge(m_i, l_i, acc, m1, l1, a1)
            m_i, l_i, acc = _merge(m_i, l_i, acc, m2, l2, a2)
            m_i, l_i, acc = _merge(m_i, l_i, acc, m3, l3, a3)
        out, lse = _finish(m_i, l_i, acc)
        if HAS_KEY_START:
            out = tl.where(ks_ok, out, float("nan"))
            lse = tl.where(ks_ok, lse, float("nan"))
        o_base = o_ptr + b * stride_ob + q_tok0 * stride_ot
        _store_rows(
            o_base, stride_ot, stride_oh, lse_ptr, total_q, flat, qi, hq, offs_d, mask_d, row_ok, out, lse
        )


# ------------------------------------------------------------------------------------ launchers
def _common(q, k, key_start, cu_seqlens_q, max_seqlen_q):
    packed = cu_seqlens_q is not None
    n_q_heads, n_kv_heads, head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
    if packed:
        n_seq = cu_seqlens_q.numel() - 1
        seqlen_q, seqlen_k, total_q = int(max_seqlen_q), 0, q.shape[0]
    else:
        n_seq, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        total_q = n_seq * seqlen_q
    return packed, n_seq, n_q_heads, n_kv_heads, head_dim, seqlen_q, seqlen_k, total_q


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # "tf32" is ignored for 16-bit inputs


_launch_fwd = FastLauncher(_attn_fwd_kernel)  # one launch per layer per decode step
_launch_combine = FastLauncher(_attn_combine_kernel)

SPLIT_DECODE_CHOICES = ("auto", "always", "never")
MAX_SPLIT_KEYS = 1 << 30  # ks + SPLIT_N stays below 2^31 (the kernels' int32 key positions)


def split_keys(head_dim: int, dtype: torch.dtype) -> int:
    """The default split size S (keys) for (head_dim, dtype): part of the formula, like BLOCK_N (a
    row with more than S keys merges S-key splits; see the module header). 2048 for every
    (head_dim, dtype): a multiple of every forward BLOCK_N (16 in the interpreter, 32 and 64 on the
    GPU); the reference's ``SPLIT_KEYS`` follows it. Why 2048: a decode step at batch 1 against a
    cache of T keys runs T / 2048 programs per kv head (B = 1, Hkv = 8: 32 at 8k, 128 at 32k, about
    one per SM of an H100), while the prefill pays, per split of 32 key blocks, one merge and one
    software-pipeline restart (~770 instructions per thread on sm_90 against ~680 per key block:
    +3.5 % instructions for the rows past the first split; 1024 would double that)."""
    return 2048


def check_split_keys(split: int, block_n: int) -> None:
    """``split`` (the option ``attention_split_keys``) is a positive multiple of ``block_n`` (the
    key block it is cut into) and at most ``MAX_SPLIT_KEYS``."""
    if isinstance(split, bool) or not isinstance(split, int) or split < 1 or split > MAX_SPLIT_KEYS:
        raise ValueError(f"attention_split_keys must be an int in [1, 2^30], got {split!r}")
    if split % block_n:
        raise ValueError(
            f"attention_split_keys ({split}) must be a multiple of the attention key block BLOCK_N "
            f"({block_n} here)"
        )


def use_split_decode(mode: str, n_splits: int, programs: int, device: torch.device) -> bool:
    """Whether a call runs as split-decode (split partials, then the combine kernel) instead of the
    one-pass kernel. Speed only: both compute the same splits and merge them in the same order
    (``_merge``), so the bits do not depend on it. ``"auto"``: when some row spans two splits or
    more and the one-pass grid (``programs`` row tiles × sequences × kv heads) would leave SMs idle
    (decode at small batch; a large batch already fills the GPU, and its partials would cost
    memory for nothing)."""
    if mode == "never":
        return False
    if mode == "always":
        return True
    return n_splits > 1 and programs < num_sms(device, interpreter=4)


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
