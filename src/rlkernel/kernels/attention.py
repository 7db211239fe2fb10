"""Triton forward kernel of batch-invariant causal GQA attention, and helpers shared with the backward.

Forward math and block order: see ``rlkernel.reference.attention`` (the oracle) and
``rlkernel.invariant.attention`` (why it is invariant). In short, for a row = (query at key position
p, q head h) of a sequence whose first real key is s, with c = scale·log2 e (one fp32 constant), a
two-level online softmax over splits of S = ``SPLIT_N`` keys anchored at s:

    (M, L, A) = (−inf, 0, 0)
    for splits [s + i·S, s + (i+1)·S), i = 0, 1, …:                               (``_split_state``)
        (m, l, acc) = (−inf, 0, 0)
        for key blocks [s + i·S + j·BN, …), j = 0, 1, … (one loop, every block masked alike):
            t = where(key ≤ p, c·(q·kᵀ), −inf);  m' = max(m, rowmax t);  α = 2^(m − m');  P = 2^(t − m')
            l = α·l + rowsum P;   acc = α·acc + P·V
        M' = max(M, m); μ = M' (0 if −inf); a = 2^(M − μ); b = 2^(m − μ)                    (``_merge``)
        L = a·L + b·l;   A = a·A + b·acc
    out = A / L,   lse2 = M + log2 L (saved for backward; +inf for rows that see no key)  (``_finish``)

Two ways to run it, same bits: one pass (prefill, chunked prefill, large-batch decode: a program
walks its splits in order and merges after each), or split-decode (``use_split_decode``: one program
per (row tile, sequence, kv head, split) writes its split's fp32 (m, l, acc), then
``_attn_merge_kernel`` merges them in split order). Both kernels call the same three helpers and are
launched with ``enable_fp_fusion=False``: with no mul+add → fma contraction, each helper's
per-element arithmetic rounds identically in either kernel (a contraction decision could otherwise
differ between the two compiled kernels). A split or block that a row's mask fully hides is an exact
no-op for that row (α = a = 1, P = b = 0), so how far a tile's other rows reach changes nothing.

Rows are (query, q head of the GQA group) pairs: row r of a (sequence, kv head) program covers
query r // G and q head kv·G + r % G, so each K/V block is loaded once for the G heads that share it.
The deterministic backward lives in ``rlkernel.kernels.attention_bwd`` and shares this module's
helpers (sequence bounds, strides, operand handling); it recomputes P from the saved lse2, which is
the row's exact log-sum-exp whichever formula produced it.

Memory traffic (forward, bf16, B·T tokens, causal): Q and O once, K/V once per query tile per group;
FLOPs 2·2·B·Hq·T²·D/2. Decode reads the whole K/V cache once per (sequence, kv head); split-decode
adds fp32 partials of (splits × rows × D) written once and read once by the merge kernel.

Production status (2026-11-22): the two-level path is DISABLED. ``SPLIT_N`` = 2^30, so every real
call is one split: the formula is the one-level online softmax (one loop of key blocks anchored at
s, then out = acc / l), split-decode is never dispatched and the padded and packed forms take the
``ONE_SPLIT`` loop. Why: with SPLIT_N = 1024 the H100 check failed "HF adapter decode vs prefill:
NOT equal: seq0 back3" (benchmarks/results/gpu_check_attention_h100_2026-11-21_split.log), split
decode gained almost nothing (B=1: 0.179 vs 0.193 ms) and the two-level prefill was slower (1.247
vs 1.114 ms one split, B=8 T=2048). The two-level code and its CPU tests (which monkeypatch a
small SPLIT_N) stay, but no production call reaches them; do not lower SPLIT_N without a GPU
re-check of that adapter case.

Provenance: FlashAttention-2 (Dao 2023) and the Triton fused-attention tutorial, written anew here
with the key-block anchoring, the single masked loop and the fixed configuration that invariance
needs.

Caveats:
    * One launch configuration per (head_dim, dtype) for forward (prefill and decode alike), plus
      decode tiles proven bitwise equal on the GPU (``DECODE_TILES``): it fixes the bits. The
      backward is free to differ.
    * ``SPLIT_N`` (2^30 in production: the two-level path is off, see above) is part of the
      formula, like BLOCK_N: changing it changes every row with more than S keys (consistently on
      all paths; the reference's SPLIT_N must follow).
    * Split-decode parallelism at batch 1, cache 4096, Hkv 8: 8·4 = 32 programs of 16 blocks each
      (the one-pass kernel: 8 programs of 64 blocks). Not measured here (no GPU); the GPU script
      times split on/off and other SPLIT_N values. The dispatch rule (split when the one-pass grid
      has fewer programs than the GPU has SMs) is a guess to be tuned with those timings.
    * The one-pass kernel carries a second fp32 accumulator (the merged A) across each split's
      loop, and the software pipeline restarts at each split boundary (every S / BN = 16 blocks).
      An sm_90 compile with Triton 3.9's ptxas (no GPU run) of the BLOCK_M = 128 / 8-warp tile
      spills inside the key loop (39 stores, 87 loads of local memory per iteration; none in the
      one-level loop; none at BLOCK_M = 64 / 4 warps). Calls whose keys all fit one split
      (padded form, Tk ≤ SPLIT_N) take the ``ONE_SPLIT`` loop, bit for bit the same (its one
      merge would be exact), without the second accumulator. The GPU script times the two-level
      prefill against the one-level loop (row "S=1048576") and at other tiles.
    * FP contraction is off in the forward kernels: c·(q·k) − m is a multiply and a subtract
      rather than one fma (slightly more ALU work per score; the MMAs and exp2 dominate).
    * fp32 inputs use IEEE fp32 dots (no tf32): accuracy over speed for the fp32 path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import triton
import triton.language as tl

from rlkernel._dispatch import interpreter_enabled

LOG2E = 1.4426950408889634


# Keys per split of the two-level online softmax (see the module header): a constant, a multiple of
# every forward BLOCK_N, never a function of the batch, the cache length or the number of queries.
# It is part of the formula (like BLOCK_N): the reference's SPLIT_N must match for the CPU path to
# give the kernel's bits. Tests monkeypatch a small value to exercise several splits.
# 2^30: every real call is one split (the two-level path is disabled after the 2026-11-21 H100
# adapter failure, see the module header); still < 2^31, so ks + SPLIT_N fits the kernels' int32.
SPLIT_N = 1 << 30

# Split-decode dispatch: "auto" (split when the row-tile grid leaves SMs idle), "always" or "never".
# Any choice gives the same bits (every path computes the same two-level formula); tests and the
# GPU check force both.
SPLIT_DECODE = "auto"


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    """Forward launch configuration. It sets the order of every sum of a row, so it must depend on
    (head_dim, dtype) only, never on the batch, the sequence lengths or the number of queries."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _cdiv(a: int, b: int) -> int:
    # Host-side ceil division of Python ints. ``triton.cdiv`` is a ConstexprFunction in recent
    # Triton (argument unwrapping on every call: ~1-6 us of host time each), too slow per launch.
    return -(-a // b)


@functools.lru_cache(maxsize=64)
def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def fwd_config(head_dim: int, dtype: torch.dtype) -> FwdConfig:
    """The one forward configuration for (head_dim, dtype). BLOCK_N = 64 matches the reference's
    key blocks. Chosen for the H100 (D ≤ 128, 16-bit: BLOCK_M = 64 at 4 warps, measured fastest and
    bitwise equal to 128 at 8 warps; fp16 has no decode tiles, so any fixed tile is invariant)."""
    return _fwd_config(_block_d(head_dim), dtype, interpreter_enabled())


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
        # 0.937 vs 1.247 ms at B=8 T=2048 (SDPA 0.904), gpu_check_attention_h100_2026-11-21_split.log.
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


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a nominal few "SMs"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def use_split_decode(n_programs: int, seqlen_k: int, device: torch.device, packed: bool) -> bool:
    """Whether a call runs as split-decode (partials + merge kernel) instead of one pass. Bits do not
    depend on it. Padded form only (the grid needs the longest cache without a host sync)."""
    if packed or seqlen_k <= SPLIT_N or SPLIT_DECODE == "never":
        return False
    return SPLIT_DECODE == "always" or n_programs < _sm_count(device)


def _device_guard(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _strides4(t: torch.Tensor, packed: bool) -> tuple[int, int, int]:
    """(batch, token, head) strides; the packed form [N, H, D] has batch stride 0."""
    st = t.stride()  # one call (each .stride(i) is a separate call into C++)
    return (0, st[0], st[1]) if packed else (st[0], st[1], st[2])


# ------------------------------------------------------------------------------------- kernels
@triton.jit
def _operand(x, UPCAST: tl.constexpr):
    """A dot operand: itself, or fp32 under the interpreter workaround (see ``_upcast_dots``)."""
    if UPCAST:
        x = x.to(tl.float32)
    return x


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
    """(q_row0, q_tok0, len_q, k_tok0, len_k, key_start) of sequence ``b``: its first row in the
    flat [total query rows] space of the LSE/delta, its first query and key token in the packed
    tensors (0 for the padded form, addressed through the batch stride instead), its lengths and its
    first valid key."""
    if IS_VARLEN:
        q_tok0 = tl.load(cu_q_ptr + b).to(tl.int64)
        len_q = (tl.load(cu_q_ptr + b + 1) - q_tok0).to(tl.int32)
        k_tok0 = tl.load(cu_k_ptr + b).to(tl.int64)
        len_k = (tl.load(cu_k_ptr + b + 1) - k_tok0).to(tl.int32)
        q_row0 = q_tok0
        ks = 0
    else:
        q_row0 = b * seqlen_q
        q_tok0 = b * 0
        k_tok0 = b * 0
        len_q = seqlen_q
        len_k = seqlen_k
        if HAS_KEY_START:
            ks = tl.load(key_start_ptr + b).to(tl.int32)
        else:
            ks = 0
    return q_row0, q_tok0, len_q, k_tok0, len_k, ks


@triton.jit
def _split_state(
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Online softmax from a fresh state over the key blocks [lo, lo+BN), … below ``hi`` (one split).
    Returns the split's (m, l, acc). One helper for the prefill and the split-decode kernels."""
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        keys = start + offs_n
        kv_ok = (keys < len_k)[:, None] & mask_d[None, :]
        k = tl.load(k_base + keys[:, None] * stride_kt + offs_d[None, :], mask=kv_ok, other=0.0)
        k = _operand(k, UPCAST)
        v = tl.load(v_base + keys[:, None] * stride_vt + offs_d[None, :], mask=kv_ok, other=0.0)
        v = _operand(v, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        t = tl.where(keys[None, :] <= qpos[:, None], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(t, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: 2^(−inf) = 0
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(t - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(_operand(p.to(v_base.dtype.element_ty), UPCAST), v, acc, input_precision=INPUT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _merge(m_run, l_run, acc_run, m_s, l_s, acc_s):
    """Merge a split's (m, l, acc) into the running state: the one merge formula of the prefill
    and the split-decode merge kernel (launched with FP contraction off, so it rounds alike)."""
    m_new = tl.maximum(m_run, m_s)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_run - m_use)
    beta = tl.math.exp2(m_s - m_use)
    l_new = l_run * alpha + l_s * beta
    acc_new = acc_run * alpha[:, None] + acc_s * beta[:, None]
    return m_new, l_new, acc_new


@triton.jit
def _finish(m_i, l_i, acc):
    """(out, lse2) of a merged state: acc / l, m + log2 l; 0 and +inf for rows that see no key."""
    has_keys = l_i > 0.0
    safe_l = tl.where(has_keys, l_i, 1.0)
    out = tl.where(has_keys[:, None], acc / safe_l[:, None], 0.0)
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
    part_ml_ptr,  # WRITE_PARTIAL: fp32 [n_splits, 2, Hq, total query rows] (m, l)
    part_acc_ptr,  # WRITE_PARTIAL: fp32 [n_splits, total query rows, Hq, BLOCK_D]
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
    SPLIT_N: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    HAS_KEY_START: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // n_kv_heads
    hk = pid_bh % n_kv_heads
    q_row0, q_tok0, len_q, k_tok0, len_k, ks = _seq_bounds(
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
        q = _operand(q, UPCAST)
        scale = tl.cast(qk_scale, tl.float32)
        last_row = tl.minimum(row0 + BLOCK_M, n_rows) - 1
        key_end = len_k - len_q + last_row // group + 1  # one past the last key any row of the tile sees
        if WRITE_PARTIAL:
            # split-decode: this program computes split program_id(2) only; _attn_merge_kernel merges
            split = tl.program_id(2).to(tl.int64)
            lo = ks + split * SPLIT_N
            if lo < key_end:
                m_s, l_s, acc_s = _split_state(
                    q, k_base, v_base, stride_kt, stride_vt, offs_d, mask_d, qpos, lo,
                    tl.minimum(lo + SPLIT_N, key_end), len_k, scale,
                    BLOCK_M, BLOCK_N, BLOCK_D, INPUT_PRECISION, UPCAST,
                )  # fmt: skip
                n_q_heads = n_kv_heads * group
                flat = q_row0 + qi
                ml = part_ml_ptr + split * 2 * n_q_heads * total_q + hq * total_q + flat
                tl.store(ml, m_s, mask=row_ok)
                tl.store(ml + n_q_heads * total_q, l_s, mask=row_ok)
                pa = part_acc_ptr + ((split * total_q + flat) * n_q_heads + hq) * BLOCK_D
                tl.store(pa[:, None] + offs_d[None, :], acc_s, mask=row_ok[:, None])
        elif ONE_SPLIT:
            # Every key of the call lies in the first split: the merged state is that split's state
            # bit for bit (the one merge is exact: 2^(−inf) = 0, 2^0 = 1), so skip the second
            # accumulator and the merge (fewer registers for the prefill tile).
            m_i, l_i, acc = _split_state(
                q, k_base, v_base, stride_kt, stride_vt, offs_d, mask_d, qpos, ks, key_end, len_k, scale,
                BLOCK_M, BLOCK_N, BLOCK_D, INPUT_PRECISION, UPCAST,
            )  # fmt: skip
            out, lse = _finish(m_i, l_i, acc)
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
        else:
            m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            l_i = tl.zeros((BLOCK_M,), tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
            for lo in range(ks, key_end, SPLIT_N):  # splits of SPLIT_N keys anchored at ks, in order
                m_s, l_s, acc_s = _split_state(
                    q, k_base, v_base, stride_kt, stride_vt, offs_d, mask_d, qpos, lo,
                    tl.minimum(lo + SPLIT_N, key_end), len_k, scale,
                    BLOCK_M, BLOCK_N, BLOCK_D, INPUT_PRECISION, UPCAST,
                )  # fmt: skip
                m_i, l_i, acc = _merge(m_i, l_i, acc, m_s, l_s, acc_s)
            out, lse = _finish(m_i, l_i, acc)
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
def _attn_merge_kernel(
    o_ptr,
    stride_ob,
    stride_ot,
    stride_oh,
    lse_ptr,
    part_ml_ptr,
    part_acc_ptr,
    key_start_ptr,
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
):
    """Split-decode, second pass: merge a row tile's split partials in split order with ``_merge``
    (the prefill's formula) and write out / lse2. Same row tiling as the partial pass (padded form)."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // n_kv_heads
    hk = pid_bh % n_kv_heads
    q_row0, q_tok0, len_q, k_tok0, len_k, ks = _seq_bounds(
        b, key_start_ptr, key_start_ptr, key_start_ptr, seqlen_q, seqlen_k, HAS_KEY_START, False
    )
    n_rows = len_q * group
    row0 = pid_m * BLOCK_M
    if row0 < n_rows:
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        qi = rows // group
        hq = hk * group + rows % group
        offs_d = tl.arange(0, BLOCK_D)
        n_q_heads = n_kv_heads * group
        flat = q_row0 + qi
        last_row = tl.minimum(row0 + BLOCK_M, n_rows) - 1
        key_end = len_k - len_q + last_row // group + 1
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        n_split = (key_end - ks + SPLIT_N - 1) // SPLIT_N  # the splits the partial pass wrote
        for split in range(0, n_split):  # in order
            ml = part_ml_ptr + split * 2 * n_q_heads * total_q + hq * total_q + flat
            m_s = tl.load(ml, mask=row_ok, other=float("-inf"))
            l_s = tl.load(ml + n_q_heads * total_q, mask=row_ok, other=0.0)
            pa = part_acc_ptr + ((split * total_q + flat) * n_q_heads + hq) * BLOCK_D
            acc_s = tl.load(pa[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            m_i, l_i, acc = _merge(m_i, l_i, acc, m_s, l_s, acc_s)
        out, lse = _finish(m_i, l_i, acc)
        o_base = o_ptr + b * stride_ob
        mask_d = offs_d < head_dim
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


def _upcast_dots(dtype: torch.dtype) -> bool:
    # Workaround (2026-11-21, Triton 3.9 interpreter): tl.dot on bf16 tiles returns garbage in
    # TRITON_INTERPRET=1 (its numpy emulation has no bf16 matmul), so under the interpreter bf16
    # tiles are upcast to fp32 right after loading (P and dS are still rounded to bf16 first).
    # Compiled kernels never take this branch.
    return dtype == torch.bfloat16 and interpreter_enabled()


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # "tf32" is ignored for 16-bit inputs


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward. Inputs as ``rlkernel.invariant.attention`` (validated there). Returns ``out``
    (contiguous, shaped like q, q's dtype) and ``lse2`` (fp32 ``[Hq, total query rows]``, base 2,
    +inf for rows that see no key). ``config`` overrides ``fwd_config`` for tests and tuning only."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    packed, n_seq, hq, hkv, d, seqlen_q, seqlen_k, total_q = _common(
        q, k, key_start, cu_seqlens_q, max_seqlen_q
    )
    group = hq // hkv
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((hq, total_q), dtype=torch.float32, device=q.device)
    if n_seq == 0 or seqlen_q == 0 or total_q == 0:
        return out, lse
    cfg = config or launch_config(d, q.dtype, seqlen_q * group)
    if SPLIT_N % cfg.block_n:
        raise ValueError(f"SPLIT_N ({SPLIT_N}) must be a multiple of BLOCK_N ({cfg.block_n})")
    if n_seq * hkv > 65535:
        raise ValueError(f"batch × kv heads = {n_seq * hkv} exceeds the 65,535 programs of grid axis 1")
    row_tiles = _cdiv(seqlen_q * group, cfg.block_m)
    split = use_split_decode(row_tiles * n_seq * hkv, seqlen_k, q.device, packed)
    n_splits = _cdiv(seqlen_k, SPLIT_N) if split else 1
    block_d = _block_d(d)
    if split:
        part_ml = torch.empty((n_splits, 2, hq, total_q), dtype=torch.float32, device=q.device)
        part_acc = torch.empty((n_splits, total_q, hq, block_d), dtype=torch.float32, device=q.device)
    else:
        part_ml = part_acc = lse  # unused
    dummy = lse
    # enable_fp_fusion=False on both kernels: no mul+add -> fma contraction, so the per-element
    # arithmetic of the shared helpers (_split_state, _merge, _finish) rounds alike in the one-pass
    # kernel and in the split-decode pair, whatever the compiler would contract in each.
    with _device_guard(q):
        _attn_fwd_kernel[(row_tiles, n_seq * hkv, n_splits)](
            out,
            *_strides4(out, packed),
            lse,
            part_ml,
            part_acc,
            q,
            *_strides4(q, packed),
            k,
            *_strides4(k, packed),
            v,
            *_strides4(v, packed),
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
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_D=block_d,
            SPLIT_N=SPLIT_N,
            WRITE_PARTIAL=split,
            # packed: every sequence's keys lie in k's N rows, so N <= SPLIT_N bounds them all (no sync)
            ONE_SPLIT=(k.shape[0] if packed else seqlen_k) <= SPLIT_N,
            HAS_KEY_START=key_start is not None,
            IS_VARLEN=packed,
            INPUT_PRECISION=_precision(q.dtype),
            UPCAST=_upcast_dots(q.dtype),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            enable_fp_fusion=False,
        )
        if split:
            _attn_merge_kernel[(row_tiles, n_seq * hkv)](
                out,
                *_strides4(out, packed),
                lse,
                part_ml,
                part_acc,
                key_start if key_start is not None else dummy,
                seqlen_q,
                seqlen_k,
                hkv,
                group,
                d,
                total_q,
                BLOCK_M=cfg.block_m,
                BLOCK_D=block_d,
                SPLIT_N=SPLIT_N,
                HAS_KEY_START=key_start is not None,
                num_warps=cfg.num_warps,
                enable_fp_fusion=False,
            )
    return out, lse
