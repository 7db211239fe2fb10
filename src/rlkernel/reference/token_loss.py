"""Reference for the token-level loss kernel (:mod:`rlkernel.kernels.token_loss`): readable PyTorch, fp32.

Same inputs as the kernel's launcher ``token_loss_fwd`` (without the output buffers); returns the
per-token loss contribution ℓ_t (the kernel returns only block sums of it) and the coefficients
g_logp = dL/dlogp_t, g_entropy = dL/dentropy_t for an upstream gradient of 1:

    lr = logp − old,  r = exp(clamp(lr, ±20)),  w = factor / (norm_mult · max(denom, denom_floor))
    ℓ_t = w·(ρ·P(logp) + kl_coef·K(logp) − entropy_coef·H),   g_logp = w·(ρ·P' + kl_coef·K'),
    g_entropy = −w·entropy_coef

P and K are written out with their derivatives by hand (no autograd), following PyTorch's autograd
rules (clamp passes the gradient on the closed interval; maximum/minimum split it on ties), so the
result matches ``rlkernel.policy_loss`` under autograd; the tests check that.

Caveats:
    * Inactive tokens (``ids == ignore_index``) give exactly 0 everywhere; NaN or ±inf in an active
      token's inputs gives NaN (loss and g_logp): logp, adv, old (except for reinforce, whose loss
      does not read it), ref (with KL), entropy (with an entropy term); a NaN rollout weight (the
      plan makes it NaN for non-finite old/rollout log-probs). A denominator that is 0, negative or
      not finite gives NaN at active tokens (and 0 at inactive ones).
"""

from __future__ import annotations

import torch

LOG_RATIO_BOUND = 20.0
K3_LOG_RATIO_BOUND = 20.0
K3_VALUE_BOUND = 10.0


def _pass(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    return ((x >= lo) & (x <= hi)).to(x.dtype)


def _max_grad(a, b, da, db):
    return torch.maximum(a, b), torch.where(a > b, da, torch.where(a < b, db, 0.5 * (da + db)))


def _policy(loss, x, r, dr, a, clip_lo, clip_hi, delta, dual_clip, tau_pos, tau_neg):
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
        tau = torch.where(a > 0, tau_pos, tau_neg)
        s = torch.sigmoid(tau * (r - 1.0))
        return -(4.0 / tau) * s * a, -4.0 * s * (1.0 - s) * a * dr
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
    elif kl == "abs":
        value, grad = d.abs(), torch.sign(d)
    else:
        raise ValueError(f"kl must be k1 | k2 | k3 | abs, got {kl!r}")
    return value, (d if straight else grad)


def token_loss(
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    *,
    ids: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    ref: torch.Tensor | None,
    rollout_w: torch.Tensor | None,
    factor: torch.Tensor | None,
    denom: torch.Tensor | None,
    row0: int,
    seq_len: int,
    adv_per_seq: bool,
    factor_per_seq: bool,
    ignore_index: int,
    norm_mult: float,
    denom_floor: float,
    loss: str,
    clip_lo: float,
    clip_hi: float,
    delta: float,
    dual_clip: float | None,
    tau_pos: float,
    tau_neg: float,
    kl: str | None,
    kl_straight: bool,
    kl_coef: float,
    entropy_coef: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(loss_tokens, g_logp, g_entropy)``, each fp32 ``[N]`` (``g_entropy`` None without entropy).

    Args:
        logp, entropy: ``[N]`` float, this slice's log-probs (and entropy, or None).
        ids: ``[N]`` int, ``ignore_index`` at inactive tokens.
        old, adv, ref, rollout_w, factor: ``[N]`` float per-token constants (None: absent).
        denom: 0-dim tensor of the aggregation denominator, or None.
        row0, seq_len, adv_per_seq, factor_per_seq: with ``*_per_seq``, ``adv``/``factor`` are
            ``[S]`` per sequence and token i belongs to sequence (row0 + i) // seq_len.
        Other arguments: the scalars described in :mod:`rlkernel.kernels.token_loss`.
    """
    f32 = torch.float32
    active = ids != ignore_index
    seq = (row0 + torch.arange(ids.numel(), device=ids.device)) // max(seq_len, 1)
    if adv_per_seq:
        adv = adv[seq]
    if factor_per_seq and factor is not None:
        factor = factor[seq]

    def get(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.where(active, t.to(f32), 0.0)

    def bad(t: torch.Tensor) -> torch.Tensor:
        return ~torch.isfinite(t)

    x, old_, a = get(logp), get(old), get(adv)
    nan_in = bad(x) | bad(a)
    if loss != "reinforce":  # −A·logp does not read old
        nan_in |= bad(old_)
    lr = x - old_
    r = torch.exp(lr.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    dr = r * _pass(lr, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    pol, g = _policy(loss, x, r, dr, a, clip_lo, clip_hi, delta, dual_clip, tau_pos, tau_neg)
    if rollout_w is not None:
        rho = get(rollout_w)
        nan_in |= rho.isnan()
        pol, g = pol * rho, g * rho
    if kl is not None:
        ref_ = get(ref)
        nan_in |= bad(ref_)
        kv, kg = _kl(kl, x - ref_, kl_straight)
        pol, g = pol + kl_coef * kv, g + kl_coef * kg
    den = torch.tensor(norm_mult, dtype=f32, device=x.device)
    if denom is not None:
        den = den * denom.to(device=x.device, dtype=f32).clamp_min(denom_floor)
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
        loss_t = loss_t - entropy_coef * w * h
        g_entropy = torch.where(active, -entropy_coef * w, 0.0)
    nan = torch.full_like(x, float("nan"))
    loss_t = torch.where(active, torch.where(nan_in, nan, loss_t), 0.0)
    g_logp = torch.where(active, torch.where(nan_in, nan, g_logp), 0.0)
    return loss_t, g_logp, g_entropy
