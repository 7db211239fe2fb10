"""The Triton path of ``token_logprobs``: custom ops (``torch.library``) and the autograd Function.

The kernels are registered as three opaque custom ops, so that ``torch.compile(fullgraph=True)``
traces calls to them instead of breaking the graph at a Triton launch:

    rlkernel::token_logprobs_fwd          (logits, ids, ...) -> (logp, entropy, lse)     functional
    rlkernel::token_logprobs_bwd          (logits, ids, lse, entropy, g_logp, g_H, ...) -> grad
    rlkernel::token_logprobs_bwd_inplace  same inputs, writes the gradient into ``logits`` (mutates)

Each has a fake (meta) implementation for tracing. ``TokenLogprobsFunction`` binds them into
autograd; ``rlkernel.ops.logprobs.token_logprobs`` calls it when the dispatcher picks "triton".
Importing this module imports Triton, which is why the public op imports it lazily.

Caveats:
    * The in-place backward bumps the logits' version counter (``mutates_args``), so an autograd
      node that saved the same logits and runs later raises instead of reading the gradient.
    * Inside ``torch.compile`` the in-place option falls back to the out-of-place kernel
      (``_INPLACE_UNDER_COMPILE``). With torch 2.13 on CPU, AOTAutograd does trace the mutation of a
      forward input in backward (``auto_functionalized_v2``, then re-inplaced by Inductor when the
      logits are dead), with correct gradients; older releases are unverified, so it stays off until
      ``scripts/gpu_check_logprobs.py`` confirms it with the GPU's torch.
"""

from __future__ import annotations

import torch

from rlkernel.kernels import logprobs as kernels

# Whether inplace_backward=True also writes in place inside torch.compile'd code (see Caveats).
_INPLACE_UNDER_COMPILE = False


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
    kernels._token_logprobs_bwd(
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
    def forward(ctx, logits, token_ids, temperature, ignore_index, return_entropy, inplace_backward):
        x = kernels.as_kernel_layout(logits)
        fwd = torch.ops.rlkernel.token_logprobs_fwd if torch.compiler.is_compiling() else _fwd_op._init_fn
        logp, entropy, lse = fwd(x, token_ids, temperature, ignore_index, return_entropy)
        ctx.inplace_backward = inplace_backward and kernels.can_write_in_place(x)
        # In place, the gradient *is* the saved logits: save a detached alias (same storage and
        # version counter) so that the returned gradient does not itself require grad.
        ctx.save_for_backward(x.detach() if ctx.inplace_backward else x, token_ids, lse, entropy)
        ctx.temperature = temperature
        ctx.ignore_index = ignore_index
        ctx.return_entropy = return_entropy
        ctx.set_materialize_grads(False)
        if not return_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        x, token_ids, lse, entropy = ctx.saved_tensors
        if not ctx.return_entropy:
            grad_entropy = None
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None
        args = (x, token_ids, lse, entropy, grad_logp, grad_entropy, ctx.temperature, ctx.ignore_index)
        compiling = torch.compiler.is_compiling()
        if ctx.inplace_backward and (_INPLACE_UNDER_COMPILE or not compiling):
            if compiling:
                torch.ops.rlkernel.token_logprobs_bwd_inplace(*args)
            else:
                _bwd_inplace_op._init_fn(*args)
                # What the dispatcher does for an op declared mutating: a later backward that saved
                # these logits then raises instead of silently reading the gradient.
                torch.autograd.graph.increment_version(x)
            grad = x
        else:
            grad = (torch.ops.rlkernel.token_logprobs_bwd if compiling else _bwd_op._init_fn)(*args)
        return grad, None, None, None, None, None


def token_logprobs_triton(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    temperature: float,
    ignore_index: int,
    return_entropy: bool,
    inplace_backward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` through the kernels; ``entropy`` is an empty tensor unless asked for."""
    return TokenLogprobsFunction.apply(
        logits, token_ids, float(temperature), int(ignore_index), bool(return_entropy), bool(inplace_backward)
    )
