"""Split-decode of the batch-invariant attention: the combine kernel and the split policy.

A decode step at small batch runs one program per (row tile, split of S keys, sequence × kv head)
(``kernels.attention._attn_fwd_kernel`` with ``WRITE_PARTIAL``), each storing its split's fp32 state
(m, l, acc); ``_attn_combine_kernel`` then merges each row's splits in split order with the prefill's
own ``_merge``, from the same fresh state, and finishes with the same ``_finish`` — so the bits are
those of the one-pass kernel (see ``kernels.attention``'s module header). Also here: the split size
S (``split_keys``, part of the formula), its check (``check_split_keys``) and when to split
(``use_split_decode``: speed only).

Caveats:
    * Split-decode runs when some row spans two splits or more and the one-pass grid is smaller
      than the SM count (``"auto"``): B = 1, Hkv = 8, cache 32k: 16 splits × 8 = 128 programs of 32
      blocks instead of 8 programs of 512. Its partials cost ⌈T/S⌉·rows·(D + 2)·4 bytes (B = 1,
      Hq = 32, D = 128, 32k: 266 KB).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels._attention_common import _finish, _merge, _seq_bounds, _store_rows, _tile_rows
from rlkernel.kernels._launch import FastLauncher, num_sms


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
