"""The token-level loss launcher: one launch of the per-token loss terms over a row range of a plan.

:class:`TokenLossPlan` (defined in :mod:`rlkernel._token_loss_plan`, below every layer, so that the
kernels and the reference take it too; re-exported here) is the interface between the RL algebra
and the kernels: the per-token constants and the scalars (:class:`TokenLossScalars`) of one
micro-batch's loss (``rlkernel.rl.token_loss.build_plan`` builds it from a ``PolicyLossConfig`` and
the ``[B, T]`` batch). :func:`token_loss` runs ONE launch
(:mod:`rlkernel.kernels.token_loss`, or :mod:`rlkernel.reference.token_loss` on the CPU) over any
row range ``[start, stop)`` of the flat tokens and returns that range's loss partial sum and the
coefficients dL/dlogp, dL/dH. It lives in ``ops`` (not ``rl``) because the autograd Functions of the
fused paths call it: ``ops`` never imports ``rl``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch

from rlkernel import _dispatch
from rlkernel import _validate as check
from rlkernel._token_loss_plan import (  # noqa: F401 - re-exported: the plan's types live below every layer
    IGNORE_INDEX,
    TokenLossPlan,
    TokenLossScalars,
)
from rlkernel.reference import token_loss as ref_impl


class TokenLossTerms(NamedTuple):
    """What :func:`token_loss` returns for a row range, and what every coefficient callback
    (:data:`CoefFn`) returns: a named tuple, so ``loss, g_logp, g_entropy = terms`` works too.

    Attributes:
        loss: 0-dim fp32, Σ ℓ_t over the range (fixed-order sum of the kernel's block partials).
        g_logp: fp32 ``[stop − start]``, dL/dlogp_t for an upstream gradient of 1.
        g_entropy: fp32 ``[stop − start]`` dL/dH_t, or None when the loss has no entropy term.
    """

    loss: torch.Tensor
    g_logp: torch.Tensor
    g_entropy: torch.Tensor | None


# The one coefficient protocol of the fused paths: ``coef_fn(rows, logp, entropy) -> TokenLossTerms``
# gives the loss part and dL/dlogp, dL/dH of the tokens ``rows`` (a ``slice`` of the flat tokens,
# or an int64 tensor of their flat positions) from their fp32 log-probs and entropies (None when the
# loss reads none). The logits paths call it once over every token (``slice(0, N)``); the hidden
# path's chunk engine once per chunk (``ops._linear_function.fused_linear_token_loss``).
CoefFn = Callable[["slice | torch.Tensor", torch.Tensor, "torch.Tensor | None"], TokenLossTerms]


def masked_ids(
    token_ids: torch.Tensor, mask: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, active)`` of a loss call: ``active = mask != 0`` (bool) and int64 ``ids`` =
    ``max(token_id, -1)`` where active, ``ignore_index`` elsewhere (the formula's reasons:
    ``rlkernel.rl.token_loss.masked_token_ids``). One Triton launch on the triton backend
    (``kernels.ids.masked_ids``; contiguous operands of one shape), else the same in torch ops
    (also inside ``torch.compile``, which traces them: the launch would break a full graph)."""
    if (
        not torch.compiler.is_compiling()
        and _dispatch.resolve_backend(token_ids.device, has_kernel=True) == "triton"
        and token_ids.is_contiguous()
        and mask.is_contiguous()
        and mask.shape == token_ids.shape
        and mask.device == token_ids.device
    ):
        from rlkernel.kernels import ids as ids_kernels

        return ids_kernels.masked_ids(token_ids, mask, ignore_index)
    active = mask != 0
    return torch.where(active, token_ids.long().clamp_min(-1), ignore_index), active


def token_loss(
    plan: TokenLossPlan,
    logp: torch.Tensor,
    entropy: torch.Tensor | None = None,
    *,
    start: int = 0,
    stop: int | None = None,
    backend: str | None = None,
) -> TokenLossTerms:
    """Loss partial sum and per-token coefficients of tokens ``[start, stop)`` in one launch.

    Args:
        plan: from :func:`build_plan`.
        logp: fp32 ``[stop − start]`` log-probs of those tokens (0 at inactive ones is fine; any
            value there is ignored).
        entropy: fp32 ``[stop − start]`` entropies, required when ``plan.want_entropy``.
        start, stop: the row range of the flat tokens (default: all).
        backend: ``"triton"`` or ``"reference"``; default: the dispatcher's choice for the device.

    Returns:
        :class:`TokenLossTerms`: the range's loss sum (add the ranges' sums in order for the total),
        ``g_logp`` and ``g_entropy`` (None without an entropy term).
    """
    stop = plan.n_tokens if stop is None else stop
    if not 0 <= start <= stop <= plan.n_tokens:
        raise ValueError(f"row range [{start}, {stop}) is not inside [0, {plan.n_tokens})")
    n = stop - start
    if logp.numel() != n:
        raise ValueError(f"logp must have {n} elements (rows [{start}, {stop})), got {check.describe(logp)}")
    if plan.want_entropy and (entropy is None or entropy.numel() != n):
        raise ValueError(f"entropy with {n} elements is required: the loss has an entropy term")
    ent = entropy.detach().reshape(-1).contiguous() if plan.want_entropy else None
    x = logp.detach().reshape(-1).contiguous()
    rows = plan.rows(start, stop)
    if backend is None:
        backend = _dispatch.resolve_backend(x.device, has_kernel=x.dtype != torch.float64)
    if backend == "triton":
        from rlkernel.kernels import token_loss as kernels

        partial = torch.empty(kernels.n_partials(n), dtype=torch.float32, device=x.device)
        g_logp = torch.empty(n, dtype=torch.float32, device=x.device)
        g_entropy = torch.empty(n, dtype=torch.float32, device=x.device) if ent is not None else None
        kernels.token_loss_fwd(partial, g_logp, g_entropy, x, ent, rows)
        return TokenLossTerms(partial.sum(), g_logp, g_entropy)
    loss_t, g_logp, g_entropy = ref_impl.token_loss(x, ent, rows)
    return TokenLossTerms(loss_t.sum(), g_logp, g_entropy)


def as_coef_fn(plan: TokenLossPlan):
    """``coef_fn(rows, logp, entropy) -> (loss_part, g_logp, g_entropy)`` for a chunked engine
    (e.g. ``rlkernel.ops._linear_function.fused_linear_token_loss``), one :func:`token_loss` launch
    per chunk ``rows``: a ``slice`` of the flat tokens (step 1; the plan's row range, no copy), or
    an int64 tensor of their flat positions (a padding-compacted chunk: the plan's constants are
    gathered for those tokens, :meth:`TokenLossPlan.take`). Run the engine with
    ``token_ids=plan.ids`` (``IGNORE_INDEX`` at masked positions) and
    ``with_entropy=plan.want_entropy``; the engine adds the chunks' ``loss_part`` in order."""

    def coef_fn(rows: slice | torch.Tensor, logp: torch.Tensor, entropy: torch.Tensor | None):
        if isinstance(rows, slice):
            start, stop, _ = rows.indices(plan.n_tokens)
            return token_loss(plan, logp, entropy, start=start, stop=stop)
        return token_loss(plan.take(rows), logp, entropy)

    return coef_fn


@dataclasses.dataclass(frozen=True)
class LossCoefficients:
    """What the fused logits path (``rlkernel.ops._logprobs_function.TokenLossFunction``) needs of a
    loss: the ids to score and its coefficient callback (:data:`CoefFn`, the same protocol as the
    hidden path's, called once over every token). Sources: a token-level plan
    (:func:`plan_coefficients`, one token-loss launch), the closed-form sequence objectives and any
    loss on ``[B, T]`` differentiated by autograd (``rlkernel.rl.fused``).

    Attributes:
        ids: int64 ``[...]`` the token shape, ``ignore_index`` at masked positions.
        ignore_index: the id of positions that are not scored.
        want_entropy: whether ``terms`` reads the entropy (the forward computes it only then).
        terms: a :data:`CoefFn`, called once per forward as ``terms(slice(0, N), logp, entropy)``
            with ``logp``/``entropy`` fp32 of the token shape (``entropy`` None without
            ``want_entropy``), with gradient mode as the caller's.
    """

    ids: torch.Tensor
    ignore_index: int
    want_entropy: bool
    terms: CoefFn
