"""Staging of the linear path's row groups in one launch: a group's hidden rows and ids gathered
into the chunk engine's fixed buffers (``rlkernel.ops._linear_engine_base.ChunkEngine.stage``).

Destination row ``j < m`` of ``h_out [m, H]`` / ``ids_out [m]`` takes source row ``start + j``, or
with padding compaction row ``hidden_index[start + j]`` of ``hidden`` and id ``ids[row_index[start +
j]]``, for ``j < n``; rows ``n <= j < m`` (the padded tail of a chunk) are zeros with id
``ignore_index``. With ``zero_ignored`` a row whose id is ``ignore_index`` is staged as zeros, so
that garbage (NaN) hidden states at ignored positions reach no GEMM sum. Every value is a copy or
an exact zero: the result is bitwise what ``index_select`` / ``copy_`` + ``masked_fill_`` + ``zero_``
+ ``fill_`` give, in one launch instead of two to five (each ~30 µs of host time on the H100 host,
before the call's first GEMM).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels._launch import FastLauncher, cdiv
from rlkernel.kernels._launch import device_guard as _device_guard

# A program copies BLOCK_R rows × BLOCK_H columns (2 KB per bf16 row piece): a streaming copy, no
# bit depends on these.
BLOCK_R = 8
MAX_BLOCK_H = 1024


@triton.jit(do_not_specialize=["start", "n", "m", "hdim", "ignore_index"])
def _stage_rows_kernel(
    # outputs
    h_out,
    ids_out,
    # inputs
    hidden,
    stride_hr,
    stride_hc,
    ids,
    hidden_index,
    row_index,
    # sizes and runtime scalars
    start,
    n,
    m,
    hdim,
    ignore_index,
    # meta
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INDEXED: tl.constexpr,
    ZERO_IGNORED: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    real = j < n
    if INDEXED:
        src = tl.load(hidden_index + start + j, mask=real, other=0).to(tl.int64)
        pos = tl.load(row_index + start + j, mask=real, other=0).to(tl.int64)
    else:
        src = start + j
        pos = start + j
    y = tl.load(ids + pos, mask=real, other=ignore_index).to(tl.int64)
    keep = real
    if ZERO_IGNORED:
        keep = keep & (y != ignore_index)
    in_cols = cols < hdim
    x = tl.load(hidden + src[:, None] * stride_hr + cols[None, :] * stride_hc,
                mask=keep[:, None] & in_cols[None, :], other=0.0)  # fmt: skip
    tl.store(h_out + j[:, None] * hdim + cols[None, :], x, mask=(j < m)[:, None] & in_cols[None, :])
    if tl.program_id(1) == 0:
        tl.store(ids_out + j, tl.where(real, y, ignore_index), mask=j < m)


_launch = FastLauncher(_stage_rows_kernel)


def stage_rows_unchecked(
    h_out: torch.Tensor,
    ids_out: torch.Tensor,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    start: int,
    n: int,
    m: int,
    ignore_index: int,
    hidden_index: torch.Tensor | None = None,
    row_index: torch.Tensor | None = None,
    zero_ignored: bool = False,
) -> None:
    """Stage ``m`` rows (``n`` real) into ``h_out`` (contiguous, at least ``[m, H]``, hidden's dtype)
    and ``ids_out`` (contiguous int64, at least ``[m]``) from ``hidden [R, H]`` (any strides) and
    the flat contiguous ``ids``; ``hidden_index`` and ``row_index`` (contiguous int64, both or
    neither): padding compaction's source rows. The caller (the chunk engine) made every argument:
    nothing is checked here."""
    if m == 0:
        return
    hdim = hidden.shape[1]
    block_h = min(MAX_BLOCK_H, max(16, 1 << (hdim - 1).bit_length()))
    indexed = hidden_index is not None
    with _device_guard(hidden):
        _launch(
            (cdiv(m, BLOCK_R), max(1, cdiv(hdim, block_h))),
            (h_out, ids_out, hidden, hidden.stride(0), hidden.stride(1), ids,
             hidden_index if indexed else ids, row_index if indexed else ids, start, n, m, hdim,
             ignore_index),
            {"BLOCK_R": BLOCK_R, "BLOCK_H": block_h, "INDEXED": indexed, "ZERO_IGNORED": zero_ignored},
            {"num_warps": 4},
        )  # fmt: skip
