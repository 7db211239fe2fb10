"""Batch-invariant ``matmul`` and ``linear``: every output row bitwise independent of the batch.

``linear(x, weight, bias)`` covers every GEMM of a decoder layer (q/k/v/o projections, the MLP, the
LM head); ``matmul(a, b)`` is the same kernel with ``weight = b.T`` (a view, no copy).

Backends (``rlkernel._dispatch``): the Triton kernel of :mod:`rlkernel.kernels.matmul` on CUDA for
fp16/bf16/fp32; the row-by-row reference of :mod:`rlkernel.reference.matmul` on CPU and for fp64.
Both are batch invariant in forward: the kernel by one K-reduction order per dtype, shared by every
launch configuration its shape-aware table (option ``matmul_table="tuned"``) can pick, which the
GPU tests re-verify (see the kernel module); the reference by computing every row through an identical
fixed-shape call.

Backward (training): ``dx = dy @ weight``, ``dweight = dy.T @ x``, ``dbias = Σ_rows dy``, all with
fp32 accumulation. On the Triton backend both GEMMs run through the same kernel by default
(option ``invariant_backward="kernel"``: no split-K, no atomics, deterministic by construction) or
through cuBLAS (``"torch"``: deterministic run to run on one GPU with its default no-atomics mode
and one stream, and faster on shapes the kernel tiles poorly), and ``dbias`` through ``torch.sum``
(a fixed-order tree reduction on CUDA, no atomics). On the reference backend they are plain
``torch.mm`` in fp32.
Batch invariance is a forward property; ``dweight`` sums over the batch and naturally depends on it.

The kernels are registered as ``torch.library`` custom ops (``rlkernel::invariant_linear``), so
``torch.compile(fullgraph=True)`` traces calls to them instead of breaking at a Triton launch.

Caveats:
    * Under autocast the inputs are cast to the autocast dtype first (as ``F.linear`` does); the
      computation itself then runs with autocast disabled, so the result is bitwise that of the
      same call on the cast inputs outside autocast, on both backends.
    * The kernel and the reference give different (both accurate) bits: invariance holds within one
      backend. A rollout and a trainer must use the same backend, GPU model, Triton version and
      kernel table (the ``matmul_table`` option and ``rlkernel.kernels.matmul_table.TUNED``).
    * The options (``matmul_table``, ``matmul_thresholds``, ``invariant_backward``) are read once per
      call, when the forward runs; its backward uses the forward's.
"""

from __future__ import annotations

import torch

from rlkernel import _dispatch
from rlkernel import _validate as check
from rlkernel._autocast import autocast_disabled, autocast_enabled, without_autocast
from rlkernel._options import DEFAULTS, MatmulThresholds, current_options
from rlkernel.reference import matmul as ref

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ------------------------------------------------------------------------------------ custom ops
# The table options travel as plain values (a custom op's schema takes str and int lists):
# ``table`` = the option matmul_table, ``thresholds`` = the four ints of matmul_thresholds.
@torch.library.custom_op("rlkernel::invariant_linear", mutates_args=())
def _linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    table: str,
    thresholds: list[int],
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T (+ bias)`` through the Triton kernel; ``[M, N]`` in ``out_dtype``
    (None: x's dtype)."""
    from rlkernel.kernels import matmul as kernels

    th = _thresholds(thresholds)
    return kernels.matmul(x, weight.t(), bias=bias, table=table, thresholds=th, out_dtype=out_dtype)


@_linear_op.register_fake
def _(x, weight, bias, table, thresholds, out_dtype):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype or x.dtype)


