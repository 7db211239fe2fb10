"""The tile pieces both LM-head GEMM kernels share (``kernels/linear_head_stats.py``,
``kernels/linear_head_grad.py``; launchers and design: ``kernels/linear_head.py``).

``_acc_tile`` is ``kernels/matmul.py``'s persistent TMA mainloop for one ``[BLOCK_M, BLOCK_N]``
tile of ``x = h @ W.T`` (TMA descriptors for ``h`` and ``W``, whose out-of-bounds rows, the
vocabulary tail included, are zero-filled; one ``dot`` per BLOCK_K in increasing k, no split-K).

Stores (``_store_tile``). An output of 16-byte aligned row pitch goes out by TMA (``tma_store``) from
one shared-memory staging buffer of at most ``store_bytes``, in 1, 2 or 4 column slices of the
tile: a 128×256 fp32 tile (128 KB) does not fit beside three 48 KB pipeline stages, so it leaves in
two 64 KB halves. Triton reuses one buffer for the slices and waits for each slice's copy before
the next one overwrites it, so only the last slice drains behind the next tile's mainloop (a bf16
tile in one piece drains entirely behind it). Other outputs, or ``tma_store=False``: a masked
pointer store from registers (its layout-conversion scratch is dead shared memory of the
mainloop, so it costs no persistent staging buffer).

Batch invariance (a row's bits do not depend on M, on the other rows or on its position in the
tile). The accumulator of one element is ``matmul.py``'s (one ``dot`` per BLOCK_K in increasing k,
no split-K; rows never interact; out-of-bounds rows are zeros and are never stored). The epilogue's
tile reductions run along the tile's columns: ``max`` is exact, and each row's ``tl.sum`` is the
same sequence of adds for every row of the tile (the accumulator's layout gives each row the same
column pattern in the same registers of the same lanes: fixed by the config, not by M, nor by
alignment since the layout comes from the MMA, not from a pointer); z_y is selected by a sum of
one value and exact zeros. The combine folds a row's partials in column-tile order, elementwise
across rows. The config never depends on M (``default_config(dtype)``). So one config gives the
same bits for a row at M = 1 and M = 100,000 (``tests/kernels/test_linear_head_kernel.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from rlkernel.kernels._dot import dot

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _acc_tile(h_desc, w_desc, off_m, off_n, k_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 ``x[off_m:+BLOCK_M, off_n:+BLOCK_N]``: ``matmul.py``'s TMA mainloop with the K-major
    weight (``[BLOCK_N, BLOCK_K]`` boxes, transposed in shared memory)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(k_tiles):
        a = h_desc.load([off_m, ki * BLOCK_K])
        b = w_desc.load([off_n, ki * BLOCK_K]).T
        acc = dot(a, b, acc, INPUT_PRECISION, INTERPRETED)
    return acc


@triton.jit
def _halves(x):
    """The left and right column halves of a 2-D tile (a register relabelling, no data movement)."""
    BM: tl.constexpr = x.shape[0]
    BN: tl.constexpr = x.shape[1]
    return tl.split(tl.permute(tl.reshape(x, (BM, 2, BN // 2)), (0, 2, 1)))


@triton.jit
def _store_tile(out, stride_om, x, off_m, off_n, M, N, USE_TMA: tl.constexpr, SPLIT: tl.constexpr):
    """Store fp32 tile ``x`` at ``[off_m, off_n]`` of ``out [M, N]``, cast to its dtype. ``USE_TMA``:
    ``out`` is a descriptor of ``[BM, BN / SPLIT]`` boxes (clips rows ≥ M and columns ≥ N); else a
    pointer with row stride ``stride_om`` (masked store)."""
    BM: tl.constexpr = x.shape[0]
    BN: tl.constexpr = x.shape[1]
    if USE_TMA:
        x = x.to(out.dtype)
        if SPLIT == 1:
            out.store([off_m, off_n], x)
        elif SPLIT == 2:
            x0, x1 = _halves(x)
            out.store([off_m, off_n], x0)
            out.store([off_m, off_n + BN // 2], x1)
        else:
            left, right = _halves(x)
            x0, x1 = _halves(left)
            x2, x3 = _halves(right)
            out.store([off_m, off_n], x0)
            out.store([off_m, off_n + BN // 4], x1)
            out.store([off_m, off_n + BN // 2], x2)
            out.store([off_m, off_n + 3 * (BN // 4)], x3)
    else:
        rows = off_m + tl.arange(0, BM)
        cols = off_n + tl.arange(0, BN)
        ptrs = out + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        tl.store(ptrs, x.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _target_in_tile(y, off_n, V, BLOCK_N: tl.constexpr):
    """Per row: the target's column within the tile (int32), or −1 if it is not in this tile."""
    hit = (y >= off_n) & (y < off_n + BLOCK_N) & (y < V)
    return tl.where(hit, y - off_n, -1).to(tl.int32)
