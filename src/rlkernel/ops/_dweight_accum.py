"""The grouped loop's dweight accumulator, whose final cast leaves nothing else behind.

The linear path's grouped loop (:mod:`rlkernel.ops._linear_function`) sums each gradient group's
``Grᵀ @ h`` into an fp32 ``[V, H]`` accumulator and hands the weight its gradient in the weight's
16-bit dtype at the end. That gradient is cast into the accumulator's own bytes (no second V·H
buffer at the cast), but a gradient that is a view of a twice-as-large fp32 block keeps the whole
block alive as ``weight.grad`` until the optimizer zeroes it: in a trainer, through the backbone's
backward, where the step's peak is (``scripts/trl_trainer_compare.py --memory-breakdown``, H = 1024:
0.58 GiB held where TRL's head holds its 0.29 GiB bf16 gradient).

So the fp32 accumulator is two allocations: ``top`` holds rows ``[0, V1)`` in exactly the bytes of
the final 16-bit ``[V, H]`` gradient (V1 ≈ V / 2), ``bottom`` the rows ``[V1, V)``. The cast writes
top's rows into the first half of its own bytes (slab by slab, :func:`_cast_into_own_storage`), then
bottom's rows, from their own allocation, into top's second half (already read); bottom is freed
and the gradient is ``top``'s bytes, exactly its size. Each group's dweight GEMM runs once per part
(two GEMMs of V/2 output rows: the same work).
"""

from __future__ import annotations

import torch

from rlkernel.ops._linear_grads import scaled

# Slab of the in-place cast (see _cast_into_own_storage): its temporary for slab 0 is this large.
CAST_SLAB_BYTES = 64 << 20
# Rows of ``top`` are a multiple of this: the bottom part's columns of a 16-bit gradient group start
# 16-byte aligned (cuBLAS's fast kernels want aligned operands).
SPLIT_ROW_MULTIPLE = 8


class DweightAccumulator:
    """dweight ``[V, H]`` summed over gradient groups; ``parts`` are ``(columns of a gradient group
    [G, V], accumulator rows)`` pairs: ``(None, acc)`` for one part (an accumulator in the weight's
    own dtype: fp32 weights or ``dweight_accum="weight"``), else the two fp32 parts ``top``/``bottom``
    described in the module docstring.

    Args:
        weight: the ``[V, H]`` weight (its shape, dtype and device).
        accum: ``"fp32"`` or ``"weight"`` (the option ``linear_dweight_accum``).
    """

    def __init__(self, weight: torch.Tensor, accum: str) -> None:
        v, h = weight.shape
        self.shape, self.out_dtype = (v, h), weight.dtype
        dt = torch.float32 if accum == "fp32" else weight.dtype
        dev = weight.device
        # ceil(V / 2) rounded up to SPLIT_ROW_MULTIPLE: top's bytes hold the whole 16-bit gradient.
        v1 = -(-v // 2 // SPLIT_ROW_MULTIPLE) * SPLIT_ROW_MULTIPLE
        if dt == weight.dtype or v1 >= v:  # same dtype (nothing to cast), or too few rows to split
            # Uninitialized: the first group's GEMM writes it (beta = 0); no rows: zero_().
            self.parts = [(None, torch.empty(v, h, dtype=dt, device=dev))]
        else:
            top = torch.empty(v1, h, dtype=dt, device=dev)
            bottom = torch.empty(v - v1, h, dtype=dt, device=dev)
            self.parts = [(slice(0, v1), top), (slice(v1, v), bottom)]

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0][1].dtype

    def zero_(self) -> None:
        """Zero every part (a call with no rows: no group wrote them)."""
        for _, part in self.parts:
            part.zero_()

    def finish(self, scale: torch.Tensor | None = None) -> torch.Tensor:
        """The gradient ``[V, H]`` in the weight's dtype, times the fp32 0-dim ``scale`` (None: 1),
        one rounding from fp32; for two parts it lives in ``top``'s bytes and ``bottom`` is released.
        The accumulator is spent after this."""
        (cols, top), *rest = self.parts
        self.parts = []
        if not rest:
            if top.dtype == self.out_dtype:
                return scaled(top, scale, out=top) if scale is not None else top
            return _cast_into_own_storage(top, self.out_dtype, scale)
        v, h = self.shape
        (_, bottom) = rest[0]
        flat = top.view(-1).view(self.out_dtype)
        _cast_into_own_storage(top, self.out_dtype, scale)  # rows [0, V1): top's first half
        out_bottom = flat[cols.stop * h : v * h].view(v - cols.stop, h)  # bytes top's cast has read
        if scale is not None:
            scaled(bottom, scale, out=out_bottom)
        else:
            out_bottom.copy_(bottom)
        del bottom, rest
        return flat[: v * h].view(v, h)

    def scaled_copy(self, scale: torch.Tensor) -> torch.Tensor:
        """A new ``[V, H]`` gradient in the weight's dtype, times ``scale``; the parts are kept (a
        retained graph's backward reads them again)."""
        out = torch.empty(self.shape, dtype=self.out_dtype, device=self.parts[0][1].device)
        for cols, part in self.parts:
            scaled(part, scale, out=out if cols is None else out[cols])
        return out


def _cast_into_own_storage(acc: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """``(acc * scale).to(dtype)`` for a contiguous fp32 ``[R, H]`` accumulator and a 16-bit ``dtype``,
    written slab by slab into the first half of ``acc``'s storage (no second buffer). Slab k ≥ 1 of
    the output lies in bytes of slabs < k of the input, already consumed (stream order); slab 0 goes
    via a temporary."""
    v, h = acc.shape
    out = acc.view(-1).view(dtype)[: v * h].view(v, h)
    step = max(1, CAST_SLAB_BYTES // max(4 * h, 1))
    for start in range(0, v, step):
        rows = slice(start, min(start + step, v))
        src = acc[rows]
        if start == 0:  # overlaps its own source: through a slab-sized temporary
            out[rows].copy_(src * scale if scale is not None else src.to(dtype))
        elif scale is not None:
            scaled(src, scale, out=out[rows])  # scale and cast in one pass (fp32 math, one rounding)
        else:
            out[rows].copy_(src)
    return out
