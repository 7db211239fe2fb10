"""The statistics GEMM of the LM head (``_linear_head_stats_kernel``) and its combine kernel
(``_linear_head_combine_kernel``): per-token log-softmax statistics from the GEMM's fp32
accumulator, with no ``[M, V]`` logits buffer. Launchers, configuration and the math:
``kernels/linear_head.py``; shared tile pieces: ``kernels/_linear_head_tiles.py``.

STATS: per row of the tile, with columns ≥ V masked to −inf (the last column tile only), the tile
max ``m_t`` (of z), ``s_t = Σ exp(z − m_t)``, with ``WITH_ENTROPY`` ``w_t = Σ (z − m_t)·exp(z − m_t)``,
and ``z_y`` if the row's target lies in the tile (a branch: only tiles holding some row's target
select it). The exponentials are ``exp2(max(fma(acc, c, −m·c), −200))`` with ``c = log2(e)/T``: one
FMA, one max and one MUFU ``ex2`` per element; ``w_t`` comes back to natural units by one ×ln 2 per
row. The partials go to fp32 ``[n_col_tiles, M]`` buffers: a tile writes ``BLOCK_M`` consecutive
floats per buffer (coalesced) and the combine kernel reads them the same way. With ``STORE_Z`` the
raw logits x (not z: the model's logits, bitwise the GEMM product, what ``token_logprobs_bwd``
reads with its temperature) also go out, in the buffer's dtype (fp32 or the input's); with
``Z_SHIFTED`` instead the tile-shifted exponents ``d = (z − m_t)·log2 e`` that the shifted gradient
kernel of ``kernels/linear_head_grad.py`` reads.

COMBINE (one program per ``combine_rows`` rows, ``combine_tiles`` column tiles per step: a tree sum
within a step, the steps in increasing tile order) folds the partials: ``mx = max_t m_t``;
``S = Σ_t s_t·e^{m_t − mx}``; ``W = Σ_t e^{m_t − mx}·(w_t + (m_t − mx)·s_t)``; lse = mx + log S,
H = log S − W/S (the ``_reduce.py`` form, no lse − E[z] cancellation), logp = z_y − lse.

Memory traffic (bf16, M rows, V vocab, n_t = ceil(V / BLOCK_N)). STATS reads the operands as the
GEMM does (h once per column-tile group from L2, W once per GROUP_M row tiles from DRAM) and writes
(2 or 3)·4·n_t·M bytes of partials (M = 8192, V = 151,936, BLOCK_N = 256: 58 MB with entropy, read
once more by the combine) instead of the 5 GB fp32 logits the unfused path writes and then reads
once (forward) and once more (backward).

Cost model of the epilogue (H100, 128×256 tile, 8 warps, H = 4096). The mainloop is
2·128·256·4096 flops: ~65k cycles of one SM's tensor cores at peak. The STATS epilogue per thread
(128 logits; sm_90 PTX of Triton 3.9): 128 ``ex2`` (MUFU, 16 per SM per cycle: ~2k cycles per tile)
and, on a full tile without the target select, ~6 other instructions per logit (FMA, row max,
floor, two sums' adds/FMAs) at one warp instruction per cycle per scheduler: ~1.5k cycles, partly
overlapped with the MUFU. So ~2-3k cycles, 3-5% of the mainloop, exposed unless the next tile's
loads overlap it (``warp_specialize``; with Triton 3.9 on sm_90 the flag produces the same PTX as
without it). It compiles to 255 registers without spills (the accumulator is 128 of them); shared
memory: 147 KB, 213 KB with ``STORE_Z`` (+ the 64 KB staging buffer) of the H100's 227 KB.
``STORE_Z`` in fp32 adds 128 KB of writes per tile (M = 2048: 1.24 GB, ~0.4 ms of HBM time against
a ~3.4 ms GEMM), of which the first half waits inside the epilogue (``_linear_head_tiles``: Stores).
"""

from __future__ import annotations

import triton
import triton.language as tl

from rlkernel.kernels._linear_head_tiles import LN2, LOG2E, _acc_tile, _store_tile, _target_in_tile
from rlkernel.kernels.matmul import _tile_coords

D_FLOOR = tl.constexpr(-200.0)  # see the stats epilogue


