"""The Triton path of ``token_logprobs``: custom ops (``torch.library``) and the autograd Function.

The kernels are registered as three opaque custom ops, so that ``torch.compile(fullgraph=True)``
traces calls to them instead of breaking the graph at a Triton launch:

    rlkernel::token_logprobs_fwd          (logits, ids, ...) -> (logp, entropy, lse)     functional
    rlkernel::token_logprobs_bwd          (logits, ids, lse, entropy, g_logp, g_H, ...) -> grad
    rlkernel::token_logprobs_bwd_inplace  same inputs, writes the gradient into ``logits`` (mutates)
    rlkernel::token_loss_from_logits      (logits, token-level plan) -> (loss, logp, entropy, lse,
                                          dL/dlogp, dL/dH); differentiable in logits (its backward
                                          is rlkernel::token_logprobs_bwd with those coefficients)

Each has a fake (meta) implementation for tracing. ``TokenLogprobsFunction`` binds them into
autograd; ``rlkernel.ops.logprobs.token_logprobs`` calls it when the dispatcher picks "triton".
Importing this module imports Triton, which is why the public op imports it lazily.

Caveats:
    * The in-place backward bumps the logits' version counter (``mutates_args``), so an autograd
      node that saved the same logits and runs later raises instead of reading the gradient.
    * A second backward through a retained graph (``backward(retain_graph=True)``, or
      ``create_graph=True``) accumulates the same gradients again, as PyTorch's own ops do: a backward
      that keeps its graph never writes in place (the next one still needs the logits) and never
      hands out a buffer that the next one reads (the gradient-in-forward buffer is copied); only
      the last, non-retained backward takes the memory-saving route. This needs
      ``torch._C._autograd._get_current_graph_task_keep_graph`` (torch >= 2.5); on older torch the
      in-place / gradient-in-forward routes are taken every time, and a second backward raises a
      RuntimeError that says how to avoid it (``inplace_backward=False``, or
      ``rk.use_options(grad_in_forward_max_vocab=0)``).
    * Inside ``torch.compile`` the in-place option falls back to the out-of-place kernel
      (``_INPLACE_UNDER_COMPILE``). With torch 2.13 on CPU, AOTAutograd does trace the mutation of a
      forward input in backward (``auto_functionalized_v2``, then re-inplaced by Inductor when the
      logits are dead), with correct gradients; older releases are unverified, so it stays off until
      the GPU test ``tests/gpu/test_logprobs.py::test_inplace_backward_inside_torch_compile``
      (an expected failure) passes with the GPU's torch.
"""

from __future__ import annotations

import torch

from rlkernel._autocast import without_autocast
from rlkernel._memo import memoized
from rlkernel.kernels import logprobs as kernels
from rlkernel.ops import _autograd as autograd_state
from rlkernel.ops._views import Window, window_of

# Whether inplace_backward=True also writes in place inside torch.compile'd code (see Caveats).
_INPLACE_UNDER_COMPILE = False


_INPLACE_AVOID = "pass inplace_backward=False"
_INPLACE_WHAT = "the first backward wrote the logits gradient into the logits (inplace_backward=True)"


