"""Logits that are a window of a larger tensor: the backward writes the gradient of the whole base.

A trainer takes the logits of the completion tokens as a view of the model output, e.g.
``out.logits[:, P - 1 : -1]`` of ``[B, P + T, V]``. Were the op's input the view, autograd's slice
backward would allocate a zero ``[B, P + T, V]`` gradient and copy the op's ``[B, T, V]`` gradient
into it: a second logits-sized buffer and two extra passes over HBM. So when the logits are such a
window, the Triton paths take the *base* as their autograd input and return its gradient directly:
one base-shaped buffer, the window written by the kernel, only the rows outside it zeroed (or, in
place, the base itself).

A window here is a box of the base's leading dims (a slice with step 1, or one index, per dim; the
vocabulary dim whole) of a contiguous base, so that the view has the base's strides: ``[:, :-1]``,
``[:, P - 1 : -1]``, ``[1:, 2:]``, packed ``[0, a:b]`` of ``[1, N, V]``. Anything else (a transposed
or reshaped view, a step, a partial vocabulary) keeps the autograd path through the view.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Window:
    """Where a view sits in its base.

    Attributes:
        index: per leading dim of the base a ``slice`` (step 1) or an ``int`` (a dim the view
            drops), then ``slice(None)`` for V.
    """

    index: tuple[slice | int, ...]

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """The window of ``t`` (the base, or a tensor of its shape): a view, no copy."""
        return t[self.index]

    def rows(self, base_shape: torch.Size) -> tuple[int, int, int] | None:
        """``(L, start, count)`` when the window is the rows ``[start, start + count)`` of the base's
        last leading dim (size L) in every slab, every other leading dim whole (or a size-1 index):
        ``[:, P - 1 : -1]`` of ``[B, P + T, V]``, packed ``[0, a:b]`` of ``[1, N, V]``. Kernels that
        know this layout write the zero rows themselves. None for any other window."""
        lead = self.index[:-1]
        for sl, n in zip(lead[:-1], base_shape, strict=False):
            if isinstance(sl, int):
                if n != 1:
                    return None
            elif sl.start != 0 or sl.stop != n:
                return None
        last = lead[-1]
        if isinstance(last, int):
            return base_shape[len(lead) - 1], last, 1
        return base_shape[len(lead) - 1], last.start, last.stop - last.start

    def zero_outside(self, t: torch.Tensor) -> None:
        """Zero every row of ``t`` (the base's shape) outside the window: at most two slices per
        leading dim (before and after the window), never a row inside it.

        The slices are cut into contiguous chunks (``[b, :P-1]`` per sequence of a ``[B, P+T, V]``
        base) and zeroed by one ``torch._foreach_zero_``: a strided ``zero_()`` of a base with more
        than 2³¹ elements runs as TensorIterator's split, non-vectorized kernels at about half the
        copy bandwidth (two 100 µs kernels for the 309 MB of prompt rows at V = 151,936 on an
        H100, 2026-11-24)."""
        chunks: list[torch.Tensor] = []
        for d, sl in enumerate(self.index[:-1]):
            prefix = self.index[:d]
            start, stop = (sl, sl + 1) if isinstance(sl, int) else (sl.start, sl.stop)
            if start > 0:
                chunks += _contiguous_chunks(t[(*prefix, slice(0, start))])
            if stop < t.shape[d]:
                chunks += _contiguous_chunks(t[(*prefix, slice(stop, None))])
        if chunks:
            torch._foreach_zero_(chunks)


MAX_CHUNKS = 256  # beyond this many pieces per slice, one strided zero_() costs less host time


def _contiguous_chunks(x: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``x`` that are each contiguous and together cover it (``x`` itself when contiguous
    or when splitting would take more than ``MAX_CHUNKS`` views)."""
    if x.numel() == 0:
        return []
    if x.is_contiguous() or x.dim() < 2 or x.shape[0] > MAX_CHUNKS:
        return [x]
    pieces = [c for row in x.unbind(0) for c in _contiguous_chunks(row)]
    return pieces if len(pieces) <= MAX_CHUNKS else [x]


def window_of(logits: torch.Tensor) -> tuple[torch.Tensor, Window] | None:
    """``(base, window)`` when ``logits`` is a box window (not the whole) of a contiguous base that
    requires grad, else None. (Every call of an eager loss asks: each property is read once.)"""
    base = logits._base
    if base is None or not base.requires_grad or not torch.is_grad_enabled():
        return None
    dropped = base.dim() - logits.dim()  # the leading dims the view drops (one index each)
    shape, base_shape, base_stride = logits.shape, base.shape, base.stride()
    if (
        dropped < 0
        or not shape
        or base.dtype != logits.dtype
        or not base.is_contiguous()
        or shape[-1] != base_shape[-1]
        or logits.stride() != base_stride[dropped:]
        or logits.numel() == 0
    ):
        return None
    offset = logits.storage_offset() - base.storage_offset()
    index: list[slice | int] = []
    whole = True  # the window covers the whole base (nothing to gain)
    for d in range(len(base_shape) - 1):
        full, stride = base_shape[d], base_stride[d]
        start, offset = divmod(offset, stride) if stride > 0 else (0, offset)
        if d < dropped:
            if start >= full:
                return None
            index.append(start)
            whole = False
        else:
            size = shape[d - dropped]
            if start + size > full:
                return None
            index.append(slice(start, start + size))
            whole = whole and start == 0 and size == full
    if offset != 0 or whole:  # an offset inside a row (not a box of whole rows), or the whole base
        return None
    index.append(slice(None))
    return base, Window(tuple(index))
