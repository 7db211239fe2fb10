"""Per-token policy-loss terms for every ``loss_type``, on the padded ``[S, L]`` layout.

Notation: m = active mask, lr = logp − old_logp, r = exp(lr), A = advantage at each token,
A_i = the sequence's advantage (given per sequence, or the masked mean of per-token A),
n_i = Σ_t m, sg = stop-gradient, clip(x) = clamp(x, 1 − ε_low, 1 + ε_high).

    ppo         ℓ = max(−A·min(r, δ), −A·clip(r));  where A < 0 and dual clip c: ℓ = min(ℓ, −c·A)
    gspo        s_i = exp(Σ_t m·lr / n_i);  ℓ_i = max(−A_i s_i, −A_i clip(s_i)), broadcast to tokens
    gspo_token  s_it = sg[s_i]·exp(logp − sg[logp]);  ℓ = max(−A s_it, −A clip(s_it))
    cispo       ℓ = −sg[clamp(r, 1 − ε_low, 1 + ε_high)]·A·logp   (ε_low = None: no lower bound)
    sapo        ℓ = −(4/τ)·σ(τ(r − 1))·A,  τ = τ_pos if A > 0 else τ_neg
    gmpo        lr' = min(lr, ε_high) if A > 0, max(lr, −ε_low) if A < 0, 0 if A = 0;
                ℓ_i = −A_i·exp(Σ_t m·lr' / n_i), broadcast to tokens
    reinforce   ℓ = −A·logp
    vespo       log w_i = clamp(Σ_t m·clamp(lr, ±20), log 1e-8, 20)   (rollout: + Σ_t m·clamp(log ω_t))
                φ = exp(λ + k·log w_i − λ·w_i),  (k, λ) = (k_pos, λ_pos) if A ≥ 0 else (k_neg, λ_neg)
                ℓ = −sg[φ]·A·logp
    dppo_tv     ℓ = −A·sg[min(r, c)]·logp·sg[v],  v = (p − p_old ≤ δ_high) if A > 0
                                                      else (p − p_old ≥ −δ_low),  p = e^logp
    dppo_kl     the same with v = (D ≤ δ_high or p ≤ p_old) if A > 0 else (D ≤ δ_low or p ≥ p_old),
                D = p_old·(old − logp) + (1 − p_old)·log((1 − p_old + 1e-8) / (1 − p + 1e-8))
    clip_cov    ℓ = max(−A·r, −A·clip(r))·(1 − cut),  r unclamped; cut: k random tokens with
                lb < cov < ub, not PPO-clipped (:mod:`rlkernel.rl.covariance`)
    kl_cov      ℓ = −A·r + kl_cov_coef·|lr|·top,  r unclamped; top: the k largest cov
    dro         ℓ = −(A·logp − ½β·lr²)

``seq_ratio`` changes the sequence ratio of gspo, gspo_token (default ``geo_mean``: Σ/n_i) and vespo
(default ``product``: Σ). δ_low, δ_high are ``clip_low``, ``clip_high``; c is ``dppo_ratio_cap``;
β is ``dro_beta``; k, λ are the ``vespo_*`` fields; ``clip_cov_*``, ``kl_cov_*`` as named.

All variants share two helpers: :func:`token_ratio` (the guarded exponential) and
:func:`clipped_surrogate` (the PPO max/clip with optional δ cap and dual clip), used by ppo, gspo and
gspo_token alike. Sequence-level losses (gspo, gmpo) are computed per sequence and broadcast over
the sequence's tokens, so that every aggregation mode applies to them unchanged (with
``seq-mean-token-mean`` the loss is the mean of ℓ_i).

Provenance: verl ``core_algos`` (``compute_policy_loss_vanilla`` / ``_gspo`` / ``_cispo`` / ``_sapo`` /
``_geo_mean`` / ``_dppo_tv`` / ``_dppo_kl`` / ``_clip_cov`` / ``_kl_cov`` / ``_dro``), TRL
``GRPOTrainer._compute_loss`` (``delta``, sequence-level importance sampling, ``cispo``, ``sapo``,
``vespo`` and its ``get_gamma_weights``), and the PPO, GSPO, CISPO (MiniMax-M1), SAPO, GMPO, VESPO,
DPPO and Clip-Cov/KL-Cov papers.

Caveats (verl's numerical guards, reproduced):
    * ppo, cispo and sapo clamp lr to [−20, 20] before the exponential (gradient 0 beyond); TRL does
      not clamp. gmpo and reinforce use lr unclamped, as verl does.
    * gspo and gspo_token clamp log s from above at 10 (s ≤ e^10 ≈ 22026), as verl's gspo does.
    * dppo_* clamp lr to ±20 (the weight r) like ppo; clip_cov, kl_cov and dro use lr unclamped, as
      verl does. vespo's clamps are TRL's (±20 per token, [log 1e-8, 20] for log w, λ ≥ 1e-4);
      TRL zeroes a φ that is NaN or ±inf, here only +inf is zeroed (NaN inputs must give NaN).
    * gmpo follows verl's ``geo_mean`` exactly, including tokens with A = 0 contributing lr' = 0 to
      the geometric mean (they pull s_i towards 1) and clipping decided per token by sign(A).
    * The value at a masked position is finite but meaningless; the aggregation masks it.
    * The clamps above bound finite drift only: ``policy_loss`` turns ±inf inputs at active
      positions into NaN before they get here, so a clamp never turns an infinite log-prob into a
      finite loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlkernel._token_loss_plan import LOG_RATIO_BOUND  # |logp − old_logp| clamp of ppo/cispo/sapo/dppo
from rlkernel.rl import covariance
from rlkernel.rl.aggregate import seq_any, seq_count, seq_sum
from rlkernel.rl.config import PolicyLossConfig
from rlkernel.rl.rollout import RolloutWeights

GSPO_LOG_RATIO_MAX = 10.0  # upper clamp of log s in gspo/gspo_token (verl)
# TRL's VESPO guards: log w clamped to [log 1e-8, 20] (also each log rollout weight), λ ≥ 1e-4.
VESPO_LOG_W_MIN = math.log(1e-8)
VESPO_LOG_W_MAX = 20.0
VESPO_LAMBDA_MIN = 1e-4


@dataclass(frozen=True)
class PolicyTerm:
    """A loss type's per-token loss and what the metrics need to know about its ratio.

    Attributes:
        loss: ``[S, L]`` per-token policy loss (differentiable in logp).
        ratio: the importance ratio the objective clips, detached: ``[S, L]`` per token, or ``[S]``
            per sequence for gspo/gspo_token/vespo.
        ratio_mask: bool, the shape of ``ratio``: the entries that count (active tokens / sequences).
        clipped_low, clipped_high: bool, the shape of ``ratio``: where the lower / upper clip is active.
        clipped_dual: bool ``[S, L]`` where the dual clip is active, or ``None`` without dual clip.
        rollout_folded: the rollout-correction weights are already inside ``loss`` (vespo folds them
            into its sequence ratio); the caller must not multiply them in again.
        extra: loss-type metrics, ``(name, values, valid)`` triples, detached: the metric is the mean
            of ``values`` over ``valid`` (computed only when the metrics are read).
    """

    loss: torch.Tensor
    ratio: torch.Tensor
    ratio_mask: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    clipped_dual: torch.Tensor | None = None
    rollout_folded: bool = False
    extra: tuple[tuple[str, torch.Tensor, torch.Tensor], ...] = ()


def token_ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, bound: float | None = LOG_RATIO_BOUND
) -> torch.Tensor:
    """r = exp(logp − old_logp), the log-ratio clamped to ±``bound`` first (``None``: unclamped)."""
    log_ratio = logp - old_logp
    if bound is not None:
        log_ratio = log_ratio.clamp(-bound, bound)
    return torch.exp(log_ratio)


def clipped_surrogate(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    clip_low: float,
    clip_high: float,
    *,
    delta: float | None = None,
    dual_clip: float | None = None,
) -> torch.Tensor:
    """PPO's pessimistic clipped loss max(−A·min(r, δ), −A·clip(r)), then the dual clip where A < 0."""
    unclipped = ratio if delta is None else ratio.clamp(max=delta)
    loss = torch.maximum(-adv * unclipped, -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    return loss


def _clip_flags(
    ratio: torch.Tensor, adv: torch.Tensor, cfg: PolicyLossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where PPO's clipped branch is the one taken (its gradient is 0): by the sign of A."""
    low = (adv < 0) & (ratio < 1.0 - cfg.clip_low)
    high = (adv > 0) & (ratio > 1.0 + cfg.clip_high)
    return low, high


def _ppo(cfg, logp, old_logp, adv, adv_seq, mask, cp=None) -> PolicyTerm:
    ratio = token_ratio(logp, old_logp)
    loss = clipped_surrogate(
        ratio, adv, cfg.clip_low, cfg.clip_high, delta=cfg.delta, dual_clip=cfg.dual_clip
    )
    r = ratio.detach()
    low, high = _clip_flags(r, adv, cfg)
    dual = None if cfg.dual_clip is None else (adv < 0) & (r > cfg.dual_clip)
    return PolicyTerm(loss, r, mask, low, high, dual)


def seq_ratio_convention(cfg: PolicyLossConfig) -> str:
    """``"geo_mean"`` or ``"product"``: ``cfg.seq_ratio``, or the loss type's own convention."""
    if cfg.seq_ratio is not None:
        return cfg.seq_ratio
    return "product" if cfg.loss_type == "vespo" else "geo_mean"


def seq_log_sum(x: torch.Tensor, mask: torch.Tensor, convention: str, cp=None) -> torch.Tensor:
    """``[S]``: Σ_t m·x (``product``) or Σ_t m·x / n_i (``geo_mean``); 0 for an empty sequence.
    ``cp``: over every rank's slice of the sequence (:mod:`rlkernel.rl.context_parallel`)."""
    total = seq_sum(x, mask, cp)
    if convention == "geo_mean":
        total = total / seq_count(mask, x.dtype, cp).clamp_min(1)
    return total


def _seq_log_ratio(cfg, logp, old_logp, mask, cp=None) -> torch.Tensor:
    """``[S]``: log s_i of the configured convention (0 for an empty sequence), clamped above at 10
    like verl's gspo."""
    return seq_log_sum(logp - old_logp, mask, seq_ratio_convention(cfg), cp).clamp(max=GSPO_LOG_RATIO_MAX)


def _gspo(cfg, logp, old_logp, adv, adv_seq, mask, cp=None) -> PolicyTerm:
    seq_ratio = torch.exp(_seq_log_ratio(cfg, logp, old_logp, mask, cp))
    seq_loss = clipped_surrogate(seq_ratio, adv_seq, cfg.clip_low, cfg.clip_high)
    return _sequence_term(seq_loss, seq_ratio, adv_seq, mask, cfg, cp)


def _gspo_token(cfg, logp, old_logp, adv, adv_seq, mask, cp=None) -> PolicyTerm:
    # log s_i of the configured convention, not clamped yet (see below)
    mean = seq_log_sum(logp.detach() - old_logp, mask, seq_ratio_convention(cfg), cp)
    # log s_it = sg[log s_i] + logp − sg[logp]: the value of s_i, the gradient of one token's logp.
    # Clamped once, after the sum, as verl does: above the bound the token gets no gradient (a
    # pre-clamped log s_i would sit exactly at the bound, where clamp passes the gradient).
    log_ratio = (logp - logp.detach() + mean[:, None]).clamp(max=GSPO_LOG_RATIO_MAX)
    loss = clipped_surrogate(torch.exp(log_ratio), adv, cfg.clip_low, cfg.clip_high)
    seq_ratio = torch.exp(mean.clamp(max=GSPO_LOG_RATIO_MAX))
    return _sequence_term(loss, seq_ratio, adv_seq, mask, cfg, cp, broadcast=False)


def _sequence_term(loss, seq_ratio, adv_seq, mask, cfg, cp=None, *, broadcast: bool = True) -> PolicyTerm:
    """GSPO-family term: metrics are about the sequence ratio s_i of non-empty sequences."""
    if broadcast:
        loss = loss[:, None].expand(mask.shape)
    ratio = seq_ratio.detach()
    low, high = _clip_flags(ratio, adv_seq, cfg)
    return PolicyTerm(loss, ratio, seq_any(mask, cp), low, high)


def _cispo(cfg, logp, old_logp, adv, adv_seq, mask, cp=None) -> PolicyTerm:
    ratio = token_ratio(logp, old_logp).detach()
    lower = None if cfg.clip_low is None else 1.0 - cfg.clip_low
    weight = ratio.clamp(min=lower, max=1.0 + cfg.clip_high)
    loss = -weight * adv * logp
    low = torch.zeros_like(mask) if lower is None else ratio < lower
    return PolicyTerm(loss, ratio, mask, low, ratio > 1.0 + cfg.clip_high)


def _sapo(cfg, logp, old_logp, adv, adv_seq, mask, cp=None) -> PolicyTerm:
    ratio = token_ratio(logp, old_logp)
    tau = torch.where(adv > 0, ratio.new_tensor(cfg.sapo_tau_pos), ratio.new_tensor(cfg.sapo_tau_neg))
    loss = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv
    never = torch.zeros_like(mask)
    return PolicyTerm(loss, ratio.detach(), mask, never, never)


def _gmpo(cfg, logp, old_logp, adv, adv_seq, mask, cp=None) -> PolicyTerm:
    log_ratio = logp - old_logp
    capped = torch.where(
        adv > 0,
        log_ratio.clamp(max=cfg.clip_high),
        torch.where(adv < 0, log_ratio.clamp(min=-cfg.clip_low), torch.zeros_like(log_ratio)),
    )
    seq_ratio = torch.exp(seq_sum(capped, mask, cp) / seq_count(mask, logp.dtype, cp).clamp_min(1))
    loss = (-adv_seq * seq_ratio)[:, None].expand(mask.shape)
    lr = log_ratio.detach()
    low = (adv < 0) & (lr < -cfg.clip_low)
    high = (adv > 0) & (lr > cfg.clip_high)
    return PolicyTerm(loss, torch.exp(lr.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)), mask, low, high)


def _reinforce(cfg, logp, old_logp, adv, adv_seq, mask, cp=None) -> PolicyTerm:
    never = torch.zeros_like(mask)
    return PolicyTerm(-adv * logp, token_ratio(logp, old_logp).detach(), mask, never, never)


# ------------------------------------------------------------------ issue 14: more loss types


def _vespo(cfg, logp, old_logp, adv, adv_seq, mask, rollout_w=None, cp=None) -> PolicyTerm:
    """VESPO (TRL ``loss_type="vespo"``): ℓ = −sg[φ]·A·logp with the Gamma weight φ of the sequence
    ratio w_i, and the rollout weights folded into w_i (TRL multiplies them into nothing else)."""
    with torch.no_grad():
        lr = (logp.detach() - old_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        convention = seq_ratio_convention(cfg)
        log_w = seq_log_sum(lr, mask, convention, cp)
        if rollout_w is not None:
            log_w = log_w + _vespo_rollout_log_weight(rollout_w, mask, cfg.rollout_correction, convention, cp)
        log_w = log_w.clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
        w = torch.exp(log_w)
        nonneg = adv >= 0
        k = torch.where(nonneg, lr.new_tensor(cfg.vespo_k_pos), lr.new_tensor(cfg.vespo_k_neg))
        lam_pos = lr.new_tensor(max(cfg.vespo_lambda_pos, VESPO_LAMBDA_MIN))
        lam = torch.where(nonneg, lam_pos, lr.new_tensor(max(cfg.vespo_lambda_neg, VESPO_LAMBDA_MIN)))
        phi = torch.exp(lam + k * log_w[:, None] - lam * w[:, None])
        # TRL zeroes an overflowing φ (and a NaN one: here NaN stays NaN, see the module Caveats).
        phi = torch.where(phi == float("inf"), 0.0, phi)
    loss = -phi * adv * logp
    never = torch.zeros_like(w, dtype=torch.bool)
    return PolicyTerm(
        loss, w, seq_any(mask, cp), never, never, rollout_folded=True, extra=(("vespo_phi_mean", phi, mask),)
    )


def _vespo_rollout_log_weight(rollout_w, mask, correction: str, convention: str, cp=None) -> torch.Tensor:
    """``[S]``: the rollout weights' share of log w_i: Σ_t m·clamp(log ω_t) for token modes, the
    sequence's clamp(log ω_i) for sequence modes (geo_mean: divided by n_i, as the policy part)."""
    log_is = torch.log(rollout_w.weight).clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
    if correction.startswith("token"):
        return seq_log_sum(log_is, mask, convention, cp)
    # Sequence modes: one weight per sequence, broadcast over its tokens; read it once (exactly).
    if mask.shape[-1] == 0:  # amax needs a non-empty dimension
        per_seq = log_is.new_full(mask.shape[:-1], -float("inf"))
    else:
        per_seq = torch.where(mask, log_is, -float("inf")).amax(-1)
    if cp is not None:  # the ranks without a token of the sequence hold -inf
        per_seq = cp.max(per_seq)
    per_seq = torch.where(seq_any(mask, cp), per_seq, 0.0)
    if convention == "geo_mean":
        per_seq = per_seq / seq_count(mask, per_seq.dtype, cp).clamp_min(1)
    return per_seq


def _dppo_valid(cfg, logp, old_logp, adv) -> torch.Tensor:
    """bool ``[S, L]``: DPPO's trust region, decided per token by sign(A) on the probabilities."""
    p, p_old = torch.exp(logp), torch.exp(old_logp)
    if cfg.loss_type == "dppo_tv":
        diff = p - p_old
        pos, neg = diff <= cfg.clip_high, diff >= -cfg.clip_low
    else:
        # Binary KL of the Bernoulli "this token / any other token" (verl's 1e-8 guards).
        bkl = p_old * (old_logp - logp) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        pos, neg = (bkl <= cfg.clip_high) | (p <= p_old), (bkl <= cfg.clip_low) | (p >= p_old)
    return torch.where(adv > 0, pos, neg)


def _dppo(cfg, logp, old_logp, adv, adv_seq, mask, cp=None) -> PolicyTerm:
    """DPPO-Binary-TV / -KL (verl ``dppo_tv`` / ``dppo_kl``): ℓ = −A·sg[min(r, c)]·logp·sg[valid]."""
    ratio = token_ratio(logp, old_logp).detach()
    weight = ratio if cfg.dppo_ratio_cap is None else ratio.clamp(max=cfg.dppo_ratio_cap)
    valid = _dppo_valid(cfg, logp.detach(), old_logp, adv)
    # A product, not torch.where: a NaN logp must give a NaN loss, also where the token is invalid.
    loss = -adv * weight * logp * valid.to(logp.dtype)
    positive = adv > 0
    return PolicyTerm(loss, ratio, mask, ~valid & ~positive, ~valid & positive)


def _clip_cov(cfg, logp, old_logp, adv, adv_seq, mask, cp=None) -> PolicyTerm:
    """Clip-Cov (verl ``clip_cov``): the PPO clipped loss (unclamped ratio, no dual clip), times 0 on
    the randomly drawn high-covariance tokens (:mod:`rlkernel.rl.covariance`)."""
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        candidates = mask & ~(clipped > unclipped)
        cut = covariance.clip_cov_cut(
            adv, logp, mask, candidates, cfg.clip_cov_ratio, cfg.clip_cov_lb, cfg.clip_cov_ub, cp
        )
    loss = loss * (~cut).to(loss.dtype)  # a product, as verl: NaN stays NaN on a cut token
    r = ratio.detach()
    low, high = _clip_flags(r, adv, cfg)
    return PolicyTerm(loss, r, mask, low, high, extra=(("cov_frac", cut, mask),))


def _kl_cov(cfg, logp, old_logp, adv, adv_seq, mask, cp=None) -> PolicyTerm:
    """KL-Cov (verl ``kl_cov``): ℓ = −A·r (unclipped, unclamped), + kl_cov_coef·|lr| on the
    largest-covariance tokens (:mod:`rlkernel.rl.covariance`)."""
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    loss = -adv * ratio
    chosen = covariance.kl_cov_chosen(adv, logp, mask, cfg.kl_cov_ratio, cp)
    loss = torch.where(chosen, loss + cfg.kl_cov_coef * log_ratio.abs(), loss)
    never = torch.zeros_like(mask)
    return PolicyTerm(loss, ratio.detach(), mask, never, never, extra=(("cov_frac", chosen, mask),))


def _dro(cfg, logp, old_logp, adv, adv_seq, mask, cp=None) -> PolicyTerm:
    """DRO's penalized policy gradient (verl ``dro``): ℓ = −(A·logp − ½β·lr²)."""
    log_ratio = logp - old_logp
    loss = -(adv * logp - 0.5 * cfg.dro_beta * log_ratio.square())
    never = torch.zeros_like(mask)
    return PolicyTerm(loss, token_ratio(logp, old_logp).detach(), mask, never, never)


_TERMS = {
    "ppo": _ppo,
    "gspo": _gspo,
    "gspo_token": _gspo_token,
    "cispo": _cispo,
    "sapo": _sapo,
    "gmpo": _gmpo,
    "reinforce": _reinforce,
    "dppo_tv": _dppo,
    "dppo_kl": _dppo,
    "clip_cov": _clip_cov,
    "kl_cov": _kl_cov,
    "dro": _dro,
}

# Loss types whose loss is one value per sequence: token rollout weights fold into one per sequence.
ROLLOUT_PER_SEQUENCE: tuple[str, ...] = ("gmpo",)


def importance_ratio(
    cfg: PolicyLossConfig, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, cp=None
) -> torch.Tensor:
    """``[S, L]``, differentiable: the importance ratio that weights the KL term when
    ``cfg.kl_ratio_weighted`` (TRL's ``coef_1``): s_i broadcast for ``gspo``, s_it for
    ``gspo_token``, r_t = exp(clamp(lr, ±20)) for every other loss type."""
    if cfg.loss_type == "gspo":
        return torch.exp(_seq_log_ratio(cfg, logp, old_logp, mask, cp))[:, None].expand(mask.shape)
    if cfg.loss_type == "gspo_token":
        seq_log_ratio = _seq_log_ratio(cfg, logp.detach(), old_logp, mask, cp)
        return torch.exp((logp - logp.detach() + seq_log_ratio[:, None]).clamp(max=GSPO_LOG_RATIO_MAX))
    return token_ratio(logp, old_logp)


def policy_term(
    cfg: PolicyLossConfig,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    adv_seq: torch.Tensor,
    mask: torch.Tensor,
    *,
    rollout_w: RolloutWeights | None = None,
    cp=None,
) -> PolicyTerm:
    """The per-token policy loss of ``cfg.loss_type``.

    Args:
        cfg: the validated config.
        logp: ``[S, L]`` float, differentiable, 0 at masked positions (already sanitized).
        old_logp: ``[S, L]`` float, detached, 0 at masked positions.
        adv: ``[S, L]`` float per-token advantages, 0 at masked positions.
        adv_seq: ``[S]`` float per-sequence advantages A_i (0 for empty sequences).
        mask: ``[S, L]`` bool, active tokens.
        rollout_w: the rollout-correction weights (``None`` without a correction). Only ``vespo``
            reads them (it folds them into its sequence ratio and says so with
            ``PolicyTerm.rollout_folded``); the caller multiplies them into every other loss.
        cp: context parallelism (:class:`rlkernel.rl.context_parallel.ContextParallel`): the
            tensors are this rank's slice of every sequence, and the sequence sums (and the
            covariance selection of clip_cov/kl_cov) span every rank of the group; None: one rank.

    Returns:
        :class:`PolicyTerm` with the ``[S, L]`` loss (unmasked; the aggregation masks it).
    """
    if cfg.loss_type == "vespo":
        return _vespo(cfg, logp, old_logp, adv, adv_seq, mask, rollout_w, cp)
    return _TERMS[cfg.loss_type](cfg, logp, old_logp, adv, adv_seq, mask, cp)