@torch.library.custom_op("rlkernel::invariant_mm", mutates_args=())
def _mm_op(a: torch.Tensor, b: torch.Tensor, table: str, thresholds: list[int]) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` (any strides) through the Triton kernel; used by the backward."""
    from rlkernel.kernels import matmul as kernels

    return kernels.matmul(a, b, table=table, thresholds=_thresholds(thresholds))


@_mm_op.register_fake
def _(a, b, table, thresholds):
    return a.new_empty((a.shape[0], b.shape[1]))


def _threshold_list(th: MatmulThresholds) -> list[int]:
    return [th.narrow_n, th.vocab_n, th.min_tiles, th.min_tiles_tma]


_DEFAULT_THRESHOLDS = DEFAULTS.matmul_thresholds  # the object kernels.matmul_table keys as the default


def _thresholds(values: list[int]) -> MatmulThresholds:
    th = MatmulThresholds(*values)
    return _DEFAULT_THRESHOLDS if th == _DEFAULT_THRESHOLDS else th


# -------------------------------------------------------------------------------------- autograd
def _linear_fwd(x, weight, bias, backend, opts, out_dtype):
    if backend != "triton":
        return ref.linear(x, weight, bias, out_dtype=out_dtype)
    th = _threshold_list(opts.matmul_thresholds)
    return _dispatch.call_op(_linear_op, x, weight, bias, opts.matmul_table, th, out_dtype)


class _LinearFunction(torch.autograd.Function):
    """``out = x @ weight.T + bias`` on 2-D ``x``; forward batch invariant, backward deterministic.
    ``opts``: the :class:`rlkernel.Options` of the call (the backward uses the forward's);
    ``out_dtype``: the output dtype (None: x's)."""

    @staticmethod
    def forward(ctx, x, weight, bias, backend, opts, out_dtype):
        out = _linear_fwd(x, weight, bias, backend, opts, out_dtype)
        ctx.save_for_backward(x, weight)
        ctx.backend = backend
        ctx.opts = opts
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    @without_autocast
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = dw = db = None
        opts = ctx.opts
        if ctx.backend == "triton":
            # An fp32 output of half inputs (``out_dtype``): its gradient is rounded to the inputs'
            # dtype before the two GEMMs, as autograd does for ``linear(x, w).float()``.
            grad_out = grad_out.to(x.dtype)
        if ctx.backend == "triton" and opts.invariant_backward == "kernel":
            dy = grad_out.contiguous()
            table, th = opts.matmul_table, _threshold_list(opts.matmul_thresholds)
            if need_x:
                dx = _dispatch.call_op(_mm_op, dy, weight, table, th)  # [M, N] @ [N, K]
            if need_w:
                dw = _dispatch.call_op(_mm_op, dy.t(), x, table, th)  # [N, M] @ [M, K]
        elif ctx.backend == "triton":  # cuBLAS in the inputs' dtype (fp32 accumulation)
            if need_x:
                dx = torch.mm(grad_out, weight)
            if need_w:
                dw = torch.mm(grad_out.t(), x)
        else:
            acc = torch.float64 if x.dtype == torch.float64 else torch.float32
            dy = grad_out.to(acc)
            if need_x:
                dx = torch.mm(dy, weight.to(acc)).to(x.dtype)
            if need_w:
                dw = torch.mm(dy.t(), x.to(acc)).to(weight.dtype)
        if need_b and ctx.has_bias:
            db = grad_out.to(torch.float64 if x.dtype == torch.float64 else torch.float32).sum(0)
            db = db.to(weight.dtype)
        return dx, dw, db, None, None, None


# ---------------------------------------------------------------------------------------- public
def _autocast(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The inputs cast to the autocast dtype when autocast is on for their device type, as
    ``F.linear`` casts them (the only effect autocast has on this op: see rlkernel._autocast)."""
    first = tensors[0]
    device_type = "cuda" if first.is_cuda else "cpu" if first.is_cpu else None
    if device_type is not None and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return tuple(t if t is None or not t.is_floating_point() else t.to(dtype) for t in tensors)
    return tensors


def _linear_cast(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """:func:`_linear_2d` on the autocast-cast inputs, computed with autocast disabled (so the
    reference's fp32 accumulation and the backward GEMMs are not rewritten by autocast)."""
    if not autocast_enabled():
        return _linear_2d(x, weight, bias, out_dtype)
    x, weight, bias = _autocast(x, weight, bias)
    with autocast_disabled():
        return _linear_2d(x, weight, bias, out_dtype)


def _check_linear(x: object, weight: object, bias: object, names: tuple[str, str]) -> None:
    xn, wn = names
    check.float_tensor(xn, x, min_dim=1)  # K = 0 is allowed: the empty sum, as F.linear gives
    check.float_tensor(wn, weight)
    if weight.dim() != 2:
        raise ValueError(f"{wn} must be 2-D, got {check.describe(weight)}")
    check.same_device(wn, weight, xn, x.device)
    if weight.dtype != x.dtype:
        raise TypeError(f"{wn} dtype {weight.dtype} must match {xn} dtype {x.dtype}")
    if bias is not None:
        check.float_tensor("bias", bias)
        check.same_shape("bias", bias, f"{wn}.shape[:1]", weight.shape[:1])
        check.same_device("bias", bias, xn, x.device)
        if bias.dtype != x.dtype:
            raise TypeError(f"bias dtype {bias.dtype} must match {xn} dtype {x.dtype}")


def _linear_2d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    if out_dtype is x.dtype:
        out_dtype = None  # one spelling of "x's dtype" (one custom-op signature, one cache key)
    backend = _dispatch.resolve_backend(x.device, has_kernel=x.dtype in KERNEL_DTYPES)
    opts = current_options()
    wants_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    if not wants_grad and backend == "triton" and not torch.compiler.is_compiling():
        # No gradient wanted (a rollout / decode step): the kernel launcher directly, no views.
        from rlkernel.kernels import matmul as kernels

        return kernels.linear_forward(
            x, weight, bias, table=opts.matmul_table, thresholds=opts.matmul_thresholds, out_dtype=out_dtype
        )
    lead = x.shape[:-1]
    x2 = x.reshape(lead.numel(), x.shape[-1])  # rows by count, not -1: K may be 0
    if wants_grad:
        out = _LinearFunction.apply(x2, weight, bias, backend, opts, out_dtype)
    else:
        out = _linear_fwd(x2, weight, bias, backend, opts, out_dtype)
    return out.reshape(*lead, weight.shape[0])


def _accepted(x: object, weight: object, bias: object) -> bool:
    """True when every check of :func:`linear` passes (a few attribute reads; the common case)."""
    return (
        isinstance(x, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and x.dtype in check.FLOAT_DTYPES
        and weight.dtype is x.dtype
        and weight.dim() == 2
        and x.dim() >= 1
        and x.shape[-1] >= 1
        and weight.shape[1] == x.shape[-1]
        and x.device == weight.device
        and (
            bias is None
            or (
                isinstance(bias, torch.Tensor)
                and bias.dtype is x.dtype
                and bias.dim() == 1
                and bias.shape[0] == weight.shape[0]
                and bias.device == x.device
            )
        )
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Batch-invariant ``x @ weight.T + bias`` (``torch.nn.functional.linear``), differentiable.

    Each output row is bitwise identical whatever else is in the batch (M = 1 … 100k rows, slices,
    padding): one K-reduction order per (dtype, N, K), no split-K, no autotuning. Accumulation is
    fp32 (fp64 for fp64 inputs); the result is rounded once to ``out_dtype``, bias included.

    Args:
        x: ``[..., K]`` float16/bfloat16/float32/float64 (leading dims are rows).
        weight: ``[N, K]`` as in ``nn.Linear``, same dtype and device as ``x``.
        bias: optional ``[N]``, same dtype and device.
        out_dtype: None (``x``'s dtype) or ``torch.float32``: the fp32 accumulator itself, not
            rounded to 16 bits (the fp32 logits of ``patch_hf_model(..., lm_head_dtype=torch.float32)``).
            Its gradient is rounded to ``x``'s dtype before the backward GEMMs.

    Returns:
        ``[..., N]`` in ``out_dtype`` (``x``'s dtype by default).

    Raises:
        TypeError: non-float inputs, mismatched dtypes.
        ValueError: weight not 2-D, ``weight.shape[1] != x.shape[-1]``, bias not ``[N]``,
            devices differ, ``out_dtype`` neither None, ``x.dtype`` nor ``torch.float32``.
    """
    if not _accepted(x, weight, bias):  # the full checks (they raise) only off the common path
        _check_linear(x, weight, bias, ("x", "weight"))
        if weight.shape[1] != x.shape[-1]:
            raise ValueError(
                f"weight must be [N, K] with K = x.shape[-1] = {x.shape[-1]}, got {check.describe(weight)}"
            )
    if out_dtype is not None:
        check_out_dtype("out_dtype", out_dtype, x.dtype)
    return _linear_cast(x, weight, bias, out_dtype)


def check_out_dtype(name: str, out_dtype: object, x_dtype: torch.dtype) -> None:
    """``out_dtype`` must be ``x_dtype`` or ``torch.float32`` (for 16-bit or fp32 inputs: an fp64
    product rounded to fp32 is not an LM head's output any invariant path reproduces)."""
    if out_dtype is x_dtype or (out_dtype is torch.float32 and x_dtype in KERNEL_DTYPES):
        return
    raise ValueError(
        f"{name} must be None, the input dtype ({x_dtype}) or torch.float32 (for float16/bfloat16/float32 "
        f"inputs), got {out_dtype!r}"
    )


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batch-invariant ``a @ b``, differentiable: ``linear(a, b.T)`` (a view, no copy).

    Args:
        a: ``[..., K]`` float16/bfloat16/float32/float64.
        b: ``[K, N]``, same dtype and device.

    Returns:
        ``[..., N]`` in ``a``'s dtype.

    Raises:
        TypeError / ValueError: as :func:`linear` (naming ``a`` and ``b``).
    """
    _check_linear(a, b, None, ("a", "b"))
    if b.shape[0] != a.shape[-1]:
        raise ValueError(f"b must be [K, N] with K = a.shape[-1] = {a.shape[-1]}, got {check.describe(b)}")
    return _linear_cast(a, b.t(), None)
