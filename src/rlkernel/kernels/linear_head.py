"""Triton kernels for the LM head of an RL loss whose epilogue reduces the logits tile in registers:
per-token log-softmax statistics (forward) and the logits gradient (backward), with no ``[M, V]``
fp32 logits buffer in between.

Math (T = temperature, y = target id; the same as ``kernels/logprobs.py`` and the oracle
``rlkernel.reference.logprobs``): the raw logits are ``x = h @ W.T`` (``h [M, H]``, ``W [V, H]``,
one fp32 accumulator per element), ``z = x / T`` and per row

    lse = log Σ_j exp(z_j),   logp = z_y − lse,   H = lse − Σ_j p_j z_j,   p_j = exp(z_j − lse)
    ∂L/∂x_k = [ g_logp·(δ_ky − p_k) − g_H·p_k·(z_k − lse + H) ] / T

Rows whose id is ``ignore_index`` give logp = entropy = lse = 0 and a zero gradient row; an id
outside [0, V) gives a NaN logp (as in ``kernels/logprobs.py``).

Algorithm. Both GEMM kernels are the persistent TMA GEMM of ``kernels/matmul.py`` (one program per
SM looping over ``[BLOCK_M, BLOCK_N]`` output tiles in grouped order, ``_tile_coords``; TMA
descriptors for ``h`` and ``W``, whose out-of-bounds rows, the vocabulary tail included, are
zero-filled) with a different epilogue on the fp32 accumulator ``acc``:

    * STATS (``_linear_head_stats_kernel``): per row of the tile, with columns ≥ V masked to −inf
      (the last column tile only), the tile max ``m_t`` (of z), ``s_t = Σ exp(z − m_t)``, with
      ``WITH_ENTROPY`` ``w_t = Σ (z − m_t)·exp(z − m_t)``, and ``z_y`` if the row's target lies in
      the tile (a branch: only tiles holding some row's target select it). The exponentials are
      ``exp2(max(fma(acc, c, −m·c), −200))`` with ``c = log2(e)/T``: one FMA, one max and one MUFU
      ``ex2`` per element; ``w_t`` comes back to natural units by one ×ln 2 per row. The partials
      go to fp32 ``[n_col_tiles, M]`` buffers: a tile writes ``BLOCK_M`` consecutive floats per
      buffer (coalesced) and the combine kernel reads them the same way. With ``STORE_Z`` the raw
      logits x (not z: the model's logits, bitwise the GEMM product, what ``token_logprobs_bwd``
      reads with its temperature) also go out, in the buffer's dtype (fp32 or the input's).
      The combine kernel (one program per ``combine_rows`` rows, ``combine_tiles`` column tiles per
      step: a tree sum within a step, the steps in increasing tile order) folds the partials:
      ``mx = max_t m_t``; ``S = Σ_t s_t·e^{m_t − mx}``;
      ``W = Σ_t e^{m_t − mx}·(w_t + (m_t − mx)·s_t)``; lse = mx + log S, H = log S − W/S (the
      ``_reduce.py`` form, no lse − E[z] cancellation), logp = z_y − lse.
    * GRAD (``_linear_head_grad_kernel``): from the saved lse and entropy, per element
      ``lp2 = fma(acc, c, −lse·log2 e)``, ``p = exp2(lp2)`` and
      ``dx = [y == k]·g_logp/T − p·(a_r + b_r·lp2)`` with per-row ``a_r = (g_logp + g_H·H)/T``,
      ``b_r = g_H·ln 2/T``: two FMAs, one MUFU, one FMA and a select per element; written in the
      output's dtype. The forward's sums are not needed: no partials, no combine.
    Stores. An output of 16-byte aligned row pitch goes out by TMA (``tma_store``) from one
    shared-memory staging buffer of at most ``store_bytes``, in 1, 2 or 4 column slices of the tile:
    a 128×256 fp32 tile (128 KB) does not fit beside three 48 KB pipeline stages, so it leaves in
    two 64 KB halves. Triton reuses one buffer for the slices and waits for each slice's copy before
    the next one overwrites it, so only the last slice drains behind the next tile's mainloop (a
    bf16 tile in one piece drains entirely behind it). Other outputs, or ``tma_store=False``: a
    masked pointer store from registers (its layout-conversion scratch is dead shared memory of the
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

Memory traffic (bf16, M rows, H hidden, V vocab, n_t = ceil(V / BLOCK_N)). STATS reads the
operands as the GEMM does (h once per column-tile group from L2, W once per GROUP_M row tiles from
DRAM) and writes (2 or 3)·4·n_t·M bytes of partials (M = 8192, V = 151,936, BLOCK_N = 256: 58 MB
with entropy, read once more by the combine) instead of the 5 GB fp32 logits the unfused path
writes and then reads once (forward) and once more (backward). GRAD writes M·V·2 bytes (the bf16
gradient, 2.5 GB at M = 8192) and reads nothing but the operands and 4 floats and an id per row.

Cost model of the epilogue (H100, 128×256 tile, 8 warps, H = 4096). The mainloop is
2·128·256·4096 flops: ~65k cycles of one SM's tensor cores at peak. The STATS epilogue per thread
(128 logits; sm_90 PTX of Triton 3.9): 128 ``ex2`` (MUFU, 16 per SM per cycle: ~2k cycles per tile)
and, on a full tile without the target select, ~6 other instructions per logit (FMA, row max,
floor, two sums' adds/FMAs) at one warp instruction per cycle per scheduler: ~1.5k cycles, partly
overlapped with the MUFU. So ~2-3k cycles, 3-5% of the mainloop, exposed unless the next tile's
loads overlap it (``warp_specialize``; with Triton 3.9 on sm_90 the flag produces the same PTX as
without it). GRAD: one ``ex2`` and ~4 FMAs/selects per logit plus the store: similar. Both kernels
compile to 255 registers without spills (the accumulator is 128 of them); shared memory: 147 KB
(STATS), 213 KB (GRAD or STORE_Z: + the 64 KB staging buffer) of the H100's 227 KB.
``STORE_Z`` in fp32 adds 128 KB of writes per tile (M = 2048: 1.24 GB, ~0.4 ms of HBM time against
a ~3.4 ms GEMM), of which the first half waits inside the epilogue (see Stores).

Caveats:
    * Needs Triton's TMA API (host ``TensorDescriptor``) and, on a GPU, compute capability ≥ 9.0;
      ``h`` and ``W`` must be contiguous with a 16-byte aligned base and row pitch (H a multiple of
      8 for 16-bit inputs, of 4 for fp32). fp32 inputs run an IEEE FMA product (no TF32), ~10x
      slower than the tensor cores; they exist for accuracy tests and small heads.
    * Invariance holds for one config on one GPU model and compiler version; different configs
      (BLOCK_N, BLOCK_K, the MMA kind) may differ in the last bits. The bits are not those of
      ``matmul.py``'s table path nor of ``kernels/logprobs.py`` on stored logits (both are within
      the fp32 accuracy contract of the same exact value).
    * The GRAD kernel recomputes the GEMM (2·M·V·H flops) rather than reading stored logits: that
      is the point (no [M, V] buffer), and it costs one more GEMM than a path that kept the logits.
    * No bias, no vocab-parallel shard offset, no device-side gradient scale (``kernels/logprobs.py``
      has ``grad_scale``); no ``torch.library`` registration yet (kernels layer only).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from rlkernel import _validate as v
from rlkernel.kernels import matmul_table as mt
from rlkernel.kernels._dot import dot, interpreted
from rlkernel.kernels._launch import FP_FUSION, FastLauncher, num_sms
from rlkernel.kernels._launch import cdiv as _cdiv
from rlkernel.kernels._launch import device_guard as _device_guard
from rlkernel.kernels.matmul import _aligned, _tile_coords

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
D_FLOOR = tl.constexpr(-200.0)  # see the stats epilogue


# ---------------------------------------------------------------------------------- configuration
@dataclasses.dataclass(frozen=True)
class LinearHeadConfig:
    """Launch configuration of both GEMM kernels (and the combine's rows per program). A row's bits
    depend on ``block_n`` (the partials' tiling) and ``block_k``/the MMA kind (the GEMM's order);
    never on M. ``flatten``/``warp_specialize``: ``tl.range`` options of the persistent tile loop.
    ``tma_store``/``store_bytes``: how an output tile (``store_z``, the gradient) is stored (see the
    module docstring); ``combine_rows`` × ``combine_tiles``: the combine kernel's block (rows per program ×
    column tiles per step)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    flatten: bool = False
    warp_specialize: bool = False
    tma_store: bool = True
    store_bytes: int = 65536
    # The combine kernel's block: rows per program × column tiles per loop step. Its two loops
    # over the tiles are latency bound (a row-at-a-time fold of 32 rows per program took 0.14 ms
    # at M = 2048, V = 151,936 on the H100 for ~15 MB of partials), so each step reads a
    # [combine_tiles, combine_rows] block and many programs run: 128 at M = 2048.
    combine_rows: int = 16
    combine_tiles: int = 64
    name: str = ""

    def __post_init__(self) -> None:
        powers_of_two = ("block_m", "block_n", "block_k", "group_m", "num_warps", "combine_rows",
                         "combine_tiles", "store_bytes")  # fmt: skip
        for field in powers_of_two:
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"config.{field} must be a power of two, got {value!r}")
        if self.block_k < 16 or self.block_m < 16 or self.block_n < 16:
            raise ValueError(f"config blocks must be >= 16 (tl.dot), got {self}")

    def store_split(self, itemsize: int) -> int:
        """Column slices (1, 2 or 4) of a TMA-stored output tile with ``itemsize``-byte elements."""
        return min(4, max(1, self.block_m * self.block_n * itemsize // self.store_bytes))


# The matmul table's M = 8192 vocab cell (``prefill_tma_ws``: 128x256x64, GROUP_M 8, 8 warps, 3
# stages) without warp specialization (Triton 3.9 builds the same sm_90 PTX with or without it
# for these kernels; scripts/bench_linear_head_kernel.py times both on the GPU's Triton); fp32:
# the table's fp32 tile (IEEE FMA, no tensor cores: small tiles).
_DEFAULTS = {
    torch.bfloat16: LinearHeadConfig(name="bf16_128x256x64"),
    torch.float16: LinearHeadConfig(name="fp16_128x256x64"),
    torch.float32: LinearHeadConfig(64, 64, 32, 8, 4, 2, name="fp32_64x64x32"),
}


def default_config(dtype: torch.dtype) -> LinearHeadConfig:
    """The configuration for operands of ``dtype``: a function of the dtype alone (row invariance)."""
    return _DEFAULTS[dtype]


# --------------------------------------------------------------------------------------- kernels
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


# ------------------------------------------------------------------------------------- launchers
_launch_stats = FastLauncher(_linear_head_stats_kernel)
_launch_grad = FastLauncher(_linear_head_grad_kernel)
_launch_combine = FastLauncher(_linear_head_combine_kernel)
_launch_shifted_grad = FastLauncher(_shifted_grad_kernel)
# The shifted gradient kernel's program: 16 rows × BLOCK_N columns on 8 warps. H100, M = 2048,
# V = 151,936 (scripts/sweep_shifted_grad.py): 0.438 ms = 2.84 TB/s (copy ceiling ~2.9) vs 0.490 ms
# on 4 warps; 8 rows / 4 warps 0.436, 32 / 8 0.524. An elementwise kernel: no bit depends on these.
SHIFTED_GRAD_ROWS = 16
SHIFTED_GRAD_WARPS = 8
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def can_run(w: torch.Tensor) -> bool:
    """Whether these kernels can run with the LM-head weight ``w [V, H]`` (the staged hidden rows
    are contiguous): 16-bit, contiguous and 16-byte aligned for TMA, Triton's TMA API, and on a GPU
    compute capability >= 9.0 (the CPU interpreter runs them too)."""
    if w.dtype not in (torch.float16, torch.bfloat16) or w.dim() != 2 or not w.is_contiguous():
        return False
    if not _aligned(w) or not mt.tma_api_available():
        return False
    return not w.is_cuda or mt.device_capability(w.device)[0] >= 9


def _check_operands(h, w, ids, config) -> LinearHeadConfig:
    """Validate ``h [M, H]``, ``w [V, H]``, ``ids [M]``; return the config to run."""
    h = v.float_tensor("h", h)
    w = v.float_tensor("w", w)
    ids = v.int_tensor("ids", ids)
    for name, t in (("h", h), ("w", w)):
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be bf16, fp16 or fp32, got {v.describe(t)}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got {v.describe(t)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()} ({v.describe(t)})")
    if w.dtype != h.dtype:
        raise TypeError(f"w must have h's dtype {h.dtype}, got {v.describe(w)}")
    v.same_device("w", w, "h", h.device)
    v.same_device("ids", ids, "h", h.device)
    if w.shape[1] != h.shape[1] or w.shape[0] == 0 or h.shape[1] == 0:
        raise ValueError(f"w must be [V >= 1, H] with h's H = {h.shape[1]} >= 1, got {v.describe(w)}")
    v.same_shape("ids", ids, "h's rows", (h.shape[0],))
    for name, t in (("h", h), ("w", w)):
        if not _aligned(t):
            raise ValueError(
                f"{name} must have a 16-byte aligned base and row pitch for TMA (H·itemsize % 16 == 0), "
                f"got {v.describe(t)} at address % 16 = {t.data_ptr() % 16}"
            )
    if not mt.tma_api_available():
        raise ValueError("this Triton has no host TensorDescriptor / tl.range(warp_specialize=): no TMA")
    if h.is_cuda and mt.device_capability(h.device)[0] < 9:
        raise ValueError(f"h must be on a GPU with TMA (compute capability >= 9.0), got {v.describe(h)}")
    if config is None:
        return default_config(h.dtype)
    if not isinstance(config, LinearHeadConfig):
        raise TypeError(f"config must be a LinearHeadConfig or None, got {type(config).__name__}")
    return config


def _check_output(name: str, t: object, h: torch.Tensor, n_cols: int) -> torch.Tensor:
    t = v.float_tensor(name, t)
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must be fp32, fp16 or bf16, got {v.describe(t)}")
    v.same_shape(name, t, "[h rows, w rows]", (h.shape[0], n_cols))
    v.same_device(name, t, "h", h.device)
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    return t


def _row_vector(name: str, t: object, rows: int, device: torch.device) -> torch.Tensor:
    """An fp32 ``[rows]`` tensor on ``device`` (made contiguous)."""
    t = v.float_tensor(name, t)
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be fp32, got {v.describe(t)}")
    v.same_shape(name, t, "one value per row", (rows,))
    v.same_device(name, t, "the operands", device)
    return t.contiguous()


def _scalars(temperature: object, ignore_index: object) -> tuple[float, int]:
    t = v.fp32_float("temperature", v.positive_float("temperature", temperature), positive=True)
    return t, v.integer("ignore_index", ignore_index)


def _descriptors(h, w, out, cfg: LinearHeadConfig):
    """TMA descriptors of the operands; for ``out``: ``(descriptor, True, split)`` if TMA stores it,
    else ``(out, False, 1)`` (a pointer store; ``out`` may be None)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    h_desc = TensorDescriptor.from_tensor(h, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
    if out is None:
        return h_desc, w_desc, None, False, 1
    split = cfg.store_split(out.element_size())
    box_n = cfg.block_n // split
    # A TMA box row must be >= 16 bytes; the tensor's row pitch 16-byte aligned.
    if cfg.tma_store and _aligned(out) and box_n * out.element_size() >= 16:
        return h_desc, w_desc, TensorDescriptor.from_tensor(out, [cfg.block_m, box_n]), True, split
    return h_desc, w_desc, out, False, 1


def _launch_gemm(launch, programs: int, args: tuple, own: dict[str, object], h, cfg) -> None:
    """Launch a GEMM kernel (statistics or gradient) on ``programs`` persistent programs.

    Both kernels' constexprs are the block sizes, then their ``own`` flags, then the shared tail, in
    that signature order (:class:`FastLauncher` passes them positionally and checks the order)."""
    constexprs = {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "GROUP_M": cfg.group_m,
        **own,
        "INPUT_PRECISION": "ieee" if h.dtype == torch.float32 else "tf32",  # 16-bit: unused
        "FLATTEN": cfg.flatten,
        "WARP_SPECIALIZE": cfg.warp_specialize,
        "INTERPRETED": interpreted(h),
    }
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "enable_fp_fusion": FP_FUSION}
    with _device_guard(h):
        launch((programs,), args, constexprs, options)


def _programs(h: torch.Tensor, m: int, n: int, cfg: LinearHeadConfig) -> int:
    tiles = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
    return min(num_sms(h.device, interpreter=4), tiles)


def stats_partials(
    h: torch.Tensor,
    w: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    store_z: torch.Tensor | None = None,
    shifted: bool = False,
    config: LinearHeadConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The STATS GEMM alone (arguments as in :func:`linear_head_stats`): ``(parts, z_y)``.
    ``shifted``: ``store_z`` receives the tile-shifted exponents (:func:`linear_head_stats_shifted`).

    ``parts``: fp32 ``[2 or 3, n_t, M]``, n_t = ceil(V / block_n): per column tile and row the max
    of z, Σ exp(z − max) and (with the entropy) Σ (z − max)·exp(z − max). ``z_y``: fp32 ``[M]``,
    the target's z (undefined where the id is outside [0, V)). :func:`combine_partials` reduces them.
    """
    cfg = _check_operands(h, w, ids, config)
    temperature, _ = _scalars(temperature, 0)
    with_entropy = v.boolean("with_entropy", with_entropy)
    m, k = h.shape
    n = w.shape[0]
    if store_z is not None:
        store_z = _check_output("store_z", store_z, h, n)
    n_tiles = _cdiv(n, cfg.block_n)
    parts = torch.empty((3 if with_entropy else 2, n_tiles, m), dtype=torch.float32, device=h.device)
    z_y = torch.empty(m, dtype=torch.float32, device=h.device)
    if m == 0:
        return parts, z_y
    h_desc, w_desc, z_arg, z_tma, split = _descriptors(h, w, store_z, cfg)
    programs = _programs(h, m, n, cfg)
    _launch_gemm(
        _launch_stats, programs,
        (parts[0], parts[1], parts[-1], z_y, z_arg if store_z is not None else z_y, n,
         h_desc, w_desc, ids.contiguous(), m, n, k, programs, temperature),
        {"WITH_ENTROPY": with_entropy, "STORE_Z": store_z is not None, "Z_SHIFTED": bool(shifted),
         "Z_TMA": z_tma, "STORE_SPLIT": split},
        h, cfg,
    )  # fmt: skip
    return parts, z_y


def combine_partials(
    parts: torch.Tensor,
    z_y: torch.Tensor,
    ids: torch.Tensor,
    *,
    vocab_size: int,
    ignore_index: int = -100,
    config: LinearHeadConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reduce :func:`stats_partials`' output over the column tiles (fixed order, per row):
    ``(logp, lse, entropy)`` fp32 ``[M]``, ``entropy`` None when ``parts`` has no third plane."""
    parts = v.float_tensor("parts", parts)
    if parts.dtype != torch.float32 or parts.dim() != 3 or parts.shape[0] not in (2, 3):
        raise ValueError(f"parts must be fp32 [2 or 3, n_tiles, M] (stats_partials), got {v.describe(parts)}")
    if not parts.is_contiguous():
        raise ValueError(f"parts must be contiguous, got strides {parts.stride()}")
    m = parts.shape[2]
    z_y = _row_vector("z_y", z_y, m, parts.device)
    ids = v.int_tensor("ids", ids)
    v.same_shape("ids", ids, "parts' rows", (m,))
    for name, t in (("z_y", z_y), ("ids", ids)):
        v.same_device(name, t, "parts", parts.device)
    vocab_size = v.positive_int("vocab_size", vocab_size)
    ignore_index = v.integer("ignore_index", ignore_index)
    with_entropy = parts.shape[0] == 3
    logp = torch.empty(m, dtype=torch.float32, device=parts.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else None
    if m == 0:
        return logp, lse, entropy
    cfg = config or LinearHeadConfig()
    rows, tiles = cfg.combine_rows, cfg.combine_tiles
    with _device_guard(parts):
        _launch_combine(
            (_cdiv(m, rows),),
            (logp, lse, entropy if with_entropy else logp, parts[0], parts[1], parts[-1],
             z_y.contiguous(), ids.contiguous(), m, vocab_size, parts.shape[1], ignore_index),
            {"BLOCK_R": rows, "BLOCK_T": tiles, "WITH_ENTROPY": with_entropy},
            {"num_warps": max(1, min(4, rows * tiles // 256)), "enable_fp_fusion": FP_FUSION},
        )  # fmt: skip
    return logp, lse, entropy


def linear_head_stats(
    h: torch.Tensor,
    w: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    with_entropy: bool = False,
    store_z: torch.Tensor | None = None,
    config: LinearHeadConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-token log-prob, log-sum-exp and (optionally) entropy of ``softmax((h @ w.T) / T)``,
    without an ``[M, V]`` logits buffer: :func:`stats_partials` then :func:`combine_partials`.

    Args:
        h: ``[M, H]`` bf16/fp16/fp32, contiguous, 16-byte aligned rows (hidden states).
        w: ``[V, H]`` of h's dtype, contiguous (the LM head weight).
        ids: ``[M]`` integer target ids; ``ignore_index`` rows give zeros.
        temperature: T > 0 (runtime scalar: no recompilation per value).
        with_entropy: also compute the entropy (one more partial buffer, one FMA per logit).
        store_z: ``None``, or a contiguous ``[M, V]`` fp32/fp16/bf16 tensor that receives the raw
            logits ``h @ w.T`` (not divided by T), rounded once from the fp32 accumulator.
        config: launch configuration; None: ``default_config(h.dtype)``. A row's bits depend on it.

    Returns:
        ``(logp, lse, entropy)``: fp32 ``[M]`` each (``lse`` of z = x / T, saved for
        :func:`linear_head_grad_into`); ``entropy`` is None unless ``with_entropy``.
    """
    _, ignore_index = _scalars(temperature, ignore_index)
    parts, z_y = stats_partials(
        h, w, ids, temperature=temperature, with_entropy=with_entropy, store_z=store_z, config=config
    )
    return combine_partials(
        parts, z_y, ids, vocab_size=w.shape[0], ignore_index=ignore_index, config=config
    )


def linear_head_stats_shifted(
    h: torch.Tensor,
    w: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    with_entropy: bool = False,
    config: LinearHeadConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """:func:`linear_head_stats` that also keeps what the logits gradient needs, in half the bytes of
    fp32 logits: ``out [M, V]`` (16-bit, contiguous) receives ``d = (z − m_t)·log2 e`` per element,
    z = x / T shifted by the max ``m_t`` of its row within its ``block_n``-column tile (floored at
    −200: exp2 of less is 0 in fp32). The entries that carry probability mass have d near 0, where a
    16-bit value is accurate to ~2⁻⁹·|d| (unshifted bf16 logits lose ~2⁻⁹·|z|, with |z| ≈ 10–30).

    Returns:
        ``(logp, lse, entropy, tile_max)``: as :func:`linear_head_stats`, plus fp32
        ``tile_max [n_tiles, M]`` (the m_t) for :func:`linear_head_grad_from_shifted`.
    """
    _, ignore_index = _scalars(temperature, ignore_index)
    out = _check_output("out", out, h, w.shape[0])
    if out.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"out must be bf16 or fp16 (the shifted exponents), got {v.describe(out)}")
    parts, z_y = stats_partials(
        h, w, ids, temperature=temperature, with_entropy=with_entropy, store_z=out, shifted=True,
        config=config,
    )  # fmt: skip
    logp, lse, entropy = combine_partials(
        parts, z_y, ids, vocab_size=w.shape[0], ignore_index=ignore_index, config=config
    )
    return logp, lse, entropy, parts[0]


def linear_head_grad_from_shifted(
    d: torch.Tensor,
    tile_max: torch.Tensor,
    ids: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    g_logp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    grad_out: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    config: LinearHeadConfig | None = None,
) -> torch.Tensor:
    """∂L/∂x ``[M, V]`` (L = Σ g_logp·logp + g_ent·entropy, x = h @ w.T) from the shifted exponents
    ``d`` and ``tile_max`` of :func:`linear_head_stats_shifted` (same temperature and config),
    written into ``grad_out`` (default: ``d`` itself, in place), rounded once from fp32; one
    elementwise pass (reads 2 bytes and writes 2 per logit). Ignored rows get 0.

    Args:
        d: ``[M, V]`` bf16/fp16, contiguous rows; tile_max: fp32 ``[ceil(V / block_n), M]``.
        ids, lse, entropy, g_logp, g_ent: as in :func:`linear_head_grad_into`.
        grad_out: ``[M, V]`` 16-bit or fp32, or None (``d``).
    """
    cfg = config or LinearHeadConfig()
    temperature, ignore_index = _scalars(temperature, ignore_index)
    d = v.float_tensor("d", d)
    if d.dtype not in (torch.bfloat16, torch.float16) or d.dim() != 2 or d.stride(1) != 1:
        raise ValueError(f"d must be a bf16/fp16 [M, V] tensor with contiguous rows, got {v.describe(d)}")
    m, n = d.shape
    out = d if grad_out is None else _check_output("grad_out", grad_out, d, n)
    n_tiles = _cdiv(n, cfg.block_n)
    tile_max = v.float_tensor("tile_max", tile_max)
    v.same_shape("tile_max", tile_max, "[n_tiles, M]", (n_tiles, m))
    if tile_max.dtype != torch.float32 or not tile_max.is_contiguous():
        raise ValueError(f"tile_max must be contiguous fp32, got {v.describe(tile_max)}")
    ids = v.int_tensor("ids", ids)
    v.same_shape("ids", ids, "d's rows", (m,))
    lse = _row_vector("lse", lse, m, d.device)
    if g_ent is not None and entropy is None:
        raise ValueError("entropy must be given with g_ent (the gradient of the entropy needs it)")
    g_logp = _row_vector("g_logp", g_logp, m, d.device) if g_logp is not None else None
    g_ent = _row_vector("g_ent", g_ent, m, d.device) if g_ent is not None else None
    entropy = _row_vector("entropy", entropy, m, d.device) if g_ent is not None else None
    for name, t in (("tile_max", tile_max), ("ids", ids), ("out", out)):
        v.same_device(name, t, "d", d.device)
    if m == 0:
        return out
    if g_logp is None and g_ent is None:
        return out.zero_()
    with _device_guard(d):
        _launch_shifted_grad(
            (_cdiv(m, SHIFTED_GRAD_ROWS), n_tiles),
            (d, out, d.stride(0), out.stride(0), tile_max, ids.contiguous(), lse,
             entropy if entropy is not None else lse, g_logp if g_logp is not None else lse,
             g_ent if g_ent is not None else lse, m, n, temperature, ignore_index),
            {"BLOCK_R": SHIFTED_GRAD_ROWS, "BLOCK_N": cfg.block_n, "HAS_GRAD_LOGP": g_logp is not None,
             "HAS_GRAD_ENTROPY": g_ent is not None},
            {"num_warps": SHIFTED_GRAD_WARPS, "enable_fp_fusion": FP_FUSION},
        )  # fmt: skip
    return out


def linear_head_grad_into(
    h: torch.Tensor,
    w: torch.Tensor,
    ids: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    g_logp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    grad_out: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    config: LinearHeadConfig | None = None,
) -> None:
    """Fill ``grad_out [M, V]`` with ∂L/∂x, x = h @ w.T, for L = Σ g_logp·logp + g_ent·entropy,
    recomputing the logits tile by tile (the formula is in the module docstring).

    Args:
        h, w, ids: as in :func:`linear_head_stats` (the same values).
        lse: fp32 ``[M]`` from :func:`linear_head_stats` (same temperature).
        entropy: fp32 ``[M]`` from :func:`linear_head_stats`; needed when ``g_ent`` is given.
        g_logp, g_ent: fp32 ``[M]`` upstream gradients, or None (zero).
        grad_out: contiguous ``[M, V]`` bf16/fp16/fp32; rounded once from fp32. Ignored rows get 0.
        config: as in :func:`linear_head_stats` (pass the same one).
    """
    cfg = _check_operands(h, w, ids, config)
    temperature, ignore_index = _scalars(temperature, ignore_index)
    m, k = h.shape
    n = w.shape[0]
    grad_out = _check_output("grad_out", grad_out, h, n)
    lse = _row_vector("lse", lse, m, h.device)
    if g_ent is not None and entropy is None:
        raise ValueError("entropy must be given with g_ent (the gradient of the entropy needs it)")
    g_logp = _row_vector("g_logp", g_logp, m, h.device) if g_logp is not None else None
    g_ent = _row_vector("g_ent", g_ent, m, h.device) if g_ent is not None else None
    entropy = _row_vector("entropy", entropy, m, h.device) if g_ent is not None else None
    if m == 0:
        return
    if g_logp is None and g_ent is None:
        grad_out.zero_()
        return
    h_desc, w_desc, g_arg, g_tma, split = _descriptors(h, w, grad_out, cfg)
    programs = _programs(h, m, n, cfg)
    _launch_gemm(
        _launch_grad, programs,
        (g_arg, n, h_desc, w_desc, ids.contiguous(), lse,
         entropy if entropy is not None else lse, g_logp if g_logp is not None else lse,
         g_ent if g_ent is not None else lse, m, n, k, programs, temperature, ignore_index),
        {"HAS_GRAD_LOGP": g_logp is not None, "HAS_GRAD_ENTROPY": g_ent is not None, "G_TMA": g_tma,
         "STORE_SPLIT": split},
        h, cfg,
    )  # fmt: skip