# ------------------------------------------------------------------------------------ custom ops
@torch.library.custom_op("rlkernel::token_logprobs_fwd", mutates_args=())
def _fwd_op(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float, ignore_index: int, return_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return kernels.token_logprobs_fwd(
        logits, token_ids, temperature=temperature, ignore_index=ignore_index, return_entropy=return_entropy
    )


@_fwd_op.register_fake
def _(logits, token_ids, temperature, ignore_index, return_entropy):
    lead = logits.shape[:-1]
    logp = logits.new_empty(lead, dtype=torch.float32)
    entropy = logits.new_empty(lead if return_entropy else (0,), dtype=torch.float32)
    return logp, entropy, logits.new_empty(lead, dtype=torch.float32)


@torch.library.custom_op("rlkernel::token_logprobs_bwd", mutates_args=())
def _bwd_op(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    ignore_index: int,
) -> torch.Tensor:
    return kernels.token_logprobs_bwd(
        logits,
        token_ids,
        lse,
        entropy,
        grad_logp,
        grad_entropy,
        temperature=temperature,
        ignore_index=ignore_index,
    )


@_bwd_op.register_fake
def _(logits, token_ids, lse, entropy, grad_logp, grad_entropy, temperature, ignore_index):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


@torch.library.custom_op("rlkernel::token_logprobs_bwd_inplace", mutates_args=("logits",))
def _bwd_inplace_op(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    ignore_index: int,
) -> None:
    if kernels.row_layout(logits) is None or not kernels.can_write_in_place(logits):
        # Not addressable in place (the Function never sends such logits here): same numbers, no saving.
        logits.copy_(
            _bwd_op._init_fn(
                logits, token_ids, lse, entropy, grad_logp, grad_entropy, temperature, ignore_index
            )
        )
        return
    kernels.token_logprobs_bwd_into(
        logits,
        token_ids,
        lse,
        entropy,
        grad_logp,
        grad_entropy,
        logits,
        temperature=temperature,
        ignore_index=ignore_index,
    )


@_bwd_inplace_op.register_fake
def _(logits, token_ids, lse, entropy, grad_logp, grad_entropy, temperature, ignore_index):
    return None


# -------------------------------------------------------------------------------------- autograd
# Eager calls run the custom ops' Python bodies directly (``_init_fn``): going through the
# dispatcher costs ~0.25 ms of host time per op (measured with torch.profiler on an H200 host,
# torch 2.11, 2026-11-21), which is a tenth of the whole fwd+bwd at N = 8192. Traced code
# (torch.compile) still sees the registered ops, with their fake implementations.
class TokenLogprobsFunction(torch.autograd.Function):
    """logp, entropy = f(logits); backward through the Triton kernel, optionally in place.

    Saved state: the logits as the kernel reads them (the input itself, or its one copy when the
    layout needs it), the ids, fp32 ``lse`` and ``entropy`` ``[...]``; no ``[N, V]`` intermediate.
    """

    @staticmethod
    def forward(ctx, logits, token_ids, temperature, ignore_index, return_entropy, inplace_backward, window):
        # window (eager only): ``logits`` is the base of the caller's view, the view its window.
        x = kernels.as_kernel_layout(logits if window is None else window.of(logits))
        fwd = torch.ops.rlkernel.token_logprobs_fwd if torch.compiler.is_compiling() else _fwd_op._init_fn
        logp, entropy, lse = fwd(x, token_ids, temperature, ignore_index, return_entropy)
        ctx.inplace_backward = inplace_backward and kernels.can_write_in_place(x)
        ctx.overwritten = False  # set once a backward has written the gradient into the logits
        ctx.window = window
        # In place, the gradient *is* the saved logits: save a detached alias (same storage and
        # version counter) so that the returned gradient does not itself require grad.
        saved = x if window is None else logits
        ctx.save_for_backward(saved.detach() if ctx.inplace_backward else saved, token_ids, lse, entropy)
        ctx.temperature = temperature
        ctx.ignore_index = ignore_index
        ctx.return_entropy = return_entropy
        ctx.set_materialize_grads(False)
        if not return_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @without_autocast
    def backward(ctx, grad_logp, grad_entropy):
        none = (None,) * 7
        if not ctx.needs_input_grad[0]:
            return none
        if ctx.overwritten:
            raise autograd_state.second_backward_error(_INPLACE_WHAT, _INPLACE_AVOID)
        x, token_ids, lse, entropy = ctx.saved_tensors
        if not ctx.return_entropy:
            grad_entropy = None
        if grad_logp is None and grad_entropy is None:
            return none
        if ctx.window is not None:  # eager only (the wrapper never passes a window when compiling)
            return (
                _window_backward(ctx, x, token_ids, lse, entropy, grad_logp, grad_entropy, None),
                *none[1:],
            )
        args = (x, token_ids, lse, entropy, grad_logp, grad_entropy, ctx.temperature, ctx.ignore_index)
        compiling = torch.compiler.is_compiling()
        inplace = ctx.inplace_backward and (_INPLACE_UNDER_COMPILE or not compiling)
        if inplace and not compiling and autograd_state.graph_retained():
            inplace = False  # the retained graph runs this backward again: keep the logits intact
        if inplace:
            if compiling:
                torch.ops.rlkernel.token_logprobs_bwd_inplace(*args)
            else:
                _bwd_inplace_op._init_fn(*args)
                # What the dispatcher does for an op declared mutating: a later backward that saved
                # these logits then raises instead of silently reading the gradient.
                torch.autograd.graph.increment_version(x)
                ctx.overwritten = True
            grad = x
        else:
            grad = (torch.ops.rlkernel.token_logprobs_bwd if compiling else _bwd_op._init_fn)(*args)
        return grad, None, None, None, None, None, None


def _window_backward(ctx, base, ids, lse, entropy, g_logp, g_entropy, scale):
    """The gradient of the whole base of a windowed call: the kernel writes the window (into a new
    base-shaped buffer, or in place into the base itself), only the rows outside it are zeroed."""
    window = ctx.window
    inplace = ctx.inplace_backward and not autograd_state.graph_retained()
    grad = base if inplace else torch.empty(base.shape, dtype=base.dtype, device=base.device)
    kernels.token_logprobs_bwd_into(
        window.of(base), ids, lse, entropy, g_logp, g_entropy, window.of(grad),
        temperature=ctx.temperature, ignore_index=ctx.ignore_index, grad_scale=scale,
    )  # fmt: skip
    window.zero_outside(grad)
    if inplace:
        torch.autograd.graph.increment_version(base)
        ctx.overwritten = True
    return grad


def token_logprobs_triton(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    temperature: float,
    ignore_index: int,
    return_entropy: bool,
    inplace_backward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` through the kernels; ``entropy`` is an empty tensor unless asked for.
    Logits that are a window of a base requiring grad (``out.logits[:, P - 1 : -1]``) give the
    base's gradient directly (:mod:`rlkernel.ops._views`)."""
    source, window = _base_and_window(logits)
    return TokenLogprobsFunction.apply(
        source, token_ids, float(temperature), int(ignore_index), bool(return_entropy),
        bool(inplace_backward), window,
    )  # fmt: skip


def upstream_scale(grad_loss: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fused loss's 0-dim upstream gradient as the fp32 one-element tensor on ``device`` that the
    backward kernels read (``tl.load(scale_ptr)``): the tensor itself when it already is one (no
    view, no copy: host time), else one detached cast."""
    if grad_loss.dtype == torch.float32 and grad_loss.device == device:
        return grad_loss
    return grad_loss.detach().to(device=device, dtype=torch.float32)


_WINDOWS: dict[tuple, Window | bool] = {}  # the views' metadata -> their window (False: none)


def _base_and_window(logits: torch.Tensor):
    """``(base, window)`` when the eager Triton path can give the base's gradient directly (the
    window is addressed without a copy), else ``(logits, None)``. The window is a function of the
    view's and the base's metadata, memoized on them (every step asks again)."""
    base = logits._base
    if base is None or not base.requires_grad or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return logits, None
    key = (logits.shape, logits.stride(), logits.storage_offset(), logits.dtype,
           base.shape, base.stride(), base.storage_offset(), base.dtype)  # fmt: skip
    window = memoized(_WINDOWS, key, lambda: _addressable_window(logits))
    return (base, window) if window else (logits, None)


def _addressable_window(logits: torch.Tensor) -> Window | bool:
    found = window_of(logits)
    if found is None or kernels.row_layout(logits) is None:
        return False
    return found[1]


# ------------------------------------------------------------------------- fused token-level loss
class TokenLossFunction(torch.autograd.Function):
    """loss = L(logp(logits), H(logits)) for a loss given by its per-token coefficients: three
    launches for a token-level plan, the ``[B, T]`` algebra's own launches otherwise.

    Forward: the log-prob kernel (logp, entropy, lse), then ``source.terms`` (a token-level plan:
    the token-loss kernel, :mod:`rlkernel.kernels.token_loss`, giving block partial sums of the loss
    and the coefficients g_logp = dL/dlogp, g_H = dL/dH; a sequence-level loss: its algebra and
    autograd on the ``[B, T]`` statistics). Backward: ONE launch of the log-prob backward kernel
    with those coefficients, scaled in-kernel by the 0-dim upstream gradient (read on the device: no
    host sync, no extra launch).

    Saved state: the logits (or their alias when the backward writes in place), the masked ids
    (int64), fp32 ``lse`` and ``g_logp`` and, with an entropy term, fp32 ``entropy`` and ``g_H``:
    16 B/token (24 B/token more with entropy); no ``[N, V]`` intermediate.

    Returns ``(loss, logp, entropy)``; ``logp``/``entropy`` are non-differentiable (for metrics).
    """

    @staticmethod
    def forward(ctx, logits, source, temperature, inplace_backward, window):
        # window: ``logits`` is the base of the caller's view, the view its window.
        x = kernels.as_kernel_layout(logits if window is None else window.of(logits))
        ids = source.ids.view(x.shape[:-1])
        want_entropy = source.want_entropy
        logp, entropy, lse = _fwd_op._init_fn(x, ids, temperature, source.ignore_index, want_entropy)
        terms = source.terms(slice(0, logp.numel()), logp, entropy if want_entropy else None)
        ctx.inplace_backward = inplace_backward and kernels.can_write_in_place(x)
        ctx.overwritten = False  # set once a backward has written the gradient into the logits
        ctx.window = window
        saved = x if window is None else logits
        ctx.save_for_backward(
            saved.detach() if ctx.inplace_backward else saved,
            ids,
            lse,
            terms.g_logp,
            entropy if want_entropy else None,
            terms.g_entropy,
        )
        ctx.temperature = temperature
        ctx.ignore_index = source.ignore_index
        ctx.mark_non_differentiable(logp, entropy)
        # No zero tensors for the (non-differentiable) logp/entropy outputs' gradients: 2 launches.
        ctx.set_materialize_grads(False)
        return terms.loss, logp, entropy

    @staticmethod
    @without_autocast
    def backward(ctx, grad_loss, grad_logp_unused, grad_entropy_unused):
        if not ctx.needs_input_grad[0] or grad_loss is None:
            return None, None, None, None, None
        if ctx.overwritten:
            raise autograd_state.second_backward_error(_INPLACE_WHAT, _INPLACE_AVOID)
        x, ids, lse, g_logp, entropy, g_entropy = ctx.saved_tensors
        scale = upstream_scale(grad_loss, x.device)
        if ctx.window is not None:
            return (
                _window_backward(ctx, x, ids, lse, entropy, g_logp, g_entropy, scale),
                None,
                None,
                None,
                None,
            )
        # A retained graph will run this backward again: the logits must stay intact until the last.
        inplace = ctx.inplace_backward and not autograd_state.graph_retained()
        grad = x if inplace else torch.empty(x.shape, dtype=x.dtype, device=x.device)
        kernels.token_logprobs_bwd_into(
            x,
            ids,
            lse,
            entropy,
            g_logp,
            g_entropy,
            grad,
            temperature=ctx.temperature,
            ignore_index=ctx.ignore_index,
            grad_scale=scale,
        )
        if inplace:
            torch.autograd.graph.increment_version(x)
            ctx.overwritten = True
        return grad, None, None, None, None


def token_loss_triton(logits: torch.Tensor, source, *, temperature: float, inplace_backward: bool):
    """``(loss, logp, entropy)`` of a loss from logits (see :class:`TokenLossFunction`); ``source``
    is a :class:`rlkernel.ops.token_loss.LossCoefficients`; ``entropy`` is an empty tensor unless
    the loss has an entropy term. A window of a base that requires grad gives the base's gradient
    directly (:mod:`rlkernel.ops._views`)."""
    base, window = _base_and_window(logits)
    return TokenLossFunction.apply(base, source, float(temperature), bool(inplace_backward), window)


class TokenLossGradInForwardFunction(torch.autograd.Function):
    """The same loss as :class:`TokenLossFunction` in two passes over the logits instead of three.

    Forward: ONE row kernel (``kernels.token_loss.token_loss_grad_in_fwd``) streams each row for its
    lse, computes the token's loss coefficients in-kernel, and streams the row again (mostly from L2
    when the row is small) writing dL/dlogits for an upstream gradient of 1 into a new buffer.
    Backward: a sync-free in-place rescale by the upstream gradient that touches no memory when it
    is 1. Saved state: that gradient (``[N, V]``, the logits' dtype), allocated in forward. The last
    backward hands the buffer itself to autograd; a backward that retains the graph hands out a
    rescaled copy and keeps the buffer for the next one (so a second backward accumulates the same
    gradient again).

    Returns ``(loss, logp, entropy)``; ``logp``/``entropy`` are non-differentiable (for metrics).
    """

    @staticmethod
    def forward(ctx, logits, plan, temperature, window):
        from rlkernel.kernels import token_loss as tl_kernels

        if window is None:
            x = kernels.as_kernel_layout(logits)
            loss_rows, logp, entropy, grad = tl_kernels.token_loss_grad_in_fwd(
                x, plan, temperature=temperature
            )
        else:  # logits is the base of the caller's view: the buffer is base-shaped, zero outside the window
            x = window.of(logits)
            grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            window.zero_outside(grad)
            loss_rows, logp, entropy, _ = tl_kernels.token_loss_grad_in_fwd(
                x, plan, temperature=temperature, grad=window.of(grad)
            )
        ctx.grad = grad
        ctx.mark_non_differentiable(logp, entropy)
        ctx.set_materialize_grads(False)
        lead = x.shape[:-1]
        return loss_rows.sum(), logp.view(lead), entropy.view(lead) if plan.want_entropy else entropy

    @staticmethod
    @without_autocast
    def backward(ctx, grad_loss, grad_logp_unused, grad_entropy_unused):
        from rlkernel.kernels import token_loss as tl_kernels

        if grad_loss is None or not ctx.needs_input_grad[0]:
            return None, None, None, None
        grad = ctx.grad
        if grad is None:
            raise autograd_state.second_backward_error(
                "the first backward handed out the gradient computed in the forward (the fused loss's "
                "gradient-in-forward path, V <= the option grad_in_forward_max_vocab)",
                "run it under rlkernel.use_options(grad_in_forward_max_vocab=0) (the 3-pass path)",
            )
        scale = upstream_scale(grad_loss, grad.device)
        if autograd_state.graph_retained():  # another backward will read the buffer: hand out a rescaled copy
            return tl_kernels.scale_(grad.clone(), scale), None, None, None
        ctx.grad = None  # the buffer becomes the caller's gradient: a second backward must not rescale it
        return tl_kernels.scale_(grad, scale), None, None, None


def token_loss_grad_in_forward_triton(logits: torch.Tensor, plan, *, temperature: float):
    """``(loss, logp, entropy)`` through :class:`TokenLossGradInForwardFunction` (a window of a
    base that requires grad: the buffer and the returned gradient are the base's)."""
    source, window = _base_and_window(logits)
    return TokenLossGradInForwardFunction.apply(source, plan, float(temperature), window)


# ------------------------------------------------------- the fused token-level loss under compile
@torch.library.custom_op("rlkernel::token_loss_from_logits", mutates_args=())
def _token_loss_op(
    logits: torch.Tensor,
    ids: torch.Tensor,
    old: torch.Tensor | None,
    adv: torch.Tensor,
    ref: torch.Tensor | None,
    rollout_w: torch.Tensor | None,
    factor: torch.Tensor | None,
    denom: torch.Tensor | None,
    loss: str,
    kl: str,
    floats: list[float],
    flags: list[int],
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from rlkernel._token_loss_plan import TokenLossPlan
    from rlkernel.ops.token_loss import token_loss

    plan = TokenLossPlan.from_op_args(ids, old, adv, ref, rollout_w, factor, denom, loss, kl, floats, flags)
    x = kernels.as_kernel_layout(logits)
    want = plan.want_entropy
    logp, entropy, lse = kernels.token_logprobs_fwd(
        x, ids.view(x.shape[:-1]), temperature=temperature, ignore_index=flags[6], return_entropy=want
    )
    terms = token_loss(plan, logp, entropy if want else None, backend="triton")
    g_entropy = terms.g_entropy if want else logp.new_empty(0)
    return terms.loss, logp, entropy, lse, terms.g_logp, g_entropy


@_token_loss_op.register_fake
def _(logits, ids, old, adv, ref, rollout_w, factor, denom, loss, kl, floats, flags, temperature):
    lead, n = logits.shape[:-1], ids.numel()
    want = floats[7] != 0  # entropy_coef (TokenLossPlan.op_args order)
    f32 = dict(dtype=torch.float32, device=logits.device)
    return (
        torch.empty((), **f32),
        torch.empty(lead, **f32),
        torch.empty(lead if want else (0,), **f32),
        torch.empty(lead, **f32),
        torch.empty(n, **f32),
        torch.empty(n if want else 0, **f32),
    )


def _token_loss_setup(ctx, inputs, output):
    logits, ids = inputs[0], inputs[1]
    _, _, entropy, lse, g_logp, g_entropy = output
    ctx.save_for_backward(logits, ids, lse, entropy, g_logp, g_entropy)
    floats, flags, ctx.temperature = inputs[10:13]  # TokenLossPlan.op_args order
    ctx.want_entropy = floats[7] != 0  # entropy_coef
    ctx.ignore_index = flags[6]


def _token_loss_backward(ctx, grad_loss, *unused):
    logits, ids, lse, entropy, g_logp, g_entropy = ctx.saved_tensors
    lead = logits.shape[:-1]
    g_h = (g_entropy * grad_loss).view(lead) if ctx.want_entropy else None
    grad = torch.ops.rlkernel.token_logprobs_bwd(
        logits, ids.view(lead), lse, entropy, (g_logp * grad_loss).view(lead), g_h,
        ctx.temperature, ctx.ignore_index,
    )  # fmt: skip
    return (grad,) + (None,) * 12


torch.library.register_autograd(
    "rlkernel::token_loss_from_logits", _token_loss_backward, setup_context=_token_loss_setup
)


def token_loss_traced(logits: torch.Tensor, plan, *, temperature: float):
    """``(loss, logp, entropy)`` of a token-level plan as ONE registered custom op, for code traced
    by ``torch.compile`` (fullgraph: no graph break, the loss stays fused): the log-prob and
    token-loss kernels forward, the log-prob backward kernel with the coefficients times the
    upstream gradient backward (3 passes over the logits; the eager path's window and in-place
    routes do not apply under tracing)."""
    loss, logp, entropy, _, _, _ = torch.ops.rlkernel.token_loss_from_logits(
        logits, *plan.op_args(), float(temperature)
    )
    return loss, logp.detach(), entropy.detach()
