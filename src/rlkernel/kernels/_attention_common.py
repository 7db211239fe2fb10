"""Helpers shared by the attention kernels (``kernels.attention``: forward; ``kernels.attention_split``:
the split-decode combine; ``kernels.attention_bwd``: backward): the launch-side shape and stride
helpers and the ``@triton.jit`` pieces of the online-softmax state (fresh state, merge, finish, row
tiles, stores) and of the sequence bounds. The math they implement is described in
``kernels.attention``'s module header; they live here so that each kernel module imports them
without importing the others.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from rlkernel.kernels._reduce import is_nonfinite

LOG2E = 1.4426950408889634


@functools.lru_cache(maxsize=64)
def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _strides4(t: torch.Tensor, packed: bool) -> tuple[int, int, int]:
    """(batch, token, head) strides; the packed form [N, H, D] has batch stride 0."""
    st = t.stride()  # one call (each .stride(i) is a separate call into C++)
    return (0, st[0], st[1]) if packed else (st[0], st[1], st[2])


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
def _fresh(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The state before any key: m = −inf, l = 0, acc = 0."""
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    return m_i, tl.zeros((BLOCK_M,), tl.float32), tl.zeros((BLOCK_M, BLOCK_D), tl.float32)


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


def _common(q, k, key_start, cu_seqlens_q, max_seqlen_q):
    """(packed, n_seq, Hq, Hkv, head_dim, seqlen_q, seqlen_k, total query rows) of a call."""
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
    """The dots' input precision: IEEE fp32 for fp32 inputs (no tf32)."""
    return "ieee" if dtype == torch.float32 else "tf32"  # "tf32" is ignored for 16-bit inputs
