"""Which rows of a call the chunk engine reads, and where their results go back.

Padding compaction (both autograd Functions of :mod:`rlkernel.ops._linear_function`): the rows whose
id is ``ignore_index`` are neither staged nor projected; :func:`active_rows` finds the others (one
launch, ``kernels.ids.active_rows``, and one host sync: their count sizes the chunk loop) and
:func:`scatter_rows` puts per-row results back at their places. :func:`hidden_rows` reads the
caller's ``hidden`` in place where it can (a sliced ``[B, P + T, H]`` trainer output included:
:func:`strided_rows`), and :class:`HiddenLayout` turns dhidden rows back into a gradient of
hidden's shape.
"""

from __future__ import annotations

import dataclasses

import torch

from rlkernel.kernels import ids as id_kernels


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
    """How the engine reads the caller's ``hidden``: ``rows`` ``[R, H]`` (the staging reads it;
    dhidden is built in its row space), ``index`` the positions in it of the engine's rows (None:
    ``rows`` is hidden flattened and the engine's ``row_index`` applies), ``layout`` the way back."""

    rows: torch.Tensor
    index: torch.Tensor | None
    layout: HiddenLayout


def strided_rows(hidden: torch.Tensor) -> tuple[int, int] | None:
    """``(T, step)`` when the rows of a 3-D ``hidden`` ``[B, T, H]`` can be read in place through a
    ``[R, H]`` view of its storage rows, R = (B − 1)·step + T, row ``(b, t)`` at storage row
    ``b·step + t``: rows of one pitch >= H, each batch entry starting on that pitch, never
    overlapping, and not already viewable as ``[N, H]`` (what slicing a trainer's ``[B, P + T, H]``
    hidden states gives: ``base[:, P - 1:-1]``). None otherwise."""
    if hidden.dim() != 3 or hidden.shape[:-1].numel() == 0 or hidden.stride(2) != 1:
        return None
    b, t, hdim = hidden.shape
    s0, s1 = hidden.stride(0), hidden.stride(1)
    if b == 1 or s0 == t * s1:  # viewable as [N, H]
        return None
    if s1 >= hdim and s0 % s1 == 0 and s0 // s1 >= t:
        return t, s0 // s1
    return None


def hidden_rows(
    hidden: torch.Tensor, row_index: torch.Tensor | None, storage_index: torch.Tensor | None = None
) -> HiddenRows:
    """The rows of ``hidden`` ``[..., H]`` for the engine, without copying it where it can: 2-D, or
    viewable as ``[N, H]``, as is; a 3-D hidden whose rows are evenly strided (:func:`strided_rows`),
    when only the ``row_index`` rows are read (padding compaction), through a ``[R, H]`` view of its
    storage rows at positions ``i + (i // T)·(step − T)`` (``storage_index``, from
    :func:`active_rows`; computed here when not given): no ``[N, H]`` copy (67 MB at N = 8192,
    H = 4096). Otherwise the flattening copy."""
    hdim = hidden.shape[-1]
    n = hidden.shape[:-1].numel()
    flat = HiddenLayout(hidden.shape, 0)
    if hidden.dim() == 2:
        return HiddenRows(hidden, None, flat)
    strided = strided_rows(hidden) if row_index is not None else None
    if strided is not None:
        t, step = strided
        rows = hidden.as_strided(((hidden.shape[0] - 1) * step + t, hdim), (hidden.stride(1), 1))
        if storage_index is None:
            storage_index = torch.add(row_index, row_index // t, alpha=step - t)  # two launches, not three
        return HiddenRows(rows, storage_index, HiddenLayout(hidden.shape, step))
    # Rows by count, not -1: with H = 0 the row count of an empty tensor is ambiguous to reshape.
    return HiddenRows(hidden.reshape(n, hdim), None, flat)


def active_rows(
    ids: torch.Tensor, ignore_index: int, storage: tuple[int, int] | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(row_index, storage_index)``: the indices of the rows whose id is not ``ignore_index``
    (int64, increasing) and, given ``storage = (T, step)`` (:func:`strided_rows`), their storage
    rows in a hidden read in place (else None); ``(None, None)`` when every row is active (nothing
    to compact); ``ids`` flat and contiguous. One launch and one host sync (the count sizes the row
    loop); none, and no compaction, inside CUDA-graph capture (a sync cannot be captured)."""
    if ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return None, None
    n = ids.numel()
    t, step = storage if storage is not None else (1, 1)
    out = id_kernels.active_rows(ids, ignore_index, t, step - t, storage=storage is not None)
    count = int(out[2 * n if storage is not None else n])  # the host sync
    if count == n:
        return None, None
    return out[:count], None if storage is None else out[n : n + count]


def scatter_rows(x: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]`` zeros with ``x[i]`` at position ``idx[i]``."""
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_copy_(0, idx, x)


@dataclasses.dataclass(frozen=True)
class MaskedRows:
    """A hidden-path loss call's masked ids and padding compaction from one launch and one host read
    (:func:`masked_active_rows`)."""

    ids: torch.Tensor  # int64 [N], flat: max(id, -1) where active, ignore_index elsewhere
    active: torch.Tensor  # bool, the token shape: mask != 0
    compaction: tuple[torch.Tensor | None, torch.Tensor | None]  # active_rows' (row_index, storage_index)
    bad: int  # active ids outside [0, V) (0 without the check)
    first_key: int  # the first one's key (kernels.ids' layout)


def masked_active_rows(
    token_ids: torch.Tensor, mask: torch.Tensor, hidden: torch.Tensor, ignore_index: int, vocab_size: int,
    *, check: bool,
) -> MaskedRows | None:  # fmt: skip
    """What ``rl.token_loss.masked_token_ids``, :func:`active_rows` of its ids (for ``hidden``'s row
    layout, :func:`strided_rows`) and the id check of the active ids (``check``) give, in one launch
    (``kernels.ids.masked_rows``) and one host sync, the compaction's count read together with the
    check's two numbers: nothing else host-bound before it. None where that does not apply (ids or
    mask not contiguous or not of one shape, no token, CUDA-graph capture: no sync can be made),
    and the caller takes the separate steps."""
    if (
        not (token_ids.is_contiguous() and mask.is_contiguous())
        or mask.shape != token_ids.shape
        or token_ids.numel() == 0
        or (token_ids.is_cuda and torch.cuda.is_current_stream_capturing())
    ):
        return None
    n = token_ids.numel()
    storage = strided_rows(hidden)
    t, step = storage if storage is not None else (1, 1)
    out, active, tail = id_kernels.masked_rows(
        token_ids, mask, ignore_index, vocab_size, seq_len=t, gap=step - t, storage=storage is not None,
        check=check,
    )  # fmt: skip
    count, bad, key = out[tail : tail + 3].tolist()  # the host sync (the count sizes the row loop)
    if not check:
        bad, key = 0, 0
    # The views in one op (host time): ids, the positions, and with storage their storage rows.
    sizes = [n, count, n - count] + ([count, n - count] if storage is not None else []) + [3]
    parts = torch.split_with_sizes(out, sizes)
    if count == n:
        compaction = (None, None)
    else:
        compaction = (parts[1], None if storage is None else parts[3])
    return MaskedRows(parts[0], active, compaction, bad, key)
