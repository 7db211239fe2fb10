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

All variants share two helpers: :func:`token_ratio` (the guarded exponential) and
:func:`clipped_surrogate` (the PPO max/clip with optional δ cap and dual clip), used by ppo, gspo and
gspo_token alike. Sequence-level losses (gspo, gmpo) are computed per sequence and broadcast over
the sequence's tokens, so that every aggregation mode applies to them unchanged (with
``seq-mean-token-mean`` the loss is the mean of ℓ_i).

Provenance: verl ``core_algos`` (``compute_policy_loss_vanilla`` / ``_gspo`` / ``_cispo`` / ``_sapo`` /
``_geo_mean``), TRL ``GRPOTrainer._compute_loss`` (``delta``, sequence-level importance sampling,
``cispo``, ``sapo``), and the PPO, GSPO, CISPO (MiniMax-M1), SAPO and GMPO papers.

Caveats (verl's numerical guards, reproduced):
    * ppo, cispo and sapo clamp lr to [−20, 20] before the exponential (gradient 0 beyond); TRL does
      not clamp. gmpo and reinforce use lr unclamped, as verl does.
    * gspo and gspo_token clamp log s from above at 10 (s ≤ e^10 ≈ 22026), as verl's gspo does.
    * gmpo follows verl's ``geo_mean`` exactly, including tokens with A = 0 contributing lr' = 0 to
      the geometric mean (they pull s_i towards 1) and clipping decided per token by sign(A).
    * The value at a masked position is finite but meaningless; the aggregation masks it.
    * The clamps above bound finite drift only: ``policy_loss`` turns ±inf inputs at active
      positions into NaN before they get here, so a clamp never turns an infinite log-prob into a
      finite loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlkernel.rl.aggregate import seq_count, seq_sum
from rlkernel.rl.config import PolicyLossConfig

LOG_RATIO_BOUND = 20.0  # |logp − old_logp| clamp of ppo/cispo/sapo (verl's stability guard)
GSPO_LOG_RATIO_MAX = 10.0  # upper clamp of log s in gspo/gspo_token (verl)


@dataclass(frozen=True)
class PolicyTerm:
    """A loss type's per-token loss and what the metrics need to know about its ratio.

    Attributes:
        loss: ``[S, L]`` per-token policy loss (differentiable in logp).
        ratio: the importance ratio the objective clips, detached: ``[S, L]`` per token, or ``[S]``
            per sequence for gspo/gspo_token.
        ratio_mask: bool, the shape of ``ratio``: the entries that count (active tokens / sequences).
        clipped_low, clipped_high: bool, the shape of ``ratio``: where the lower / upper clip is active.
        clipped_dual: bool ``[S, L]`` where the dual clip is active, or ``None`` without dual clip.
        sequence_level: the loss is one value per sequence (gmpo): rollout weights fold per sequence.
    """

    loss: torch.Tensor
    ratio: torch.Tensor
    ratio_mask: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    clipped_dual: torch.Tensor | None = None
    sequence_level: bool = False


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


def _ppo(cfg, logp, old_logp, adv, adv_seq, mask) -> PolicyTerm:
    ratio = token_ratio(logp, old_logp)
    loss = clipped_surrogate(
        ratio, adv, cfg.clip_low, cfg.clip_high, delta=cfg.delta, dual_clip=cfg.dual_clip
    )
    r = ratio.detach()
    low, high = _clip_flags(r, adv, cfg)
    dual = None if cfg.dual_clip is None else (adv < 0) & (r > cfg.dual_clip)
    return PolicyTerm(loss, r, mask, low, high, dual)


def _seq_log_ratio(logp, old_logp, mask) -> torch.Tensor:
    """``[S]``: log s_i = Σ_t m·lr / n_i (0 for an empty sequence), clamped above like verl."""
    mean = seq_sum(logp - old_logp, mask) / seq_count(mask, logp.dtype).clamp_min(1)
    return mean.clamp(max=GSPO_LOG_RATIO_MAX)


def _gspo(cfg, logp, old_logp, adv, adv_seq, mask) -> PolicyTerm:
    seq_ratio = torch.exp(_seq_log_ratio(logp, old_logp, mask))
    seq_loss = clipped_surrogate(seq_ratio, adv_seq, cfg.clip_low, cfg.clip_high)
    return _sequence_term(seq_loss, seq_ratio, adv_seq, mask, cfg)


def _gspo_token(cfg, logp, old_logp, adv, adv_seq, mask) -> PolicyTerm:
    mean = seq_sum(logp.detach() - old_logp, mask) / seq_count(mask, logp.dtype).clamp_min(1)
    # log s_it = sg[log s_i] + logp − sg[logp]: the value of s_i, the gradient of one token's logp.
    # Clamped once, after the sum, as verl does: above the bound the token gets no gradient (a
    # pre-clamped log s_i would sit exactly at the bound, where clamp passes the gradient).
    log_ratio = (logp - logp.detach() + mean[:, None]).clamp(max=GSPO_LOG_RATIO_MAX)
    loss = clipped_surrogate(torch.exp(log_ratio), adv, cfg.clip_low, cfg.clip_high)
    seq_ratio = torch.exp(mean.clamp(max=GSPO_LOG_RATIO_MAX))
    return _sequence_term(loss, seq_ratio, adv_seq, mask, cfg, broadcast=False)


def _sequence_term(loss, seq_ratio, adv_seq, mask, cfg, *, broadcast: bool = True) -> PolicyTerm:
    """GSPO-family term: metrics are about the sequence ratio s_i of non-empty sequences."""
    if broadcast:
        loss = loss[:, None].expand(mask.shape)
    ratio = seq_ratio.detach()
    low, high = _clip_flags(ratio, adv_seq, cfg)
    return PolicyTerm(loss, ratio, mask.any(-1), low, high)


def _cispo(cfg, logp, old_logp, adv, adv_seq, mask) -> PolicyTerm:
    ratio = token_ratio(logp, old_logp).detach()
    lower = None if cfg.clip_low is None else 1.0 - cfg.clip_low
    weight = ratio.clamp(min=lower, max=1.0 + cfg.clip_high)
    loss = -weight * adv * logp
    low = torch.zeros_like(mask) if lower is None else ratio < lower
    return PolicyTerm(loss, ratio, mask, low, ratio > 1.0 + cfg.clip_high)


def _sapo(cfg, logp, old_logp, adv, adv_seq, mask) -> PolicyTerm:
    ratio = token_ratio(logp, old_logp)
    tau = torch.where(adv > 0, ratio.new_tensor(cfg.sapo_tau_pos), ratio.new_tensor(cfg.sapo_tau_neg))
    loss = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv
    never = torch.zeros_like(mask)
    return PolicyTerm(loss, ratio.detach(), mask, never, never)


def _gmpo(cfg, logp, old_logp, adv, adv_seq, mask) -> PolicyTerm:
    log_ratio = logp - old_logp
    capped = torch.where(
        adv > 0,
        log_ratio.clamp(max=cfg.clip_high),
        torch.where(adv < 0, log_ratio.clamp(min=-cfg.clip_low), torch.zeros_like(log_ratio)),
    )
    seq_ratio = torch.exp(seq_sum(capped, mask) / seq_count(mask, logp.dtype).clamp_min(1))
    loss = (-adv_seq * seq_ratio)[:, None].expand(mask.shape)
    lr = log_ratio.detach()
    low = (adv < 0) & (lr < -cfg.clip_low)
    high = (adv > 0) & (lr > cfg.clip_high)
    return PolicyTerm(
        loss, torch.exp(lr.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)), mask, low, high, sequence_level=True
    )


