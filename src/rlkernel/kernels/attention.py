"""Triton forward kernel of batch-invariant causal GQA attention, and helpers shared with the backward.

Forward math and block order: see ``rlkernel.reference.attention`` (the oracle) and
``rlkernel.invariant.attention`` (why it is invariant). In short, for a row = (query at key position
p, q head h) of a sequence whose first real key is s, with c = scale·log2 e (one fp32 constant), a
one-level online softmax over key blocks of BN = BLOCK_N keys anchored at s:

    (m, l, acc) = (−inf, 0, 0)
    for key blocks [s + j·BN, s + (j+1)·BN), j = 0, 1, … (all masked alike):  (``_attend_blocks``)
        t = where(key ≤ p, c·(q·kᵀ), −inf);  m' = max(m, rowmax t);  α = 2^(m − m');  P = 2^(t − m')
        l = α·l + rowsum P;   acc = α·acc + P·V
    out = acc / l,   lse2 = m + log2 l (saved for backward; +inf for rows that see no key)    (``_finish``)

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
(``_finish`` tests l ≠ 0, not l > 0, so it is not taken for a row that sees no key).

One kernel runs prefill, chunked prefill and decode (a decode step is the prefill kernel with only
its last query's rows active). A block that a row's mask fully hides is an exact no-op for that row
(α = 1, P = 0), so how far a tile's other rows reach changes nothing. The kernel is launched with
``enable_fp_fusion=False``: no mul+add → fma contraction, so c·(q·k) − m and the rescalings round
as written, like the reference's separately rounded ops (the configuration verified on the H100).

Rows are (query, q head of the GQA group) pairs: row r of a (sequence, kv head) program covers
query r // G and q head kv·G + r % G, so each K/V block is loaded once for the G heads that share it.
The deterministic backward lives in ``rlkernel.kernels.attention_bwd`` and shares this module's
helpers (sequence bounds, strides, operand handling); it recomputes P from the saved lse2.

Memory traffic (forward, bf16, B·T tokens, causal): Q and O once, K/V once per query tile per group;
FLOPs 2·2·B·Hq·T²·D/2. Decode reads the whole K/V cache once per (sequence, kv head).

Why one level (one program per row over all its keys): a split-KV variant, splits merged in a fixed
order to spread a decode row over several programs, broke decode == prefill bitwise on the H100 and
gained almost nothing (benchmarks/NOTES.md, 2026-11-21).

Provenance: FlashAttention-2 (Dao 2023) and the Triton fused-attention tutorial, written anew here
with the key-block anchoring, the single masked loop and the fixed configuration that invariance
needs.

Caveats:
    * One launch configuration per (head_dim, dtype) for forward (prefill and decode alike), plus
      decode tiles proven bitwise equal on the GPU (``DECODE_TILES``, empty): it fixes the bits.
      The backward is free to differ.
    * BLOCK_N is part of the formula: changing it changes the bits of every row with more than
      BLOCK_N keys (consistently on all paths; the reference's BLOCK_N follows the 16-bit GPU one).
    * Decode at small batch has little parallelism: one program per (sequence, kv head), each
      walking the whole cache (B=1, cache 4096, Hkv 8: 8 programs of 64 blocks; 0.20 ms vs SDPA's
      0.07 ms on the H100).
    * FP contraction is off in the forward kernel: c·(q·k) − m is a multiply and a subtract
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
from rlkernel.kernels._launch import FastLauncher
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
    """One key block [start, start + BN) of the online softmax (see ``_attend_blocks``)."""
    keys = start + tl.arange(0, BLOCK_N)
    kv_ok = (keys < len_k)[:, None] & mask_d[None, :]
    k = tl.load(k_base + keys[:, None] * stride_kt + offs_d[None, :], mask=kv_ok, other=0.0)
    v = tl.load(v_base + keys[:, None] * stride_vt + offs_d[None, :], mask=kv_ok, other=0.0)
    s = dot(q, tl.trans(k), None, INPUT_PRECISION, INTERPRETED)
    visible = keys[None, :] <= qpos[:, None]
    t = tl.where(visible, s * scale, float("-inf"))
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
    ``hi``, every block masked alike (keys ≥ ``len_k`` read zeros, keys after a row's query get −inf).
    The blocks below ``mid`` are seen whole by every row of the tile; the others (the tile's
    diagonal) also read V's non-finite entries as 0 and make NaN the outputs that see one (see the
    module header). Same arithmetic, same order, either way. Returns the rows' (m, l, acc): running
    max, sum of 2^(t − m) and Σ P·V, all fp32."""
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start in range(lo, mid, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            m_i, l_i, acc, q, k_base, v_base, stride_kt, stride_vt, offs_d, mask_d, qpos, start, len_k,
            scale, BLOCK_N, INPUT_PRECISION, INTERPRETED, False,
        )  # fmt: skip
    for start in range(mid, hi, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            m_i, l_i, acc, q, k_base, v_base, stride_kt, stride_vt, offs_d, mask_d, qpos, start, len_k,
            scale, BLOCK_N, INPUT_PRECISION, INTERPRETED, True,
        )  # fmt: skip
    return m_i, l_i, acc


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
def _attn_fwd_kernel(
    # outputs
    o_ptr,
    stride_ob,
    stride_ot,
    stride_oh,
    lse_ptr,  # fp32 [Hq, total query rows]
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
    # runtime scalars
    qk_scale,
    # meta
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_KEY_START: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
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
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        qi = rows // group
        hq = hk * group + rows % group
        qpos = len_k - len_q + qi  # key position of each row's query (bottom-right alignment)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < head_dim

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
        # The tile's key blocks, anchored at ks, in order, all masked alike (see the module header).
        m_i, l_i, acc = _attend_blocks(
            q, k_base, v_base, stride_kt, stride_vt, offs_d, mask_d, qpos, ks, full_end, key_end, len_k,
            scale, BLOCK_M, BLOCK_N, BLOCK_D, INPUT_PRECISION, INTERPRETED,
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
    config: FwdConfig | None = None,
    heads_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward. Inputs as ``rlkernel.invariant.attention`` (validated there). Returns ``out``
    (contiguous, shaped like q, q's dtype) and ``lse2`` (fp32 ``[Hq, total query rows]``, base 2,
    +inf for rows that see no key). ``config`` overrides ``fwd_config`` for tests and tuning only.
    ``heads_first``: padded q, k, v come as ``[B, H, T, D]`` (HF's layout, read through their
    strides: no transposed views); ``out`` is ``[B, Tq, Hq, D]`` either way."""
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
    if n_seq * hkv > 65535:
        raise ValueError(f"batch × kv heads = {n_seq * hkv} exceeds the 65,535 programs of grid axis 1")
    row_tiles = _cdiv(seqlen_q * group, cfg.block_m)
    dummy = lse
    # enable_fp_fusion=False: no mul+add -> fma contraction, so every product and sum of the online
    # softmax rounds on its own, as in the reference, whatever the compiler would contract (and it
    # is the configuration verified on the H100).
    with _device_guard(q):
        _launch_fwd(
            (row_tiles, n_seq * hkv),
            (
                out,
                *strides[0],
                lse,
                q,
                *strides[1],
                k,
                *strides[2],
                v,
                *strides[3],
                key_start if key_start is not None else dummy,
                cu_seqlens_q if packed else dummy,
                cu_seqlens_k if packed else dummy,
                seqlen_q,
                seqlen_k,
                hkv,
                group,
                d,
                total_q,
                scale * LOG2E,
            ),  # fmt: skip
            {
                "BLOCK_M": cfg.block_m,
                "BLOCK_N": cfg.block_n,
                "BLOCK_D": _block_d(d),
                "HAS_KEY_START": key_start is not None,
                "IS_VARLEN": packed,
                "INPUT_PRECISION": _precision(q.dtype),
                "INTERPRETED": interpreted(q),
            },
            {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "enable_fp_fusion": False},
        )
    return out, lse
