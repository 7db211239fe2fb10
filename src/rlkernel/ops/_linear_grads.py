"""The gradient side of the chunk engine: a group's dweight accumulation, the whole-batch gradients,
the fused loss's upstream scale, and the per-row vectors the logits-gradient kernels read.

:func:`accumulate_dweight` adds one gradient group's ``Grᵀ @ h`` to the dweight accumulator (fp32
through ``mm(out_dtype=fp32)`` where torch has it: :func:`mm_out_dtype_supported`);
:func:`whole_batch_grads` makes dhidden, dweight and dbias of a whole-batch group in two GEMMs
(:class:`WholeBatchGrad`); :func:`scaled` multiplies by the fused loss's upstream gradient in fp32
with one rounding; :func:`padded_fp32` pads a chunk's per-row vector to the kernel's rows. Why
each exists: the docstring of :mod:`rlkernel.ops._linear_function`.
"""

from __future__ import annotations

import dataclasses

import torch

_out_dtype_ok: dict[str, bool] = {}


def mm_out_dtype_supported(device: torch.device) -> bool:
    """Whether ``torch.mm(bf16, bf16, out_dtype=torch.float32)`` runs on this device type (cached)."""
    key = device.type
    if key not in _out_dtype_ok:
        try:
            a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
            torch.mm(a, a, out_dtype=torch.float32)
            acc = torch.zeros(16, 16, dtype=torch.float32, device=device)
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            _out_dtype_ok[key] = bool(acc[0, 0].item() == 16.0)
        except (RuntimeError, TypeError, NotImplementedError):
            _out_dtype_ok[key] = False
    return _out_dtype_ok[key]


@dataclasses.dataclass
class WholeBatchGrad:
    """A whole-batch group: ``grad [n, V]`` (∂L/∂z of every staged row) and ``hidden [n, H]`` (the
    staged rows), both in the input dtype; ``row_index`` (compaction: the rows' places) or None."""

    grad: torch.Tensor
    hidden: torch.Tensor
    row_index: torch.Tensor | None


def whole_batch_grads(
    wb: WholeBatchGrad,
    weight: torch.Tensor,
    hidden_rows: int,
    need_h: bool,
    need_w: bool,
    need_b: bool,
    scale: torch.Tensor | None = None,
):
    """dhidden ``[hidden_rows, H]``, dweight ``[V, H]`` (weight dtype), fp32 dbias ``[V]`` of a
    whole-batch group, each times the fp32 0-dim ``scale`` (None: 1), from two GEMMs.

    dweight is one GEMM over every row (K = m): fp32 accumulation inside it and one rounding, no
    V·H accumulator. ``scale`` (the fused loss's upstream gradient, on the device: no sync) is
    applied to the ``[m, H]`` hidden rows before that GEMM (bf16: exact for powers of two, else one
    rounding of each hidden value, as autograd through plain torch rounds the scaled logits
    gradient), and to dhidden and dbias after theirs."""
    # The real rows only (these GEMMs' shapes fix no logp bit).
    g, hb = wb.grad, wb.hidden
    dh = dw = db = None
    if need_h:
        part = torch.mm(g, weight)
        if wb.row_index is not None:  # scattered back to the rows' places (the others stay 0)
            dh = torch.zeros(hidden_rows, part.shape[1], dtype=part.dtype, device=part.device)
            dh.index_copy_(0, wb.row_index, part)
        else:
            dh = part
        if scale is not None:
            scaled(dh, scale, out=dh)
    if need_w:
        hs = hb if scale is None else scaled(hb, scale)
        if g.device.type != "cuda" and g.dtype != torch.float32:  # CPU: fp32 math on upcast copies
            dw = torch.mm(g.t().float(), hs.float()).to(weight.dtype)
        else:
            dw = torch.mm(g.t(), hs)
    if need_b:
        db = g.sum(0, dtype=torch.float32)
        if scale is not None:
            db = db * scale
    return dh, dw, db


def scaled(x: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x · scale`` as an fp32 product (fp32 0-dim ``scale`` on the device, not rounded to ``x``'s
    dtype first, as ``torch.mul`` of a 16-bit tensor does), rounded once to ``out``'s dtype (default:
    a new tensor like ``x``); ``out`` may be ``x`` (in place). On CUDA with contiguous operands one
    streaming Triton pass (``kernels.scale_cast``: PyTorch's mixed-dtype product runs at ~1 TB/s on
    the H100), elsewhere the same arithmetic in torch ops."""
    scale = scale.reshape(()).to(torch.float32)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.is_cuda and x.is_contiguous() and out.is_contiguous() and x.numel() == out.numel():
        from rlkernel.kernels.scale_cast import scale_cast_into

        scale_cast_into(x.view(-1), out.view(-1), scale)
        return out
    return out.copy_(x.to(torch.float32) * scale)


def padded_fp32(x: torch.Tensor | None, c: int, start: int, n: int) -> torch.Tensor | None:
    """Contiguous fp32 ``[c]`` with ``x[start:start + n]`` first and zeros after (None stays None),
    as the unchecked kernel launchers read it; a full chunk (n == c) is the fp32 slice itself (copied
    only if not contiguous, e.g. an expanded upstream gradient), without a zero fill."""
    if x is None:
        return None
    if n == c:
        return x[start : start + n].to(torch.float32).contiguous()
    out = torch.zeros(c, dtype=torch.float32, device=x.device)
    out[:n] = x[start : start + n]
    return out


def accumulate_dweight(acc: torch.Tensor, gt: torch.Tensor, hb: torch.Tensor, first: bool) -> None:
    """``acc (=|+=) gt @ hb``: one group's dweight rows ``[R, H]`` from its gradient columns ``gt``
    ``[R, G]`` and hidden rows ``hb`` ``[G, H]``; the sum across groups in ``acc``'s dtype (fp32 via
    ``mm(out_dtype=fp32)`` for 16-bit inputs on CUDA). ``first`` writes instead of adding."""
    if acc.dtype == gt.dtype:  # fp32 inputs, or dweight_accum="weight"
        torch.mm(gt, hb, out=acc) if first else acc.addmm_(gt, hb)
    elif gt.device.type == "cuda" and mm_out_dtype_supported(gt.device):
        if first:
            torch.mm(gt, hb, out_dtype=torch.float32, out=acc)
        else:
            torch.addmm(acc, gt, hb, out_dtype=torch.float32, out=acc)
    elif gt.device.type == "cuda":
        # No mm(out_dtype=...) in this torch: the group's product is rounded to the input dtype
        # once (a temporary of acc's shape), the sum across groups stays fp32.
        part = torch.mm(gt, hb)
        acc.copy_(part) if first else acc.add_(part)
    else:  # CPU: fp32 math on an upcast copy of the group
        torch.mm(gt.float(), hb.float(), out=acc) if first else acc.addmm_(gt.float(), hb.float())