@triton.jit(do_not_specialize=["M", "num_programs"])
def _linear_head_stats_kernel(
    # outputs
    m_part_ptr,
    s_part_ptr,
    w_part_ptr,
    zy_ptr,
    z_out,
    stride_zm,
    # inputs
    h_desc,
    w_desc,
    ids_ptr,
    # sizes
    M,
    V,
    K,
    num_programs,
    # runtime scalar
    temperature,
    # meta
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    STORE_Z: tl.constexpr,
    Z_SHIFTED: tl.constexpr,
    Z_TMA: tl.constexpr,
    STORE_SPLIT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    FLATTEN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Persistent: program p takes tiles p, p + num_programs, … and writes, per (column tile t, row
    r), ``m[t, r]`` = max z, ``s[t, r]`` = Σ exp(z − m), ``w[t, r]`` = Σ (z − m)·exp(z − m) over the
    tile's columns < V, and ``zy[r]`` = z_y from the tile holding y (no other tile writes it).
    ``STORE_Z``: the raw logits x to ``z_out``, or with ``Z_SHIFTED`` the tile-shifted exponents
    ``d = (z − m[t, r])·log2 e`` (floored at ``D_FLOOR``) that the shifted gradient kernel reads."""
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
        # Loaded before the mainloop so that its latency hides behind it.
        y = tl.load(ids_ptr + rows, mask=mask_m, other=-1).to(tl.int64)
        y_local = _target_in_tile(y, off_n, V, BLOCK_N)

        acc = _acc_tile(h_desc, w_desc, off_m, off_n, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K,
                        INPUT_PRECISION, INTERPRETED)  # fmt: skip
        if STORE_Z and not Z_SHIFTED:
            _store_tile(z_out, stride_zm, acc, off_m, off_n, M, V, Z_TMA, STORE_SPLIT)

        # Columns ≥ V hold zeros (zero-filled W rows): −inf, so they add exp(−inf) = 0. Only the
        # last column tile has such columns; the others skip the compare and select (2 of the ~8
        # instructions per element). Every tile has a column < V: the row max is finite (for
        # finite operands). x replaces acc (one fp32 tile of registers stays live, not two).
        if off_n + BLOCK_N <= V:
            x = acc
        else:
            x = tl.where((off_n + cols < V)[None, :], acc, float("-inf"))
        # ~1 - (1 - 1/n_t)^BLOCK_M of the tiles hold some row's target (V = 151,936, 128x256: ~19%):
        # only they pay for the select. Done before the exponentials, which are x's last use.
        if tl.max(y_local, axis=0) >= 0:
            x_y = tl.sum(tl.where(cols[None, :] == y_local[:, None], x, 0.0), axis=1)
            tl.store(zy_ptr + rows, x_y * inv_t, mask=mask_m & (y_local >= 0))
        m_x = tl.max(x, axis=1)
        # d = (z − m)·log2 e ≤ 0 in one FMA (T > 0: the max of x is the max of z), floored at
        # D_FLOOR (−inf on masked columns; NaN kept); exp2 of anything below −149 is 0 in fp32
        # (the smallest denormal is 2^-149), so the floor changes no sum and makes d·e an exact 0
        # where it would be −inf·0 = NaN: one max per element instead of a compare and a select.
        d = tl.maximum(x * c - (m_x * c)[:, None], D_FLOOR, propagate_nan=tl.PropagateNan.ALL)
        if STORE_Z and Z_SHIFTED:
            _store_tile(z_out, stride_zm, d, off_m, off_n, M, V, Z_TMA, STORE_SPLIT)
        e = tl.exp2(d)
        part = pid_n.to(tl.int64) * M + rows
        tl.store(m_part_ptr + part, m_x * inv_t, mask=mask_m)
        tl.store(s_part_ptr + part, tl.sum(e, axis=1), mask=mask_m)
        if WITH_ENTROPY:
            tl.store(w_part_ptr + part, tl.sum(d * e, axis=1) * LN2, mask=mask_m)


@triton.jit(do_not_specialize=["M", "n_tiles", "ignore_index"])
def _linear_head_combine_kernel(
    # outputs
    logp_ptr,
    lse_ptr,
    entropy_ptr,
    # inputs
    m_part_ptr,
    s_part_ptr,
    w_part_ptr,
    zy_ptr,
    ids_ptr,
    # sizes
    M,
    V,
    n_tiles,
    # runtime scalars
    ignore_index,
    # meta
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
):
    """Fold each row's ``n_tiles`` partials in two passes (the max, then the rescaled sums), reading
    ``[BLOCK_T, BLOCK_R]`` blocks (tiles × rows): a block's terms are summed as a tree, the blocks in
    increasing tile order. Elementwise across rows: a row's bits depend on its partials alone."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = rows < M
    tiles = tl.arange(0, BLOCK_T).to(tl.int64)
    mx = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    for t0 in range(0, n_tiles, BLOCK_T):
        t = t0 + tiles
        valid = (t < n_tiles)[:, None] & mask_r[None, :]
        offs = t[:, None] * M + rows[None, :]  # int64: n_tiles·M may exceed 2^31
        mx = tl.maximum(mx, tl.max(tl.load(m_part_ptr + offs, mask=valid, other=float("-inf")), axis=0))
    s_sum = tl.zeros((BLOCK_R,), tl.float32)
    w_sum = tl.zeros((BLOCK_R,), tl.float32)
    for t0 in range(0, n_tiles, BLOCK_T):
        t = t0 + tiles
        valid = (t < n_tiles)[:, None] & mask_r[None, :]
        offs = t[:, None] * M + rows[None, :]
        m_t = tl.load(m_part_ptr + offs, mask=valid, other=0.0)
        s_t = tl.load(s_part_ptr + offs, mask=valid, other=0.0)
        scale = tl.where(valid, tl.exp(m_t - mx[None, :]), 0.0)
        s_sum += tl.sum(s_t * scale, axis=0)
        if WITH_ENTROPY:
            w_t = tl.load(w_part_ptr + offs, mask=valid, other=0.0)
            # Σ (z − mx)·e^{z − mx} over the tile = e^{m_t − mx}·(w_t + (m_t − mx)·s_t)
            w_sum += tl.sum(scale * (w_t + (m_t - mx[None, :]) * s_t), axis=0)
    log_s = tl.log(s_sum)
    lse = mx + log_s
    y = tl.load(ids_ptr + rows, mask=mask_r, other=0).to(tl.int64)
    active = y != ignore_index
    in_vocab = active & (y >= 0) & (y < V)
    z_y = tl.load(zy_ptr + rows, mask=mask_r & in_vocab, other=float("nan"))
    tl.store(logp_ptr + rows, tl.where(active, z_y - lse, 0.0), mask=mask_r)
    tl.store(lse_ptr + rows, tl.where(active, lse, 0.0), mask=mask_r)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + rows, tl.where(active, log_s - w_sum / s_sum, 0.0), mask=mask_r)
