"""The token-level loss from logits with its constants built on the device: two launches forward.

The autograd Functions of :mod:`rlkernel.ops._logprobs_function` run a token-level loss from logits
as: the masking launch, the log-prob launch, a host-built plan (~20 torch ops), the token-loss
launch, and the id check's launches. For a :class:`rlkernel._token_loss_plan.DevicePlan` (a padded
batch without rollout corrections: what a trainer's GRPO/DAPO/PPO call is) the two Functions here
run the same loss in two launches (``kernels.token_loss_rows``: mask counts, then one program per
row that masks its id, checks it, computes its statistics and its loss terms), and the backward in
one: logits that are rows of a model output (``out[:, P - 1 : -1]``) get the whole base's gradient
from one launch over the base's rows, which writes the rows outside the window as zeros too (no
separate zero fill, no view bookkeeping); other layouts take the host-plan Functions' backward.

Same bits as the host-plan route for every per-token coefficient and for the 3-pass gradient; the
loss is a fixed-order sum of the same per-row terms, taken by the rows kernel's last program (the
host plan sums block partials or ``loss_rows.sum()``: the losses may differ in the last bits).
"""

from __future__ import annotations

import torch

from rlkernel._autocast import without_autocast
from rlkernel.kernels import logprobs as kernels
from rlkernel.kernels.token_loss_rows import device_plan_forward
from rlkernel.ops import _autograd as autograd_state
from rlkernel.ops import id_checks
from rlkernel.ops._logprobs_function import (
    _INPLACE_AVOID,
    _INPLACE_WHAT,
    TokenLossFunction,
    TokenLossGradInForwardFunction,
    _base_and_window,
    upstream_scale,
)


def keep_for_backward(ctx, logits, x, window, inplace_backward, plan, temperature, ids, lse, g_logp, entropy,
                      g_entropy) -> None:  # fmt: skip
    """What :meth:`DevicePlanLossFunction.backward` reads, saved by a 3-pass device-plan forward
    (this module's, and ``ops.device_seq_plan``'s): ``logits`` as given to ``apply`` (the base of a
    row window), ``x`` the rows the kernels read, the rows kernel's ``ids`` (flat), ``lse``,
    ``g_logp`` and, with an entropy term, ``entropy`` and ``g_entropy``."""
    want_entropy = plan.want_entropy
    # A row window of the base: the backward runs over the base's rows (inputs flat, as made).
    ctx.rows = None if window is None else window.rows(logits.shape)
    ctx.inplace_backward = inplace_backward and kernels.can_write_in_place(x)
    ctx.overwritten = False
    ctx.window = window
    saved = x if window is None else logits
    ctx.save_for_backward(
        saved.detach() if ctx.inplace_backward else saved,
        ids if ctx.rows is not None else ids.view(x.shape[:-1]),
        lse,
        g_logp,
        entropy if want_entropy else None,
        g_entropy if want_entropy else None,
    )
    ctx.temperature = temperature
    ctx.ignore_index = plan.ignore_index
    ctx.set_materialize_grads(False)


def three_pass_forward(ctx, run, logits, plan, temperature, inplace_backward, window, what):
    """The forward of a 3-pass device-plan Function (this module's and ``ops.device_seq_plan``'s):
    ``run(x, plan, temperature, layout, host)`` launches its kernels over the rows ``x`` and returns
    ``(loss, logp, entropy, lse, g_logp, g_entropy, ids, counts)``; the id check is deferred and
    the backward's inputs kept (:func:`keep_for_backward`). Returns ``(loss, logp, entropy)``."""
    x, layout = _addressed(logits if window is None else window.of(logits))
    host = _host_slot(plan, x)
    loss, logp, entropy, lse, g_logp, g_entropy, ids, counts = run(x, plan, temperature, layout, host)
    _defer_id_check(plan, counts, host, x, what)
    keep_for_backward(ctx, logits, x, window, inplace_backward, plan, temperature, ids, lse, g_logp,
                      entropy, g_entropy)  # fmt: skip
    ctx.mark_non_differentiable(logp, entropy)
    return loss.view(()), logp, entropy


def _rows_forward(x, plan, temperature, layout, host):
    return device_plan_forward(x, plan, temperature=temperature, grad=None, row_layout=layout, host=host)