def _reinforce(cfg, logp, old_logp, adv, adv_seq, mask) -> PolicyTerm:
    never = torch.zeros_like(mask)
    return PolicyTerm(-adv * logp, token_ratio(logp, old_logp).detach(), mask, never, never)


_TERMS = {
    "ppo": _ppo,
    "gspo": _gspo,
    "gspo_token": _gspo_token,
    "cispo": _cispo,
    "sapo": _sapo,
    "gmpo": _gmpo,
    "reinforce": _reinforce,
}


def policy_term(
    cfg: PolicyLossConfig,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    adv_seq: torch.Tensor,
    mask: torch.Tensor,
) -> PolicyTerm:
    """The per-token policy loss of ``cfg.loss_type``.

    Args:
        cfg: the validated config.
        logp: ``[S, L]`` float, differentiable, 0 at masked positions (already sanitized).
        old_logp: ``[S, L]`` float, detached, 0 at masked positions.
        adv: ``[S, L]`` float per-token advantages, 0 at masked positions.
        adv_seq: ``[S]`` float per-sequence advantages A_i (0 for empty sequences).
        mask: ``[S, L]`` bool, active tokens.

    Returns:
        :class:`PolicyTerm` with the ``[S, L]`` loss (unmasked; the aggregation masks it).
    """
    return _TERMS[cfg.loss_type](cfg, logp, old_logp, adv, adv_seq, mask)
