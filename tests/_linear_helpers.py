"""Coefficient functions for the fused hidden-state loss engine in tests
(:func:`rlkernel.ops._linear_function.fused_linear_token_loss`).

The fused engine asks, once per chunk of rows, for the chunk's loss contribution and the per-token
coefficients ``∂loss/∂logp`` (and ``∂loss/∂entropy``). :func:`autograd_coef_fn` derives them from
any token-level loss written in plain PyTorch, by autograd on the chunk's detached log-probs: the
readable way to drive the engine in tests. ``rlkernel.rl.token_loss`` provides the closed-form
coefficients of the RL losses that the library itself uses.

Importable as ``_linear_helpers``: pytest puts ``tests/`` on ``sys.path`` (``tests`` has no
``__init__.py``), so ``tests/ops`` and ``tests/gpu`` share it.

Caveats:
    * The loss must be a sum over tokens of terms that each depend on one token's logp/entropy
      (token-level). Normalizers (token-mean's Σm, a global token count) must be known before the
      first chunk, e.g. computed from the mask up front.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlkernel._token_loss_plan import K3_LOG_RATIO_BOUND, K3_VALUE_BOUND, LOG_RATIO_BOUND
from rlkernel.ops.token_loss import TokenLossTerms

ChunkLoss = Callable[["slice | torch.Tensor", torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def autograd_coef_fn(chunk_loss: ChunkLoss):
    """A ``coef_fn`` (``rlkernel.ops.token_loss.CoefFn``) from ``chunk_loss(rows, logp, entropy) ->
    0-dim`` (the chunk's share of the loss).

    ``logp`` and ``entropy`` (None unless the engine computes it) are fp32 ``[n]`` tensors of the
    flat token positions ``rows`` (a ``slice``, or an int64 index tensor when the engine compacts
    padding: ``chunk_loss`` indexes its per-token tensors with ``t[rows]``, which takes both); the
    returned coefficients are their gradients, fp32 ``[n]``.
    """

    def coef_fn(rows: slice | torch.Tensor, logp: torch.Tensor, entropy: torch.Tensor | None):
        lp = logp.detach().requires_grad_(True)
        ent = None if entropy is None else entropy.detach().requires_grad_(True)
        with torch.enable_grad():
            part = chunk_loss(rows, lp, ent).to(torch.float32)
            leaves = [lp] if ent is None else [lp, ent]
            grads = torch.autograd.grad(part, leaves, allow_unused=True)
        g_logp = grads[0] if grads[0] is not None else torch.zeros_like(lp)
        g_ent = None if ent is None else grads[1]
        return TokenLossTerms(part.detach(), g_logp.detach(), None if g_ent is None else g_ent.detach())

    return coef_fn


def ppo_kl_chunk_loss(
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    kl_coef: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    dual_clip: float | None = None,
    entropy_coef: float = 0.0,
    denominator: float | torch.Tensor | None = None,
) -> ChunkLoss:
    """The chunk loss of a token-mean PPO-clip (DAPO-like) objective with a k3 KL term, plain torch.

    All tensors are flat ``[N]`` (``mask`` bool); ``denominator`` defaults to ``mask.sum()`` (the
    token-mean of the whole batch). ℓ = max(−A·r, −A·clip(r, 1−clip_low, 1+clip_high)), dual clip
    where A < 0, + kl_coef·k3(logp, ref_logp); loss = Σ m·ℓ / denominator − entropy_coef·Σ m·H /
    denominator.
    """
    m_all = mask.reshape(-1).to(torch.float32)
    den = m_all.sum().clamp(min=1.0) if denominator is None else denominator

    def chunk_loss(rows: slice, logp: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
        m = m_all[rows]
        a = advantages.reshape(-1)[rows].to(torch.float32)
        ratio = torch.exp((logp - old_logp.reshape(-1)[rows]).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        per = torch.maximum(-a * ratio, -a * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
        if dual_clip is not None:
            per = torch.where(a < 0, torch.minimum(per, -dual_clip * a), per)
        if kl_coef:
            neg = (ref_logp.reshape(-1)[rows] - logp).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
            per = per + kl_coef * (torch.expm1(neg) - neg).clamp(-K3_VALUE_BOUND, K3_VALUE_BOUND)
        if entropy_coef and entropy is not None:
            per = per - entropy_coef * entropy
        return (per * m).sum() / den

    return chunk_loss