class DevicePlanLossFunction(torch.autograd.Function):
    """Three passes over the logits: forward = mask counts + the rows kernel (statistics, loss terms
    and the backward's inputs); backward = one gradient launch scaled by the upstream gradient (over
    the base's rows for a row window, else :class:`TokenLossFunction`'s)."""

    @staticmethod
    def forward(ctx, logits, plan, temperature, inplace_backward, window, what):
        return three_pass_forward(
            ctx, _rows_forward, logits, plan, temperature, inplace_backward, window, what
        )

    @staticmethod
    @without_autocast
    def backward(ctx, grad_loss, *unused):
        if ctx.rows is None or grad_loss is None or not ctx.needs_input_grad[0]:
            # (__wrapped__: this backward is under without_autocast already; no second wrapper)
            return (*TokenLossFunction.backward.__wrapped__(ctx, grad_loss, *unused), None)  # (what: none)
        if ctx.overwritten:
            raise autograd_state.second_backward_error(_INPLACE_WHAT, _INPLACE_AVOID)
        base, ids, lse, g_logp, entropy, g_entropy = ctx.saved_tensors
        scale = upstream_scale(grad_loss, base.device)
        # A retained graph will run this backward again: the logits must stay intact until the last.
        inplace = ctx.inplace_backward and not autograd_state.graph_retained()
        grad = base if inplace else torch.empty(base.shape, dtype=base.dtype, device=base.device)
        kernels.token_logprobs_bwd_window_into(
            base, ctx.rows, ids, lse, entropy, g_logp, g_entropy, grad, scale,
            temperature=ctx.temperature, ignore_index=ctx.ignore_index,
        )  # fmt: skip
        if inplace:
            torch.autograd.graph.increment_version(base)
            ctx.overwritten = True
        return grad, None, None, None, None, None


class DevicePlanGradInForwardFunction(torch.autograd.Function):
    """Two passes over the logits: the rows kernel writes the gradient during the forward (over the
    base's rows for a row window, zero rows included); backward =
    :class:`TokenLossGradInForwardFunction`'s sync-free rescale."""

    @staticmethod
    def forward(ctx, logits, plan, temperature, window, what):
        rows = None if window is None else window.rows(logits.shape)
        host = _host_slot(plan, logits)
        if rows is not None:  # the base itself, every row written by the kernel
            grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            out = device_plan_forward(
                logits, plan, temperature=temperature, grad=grad, row_layout=None, window_rows=rows, host=host
            )
            x = logits
        else:
            if window is None:
                x, layout = _addressed(logits)
                grad = target = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            else:  # another window: a base-shaped buffer, zero outside it
                x, layout = _addressed(window.of(logits))  # addressable: _base_and_window checked it
                grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
                window.zero_outside(grad)
                target = window.of(grad)
            out = device_plan_forward(
                x, plan, temperature=temperature, grad=target, row_layout=layout, host=host
            )
        loss, logp, entropy, counts = out[0], out[1], out[2], out[7]
        _defer_id_check(plan, counts, host, x, what)
        ctx.grad = grad
        ctx.mark_non_differentiable(logp, entropy)
        ctx.set_materialize_grads(False)
        return loss.view(()), logp, entropy

    @staticmethod
    @without_autocast
    def backward(ctx, *grads):
        # (__wrapped__: this backward is under without_autocast already; no second wrapper)
        return (*TokenLossGradInForwardFunction.backward.__wrapped__(ctx, *grads), None)  # none for ``what``


def _addressed(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """``(x, its row layout)``: ``x`` itself where the kernels address it in place, else its one
    contiguous copy (``kernels.logprobs.as_kernel_layout``'s rule, the layout computed once)."""
    layout = kernels.row_layout(x)
    if layout is None:
        x = x.contiguous()
        layout = kernels.row_layout(x)
    return x, layout


def _host_slot(plan, x: torch.Tensor) -> torch.Tensor | None:
    """On CUDA with the id check on: the pinned buffer the rows kernel writes the check's result
    into (no copy launch afterwards); else None (also inside CUDA-graph capture, where nothing is
    checked: a replayed graph must not write into a pooled buffer)."""
    if not (plan.check_ids and x.is_cuda) or torch.cuda.is_current_stream_capturing():
        return None
    return id_checks.host_buffer(2)


def _defer_id_check(
    plan, counts: torch.Tensor, host: torch.Tensor | None, x: torch.Tensor, what: str
) -> None:
    if not plan.check_ids:
        return
    if host is not None:  # CUDA: the rows kernel's last program writes the result there
        id_checks.defer_written(what, host, x.shape[-1], None, x.get_device())
    else:  # the CPU interpreter: read now, raise here
        id_checks.defer_result(what, counts, x.shape[-1], None, offset=2)


def token_loss_device_plan(
    logits: torch.Tensor,
    plan,
    *,
    temperature: float,
    inplace_backward: bool,
    two_pass: bool,
    what: str = "token_ids (at active mask positions)",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, logp, entropy)`` of a device-built token-level loss (``plan``: a
    :class:`rlkernel._token_loss_plan.DevicePlan` of the logits' ``[S, T]`` tokens); ``logp`` and
    ``entropy`` fp32 ``[S·T]`` (``entropy`` empty without an entropy term), not differentiable.

    Args:
        logits: ``[S, T, V]`` (any layout the kernels read; a window of a base that requires grad
            gives the base's gradient directly, as ``token_logprobs`` does).
        two_pass: write the gradient during the forward (2 passes; not with ``inplace_backward``).
        what: the argument the deferred id check's error names.
    """
    base, window = _base_and_window(logits)
    if two_pass:
        return DevicePlanGradInForwardFunction.apply(base, plan, float(temperature), window, what)
    return DevicePlanLossFunction.apply(base, plan, float(temperature), bool(inplace_backward), window, what)
