"""Which rows of a call the chunk engine reads, and where their results go back.

Padding compaction (both autograd Functions of :mod:`rlkernel.ops._linear_function`): the rows whose
id is ``ignore_index`` are neither staged nor projected; :func:`active_rows` finds the others (one
host sync: their count sizes the chunk loop) and :func:`scatter_rows` puts per-row results back at
their places. :func:`hidden_rows` reads the caller's ``hidden`` in place where it can (a sliced
``[B, P + T, H]`` trainer output included), and :class:`HiddenLayout` turns dhidden rows back into
a gradient of hidden's shape.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class HiddenLayout:
    """Where the rows of the caller's ``hidden`` ``[..., H]`` sit in the engine's ``[R, H]`` row space:
    ``step`` 0, hidden flattened; else ``step`` storage rows per index of hidden's first dim."""

    shape: torch.Size
    step: int

    def grad(self, dh: torch.Tensor | None) -> torch.Tensor | None:
        """dhidden ``[R, H]`` (contiguous) as a gradient of hidden's shape (a view, no copy)."""
        if dh is None or self.step == 0:
            return None if dh is None else dh.view(self.shape)
        h = self.shape[-1]
        return dh.as_strided(self.shape, (self.step * h, h, 1))


@dataclasses.dataclass(frozen=True)
class HiddenRows:
    """How the engine reads the caller's ``hidden``: ``rows`` ``[R, H]`` (index_select reads it;
    dhidden is built in its row space), ``index`` the positions in it of the engine's rows (None:
    ``rows`` is hidden flattened and the engine's ``row_index`` applies), ``layout`` the way back."""

    rows: torch.Tensor
    index: torch.Tensor | None
    layout: HiddenLayout


def hidden_rows(hidden: torch.Tensor, row_index: torch.Tensor | None) -> HiddenRows:
    """The rows of ``hidden`` ``[..., H]`` for the engine, without copying it where it can: 2-D, or
    viewable as ``[N, H]``, as is; a 3-D ``[B, T, H]`` whose rows are evenly strided (what slicing a
    trainer's ``[B, P + T, H]`` hidden states gives: ``base[:, P - 1:-1]``), when only the
    ``row_index`` rows are read (padding compaction), through a ``[R, H]`` view of its storage rows
    (R = (B − 1)·step + T) at positions ``i + (i // T)·(step − T)``: two small ops instead of a
    ``[N, H]`` copy (67 MB at N = 8192, H = 4096). Otherwise the flattening copy."""
    hdim = hidden.shape[-1]
    n = hidden.shape[:-1].numel()
    flat = HiddenLayout(hidden.shape, 0)
    if hidden.dim() == 2:
        return HiddenRows(hidden, None, flat)
    if hidden.dim() == 3 and row_index is not None and n > 0 and hidden.stride(2) == 1:
        b, t = hidden.shape[0], hidden.shape[1]
        s0, s1 = hidden.stride(0), hidden.stride(1)
        viewable = b == 1 or s0 == t * s1
        # Rows of one pitch s1 >= H, batch starts on that pitch and never overlapping (step >= T).
        if not viewable and s1 >= hdim and s0 % s1 == 0 and s0 // s1 >= t:
            step = s0 // s1
            rows = hidden.as_strided(((b - 1) * step + t, hdim), (s1, 1))
            index = torch.add(row_index, row_index // t, alpha=step - t)  # two launches, not three
            return HiddenRows(rows, index, HiddenLayout(hidden.shape, step))
    # Rows by count, not -1: with H = 0 the row count of an empty tensor is ambiguous to reshape.
    return HiddenRows(hidden.reshape(n, hdim), None, flat)


def active_rows(ids: torch.Tensor, ignore_index: int) -> torch.Tensor | None:
    """The indices of the rows whose id is not ``ignore_index`` (int64, increasing), or None when
    every row is active (nothing to compact). One host sync (the count sizes the row loop); none,
    and no compaction, inside CUDA-graph capture (a sync cannot be captured)."""
    if ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    idx = (ids != ignore_index).nonzero().squeeze(1)
    return None if idx.numel() == ids.numel() else idx


def scatter_rows(x: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]`` zeros with ``x[i]`` at position ``idx[i]``."""
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_copy_(0, idx, x)
