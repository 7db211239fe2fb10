"""Reference for the token-level loss kernel (:mod:`rlkernel.kernels.token_loss`): readable PyTorch, fp32.

Takes what the kernel's launcher ``token_loss_fwd`` takes (without the output buffers): the tokens'
log-probs (and entropies) and a :class:`rlkernel._token_loss_plan.TokenLossPlan`; returns the
per-token loss contribution ℓ_t (the kernel returns only block sums of it) and the coefficients
g_logp = dL/dlogp_t, g_entropy = dL/dentropy_t for an upstream gradient of 1:

    lr = logp − old,  r = exp(clamp(lr, ±20)),  w = factor / (norm_mult · max(denom, denom_floor))
    ℓ_t = w·(ρ·P(logp) + kl_coef·K(logp) − entropy_coef·H),   g_logp = w·(ρ·P' + kl_coef·K'),
    g_entropy = −w·entropy_coef

with old = logp when the plan has none (on-policy). P and K are written out with their derivatives
by hand (no autograd), following PyTorch's autograd rules (clamp passes the gradient on the closed
interval; maximum/minimum split it on ties), so the result matches ``rlkernel.policy_loss`` under
autograd; the tests check that.

Caveats:
    * Inactive tokens (``ids == ignore_index``) give exactly 0 everywhere; NaN or ±inf in an active
      token's inputs gives NaN (loss and g_logp): logp, adv, old (except for reinforce, whose loss
      does not read it), ref (with KL), entropy (with an entropy term); a NaN rollout weight (the
      plan makes it NaN for non-finite old/rollout log-probs). A denominator that is 0, negative or
      not finite gives NaN at active tokens (and 0 at inactive ones).
"""

from __future__ import annotations

import torch

from rlkernel._token_loss_plan import (
    K3_LOG_RATIO_BOUND,
    K3_VALUE_BOUND,
    LOG_RATIO_BOUND,
    TokenLossPlan,
    TokenLossScalars,
)


def _pass(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    return ((x >= lo) & (x <= hi)).to(x.dtype)


def _max_grad(a, b, da, db):
    return torch.maximum(a, b), torch.where(a > b, da, torch.where(a < b, db, 0.5 * (da + db)))


def _policy(s: TokenLossScalars, x, r, dr, a) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy term P and dP/dlogp of ``s.loss``."""
    clip_lo, clip_hi, delta, dual_clip = s.clip_lo, s.clip_hi, s.delta, s.dual_clip
    loss = s.loss
    if loss == "ppo":
        u = r.clamp(max=delta)
        c = r.clamp(clip_lo, clip_hi)
        du = (r <= delta).to(r.dtype)
        pol, d = _max_grad(-a * u, -a * c, -a * du, -a * _pass(r, clip_lo, clip_hi))
        if dual_clip is not None:
            k = -dual_clip * a
            d_dual = torch.where(pol < k, d, torch.where(pol == k, 0.5 * d, torch.zeros_like(d)))
            neg = a < 0
            d = torch.where(neg, d_dual, d)
            pol = torch.where(neg, torch.minimum(pol, k), pol)
        return pol, d * dr
    if loss == "cispo":
        wc = r.clamp(clip_lo, clip_hi)
        return -wc * a * x, -wc * a
    if loss == "sapo":
        tau = torch.where(a > 0, s.tau_pos, s.tau_neg)
        sig = torch.sigmoid(tau * (r - 1.0))
        return -(4.0 / tau) * sig * a, -4.0 * sig * (1.0 - sig) * a * dr
    if loss == "reinforce":
        return -a * x, -a
    raise ValueError(f"loss must be ppo | cispo | sapo | reinforce, got {loss!r}")


def _kl(kl: str, d: torch.Tensor, straight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if kl == "k1":
        value, grad = d, torch.ones_like(d)
    elif kl == "k2":
        value, grad = 0.5 * d * d, d
    elif kl == "k3":
        nd = -d
        ndc = nd.clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
        em = torch.expm1(ndc)
        v = em - ndc
        value = v.clamp(-K3_VALUE_BOUND, K3_VALUE_BOUND)
        grad = (
            -em
            * _pass(nd, -K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
            * _pass(v, -K3_VALUE_BOUND, K3_VALUE_BOUND)
        )
    elif kl == "k3_unclamped":
        em = torch.expm1(-d)
        value, grad = em + d, -em
    elif kl == "abs":
        value, grad = d.abs(), torch.sign(d)
    else:
        raise ValueError(f"kl must be k1 | k2 | k3 | abs | k3_unclamped, got {kl!r}")
    return value, (d if straight else grad)


def token_loss(
    logp: torch.Tensor, entropy: torch.Tensor | None, plan: TokenLossPlan
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(loss_tokens, g_logp, g_entropy)``, each fp32 ``[N]`` (``g_entropy`` None without entropy).

    Args:
        logp, entropy: ``[N]`` float, the log-probs of the plan's N tokens (and their entropy when
            ``plan.want_entropy``, else None).
        plan: the per-token constants and scalars of those tokens (a whole plan, or a row range
            from ``plan.rows(start, stop)``), as the kernel's launcher takes it.
    """
    f32 = torch.float32
    s = plan.scalars
    ids = plan.ids
    active = ids != plan.ignore_index
    seq = (plan.row0 + torch.arange(ids.numel(), device=ids.device)) // plan.seq_len
    adv = plan.adv[seq] if plan.adv_per_seq else plan.adv
    factor = plan.factor[seq] if plan.factor_per_seq else plan.factor

    def get(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.where(active, t.to(f32), 0.0)

    def bad(t: torch.Tensor) -> torch.Tensor:
        return ~torch.isfinite(t)

    x, a = get(logp), get(adv)
    old_ = get(plan.old) if plan.old is not None else x  # on-policy: old = sg[logp] (ratio 1)
    nan_in = bad(x) | bad(a)
    if s.loss != "reinforce":  # −A·logp does not read old
        nan_in |= bad(old_)
    lr = x - old_
    r = torch.exp(lr.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    dr = r * _pass(lr, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    pol, g = _policy(s, x, r, dr, a)
    if plan.rollout_w is not None:
        rho = get(plan.rollout_w)
        nan_in |= rho.isnan()
        pol, g = pol * rho, g * rho
    if s.kl is not None:
        ref_ = get(plan.ref)
        nan_in |= bad(ref_)
        kv, kg = _kl(s.kl, x - ref_, s.kl_straight)
        pol, g = pol + s.kl_coef * kv, g + s.kl_coef * kg
    den = torch.tensor(s.norm_mult, dtype=f32, device=x.device)
    if plan.denom is not None:
        den = den * plan.denom.to(device=x.device, dtype=f32).clamp_min(s.denom_floor)
    # A (global) denominator that is 0, negative or not finite: NaN for active tokens; inactive ones
    # stay 0, so an all-masked call gives 0 even with a normalizer of 0.
    den = torch.where(torch.isfinite(den) & (den > 0), den, float("nan"))
    w = (get(factor) if factor is not None else torch.ones_like(x)) / den
    loss_t = w * pol
    g_logp = w * g
    g_entropy = None
    if entropy is not None:
        h = get(entropy)
        nan_in |= bad(h)
        loss_t = loss_t - s.entropy_coef * w * h
        g_entropy = torch.where(active, -s.entropy_coef * w, 0.0)
    nan = torch.full_like(x, float("nan"))
    loss_t = torch.where(active, torch.where(nan_in, nan, loss_t), 0.0)
    g_logp = torch.where(active, torch.where(nan_in, nan, g_logp), 0.0)
    return loss_t, g_logp, g_entropy
