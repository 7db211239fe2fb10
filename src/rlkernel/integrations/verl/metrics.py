"""verl's metrics of its policy losses, by verl's definitions (verl 0.9.1, ``core_algos``).

Each verl loss returns a dict of Python floats next to its loss; ``rk_<mode>`` returns the same dict,
computed here from the detached inputs with verl's own ``masked_mean`` (``Σ m·x / (Σ m + 1e-8)``):

    mode       actor/pg_clipfrac                       actor/ppo_kl            actor/pg_clipfrac_lower
    vanilla    −A·clip(r) > −A·r                        −clamp(lr, ±20)         dual clip taken (A < 0)
    gspo       the same with the sequence ratio s_i     −lr (unbounded)         0
    cispo      r ≠ clamp(r, 1 − ε_low, 1 + ε_high)      −clamp(lr, ±20)         0
    sapo       0                                        −clamp(lr, ±20)         0
    geo_mean   lr clamped (either bound) and A > 0      −lr (unbounded)         lr clamped and A < 0
    gpg        (no metrics)
    dro        —                                        −lr (unbounded)         —    (ppo_kl only)
    dppo_tv    outside the trust region (p − p_old       −clamp(lr, ±20)         r > c inside the region
               > δ_high for A > 0, < −δ_low otherwise)
    dppo_kl    the same with the binary KL of (p_old, p)
    clip_cov   the tokens cut (rlkernel's cov_frac:      −lr (unbounded)         —
               the same random draw as verl's)
    kl_cov     —                                        mean |lr| (unbounded)   —    (ppo_kl only)

(lr = log_prob − old_log_prob, r = exp(lr), means over the response tokens.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from verl.utils import torch_functional as verl_F

from rlkernel.rl import PolicyLossConfig
from rlkernel.rl.objectives import GSPO_LOG_RATIO_MAX, LOG_RATIO_BOUND


@dataclass(frozen=True)
class MetricInputs:
    """Detached inputs of verl's metrics: ``[B, T]`` tensors, the bool mask, the mapped config, and
    :func:`rlkernel.policy_loss`'s metrics of the call (0-dim tensors; clip_cov's random cut)."""

    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    cfg: PolicyLossConfig
    loss_metrics: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def mean(self, values: torch.Tensor) -> float:
        """verl's ``masked_mean`` over the response tokens, as a float (verl's ``.item()``)."""
        return verl_F.masked_mean(values, self.mask).item()


def clip_metrics(clipfrac: float, ppo_kl: float, clipfrac_lower: float) -> dict[str, float]:
    return {"actor/pg_clipfrac": clipfrac, "actor/ppo_kl": ppo_kl, "actor/pg_clipfrac_lower": clipfrac_lower}


def bounded_log_ratio(m: MetricInputs) -> torch.Tensor:
    return (m.log_prob - m.old_log_prob).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def vanilla(m: MetricInputs) -> dict[str, float]:
    """verl's vanilla: the clipped branch taken, the dual clip taken (A < 0), −log-ratio."""
    log_ratio = bounded_log_ratio(m)
    ratio, adv, cfg = log_ratio.exp(), m.advantages, m.cfg
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    dual = (torch.maximum(unclipped, clipped) > -adv * cfg.dual_clip) & (adv < 0)
    return clip_metrics(m.mean((clipped > unclipped).float()), m.mean(-log_ratio), m.mean(dual.float()))


def gspo(m: MetricInputs) -> dict[str, float]:
    """verl's gspo: per token, the clipped branch of the sequence ratio taken; −log-ratio unbounded."""
    log_ratio, adv, cfg = m.log_prob - m.old_log_prob, m.advantages, m.cfg
    seq = torch.where(m.mask, log_ratio, 0.0).sum(-1) / m.mask.sum(-1).clamp(min=1)
    ratio = seq.clamp(max=GSPO_LOG_RATIO_MAX).exp()[:, None]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    return clip_metrics(m.mean((clipped > unclipped).float()), m.mean(-log_ratio), 0.0)


def cispo(m: MetricInputs) -> dict[str, float]:
    """verl's cispo: the importance weight clamped (either bound)."""
    log_ratio = bounded_log_ratio(m)
    ratio = log_ratio.exp()
    clamped = ratio.clamp(1 - m.cfg.clip_low, 1 + m.cfg.clip_high)
    return clip_metrics(m.mean((ratio != clamped).float()), m.mean(-log_ratio), 0.0)


def sapo(m: MetricInputs) -> dict[str, float]:
    return clip_metrics(0.0, m.mean(-bounded_log_ratio(m)), 0.0)


def geo_mean(m: MetricInputs) -> dict[str, float]:
    """verl's geo_mean: the log-ratio clamped (either bound) where A > 0, resp. A < 0; unbounded."""
    log_ratio = m.log_prob - m.old_log_prob
    clipped = log_ratio != log_ratio.clamp(-m.cfg.clip_low, m.cfg.clip_high)
    adv = m.advantages
    return clip_metrics(
        m.mean((clipped & (adv > 0)).float()), m.mean(-log_ratio), m.mean((clipped & (adv < 0)).float())
    )


def gpg(m: MetricInputs) -> dict[str, float]:
    return {}


def dro(m: MetricInputs) -> dict[str, float]:
    return {"actor/ppo_kl": m.mean(-(m.log_prob - m.old_log_prob))}


def _dppo(m: MetricInputs, outside: torch.Tensor) -> dict[str, float]:
    """verl's dppo_*: the fraction outside the trust region; the truncated ratio (r > c) inside it."""
    log_ratio = bounded_log_ratio(m)
    truncated = (log_ratio.exp() > m.cfg.dppo_ratio_cap) & ~outside
    return clip_metrics(m.mean(outside.float()), m.mean(-log_ratio), m.mean(truncated.float()))


def dppo_tv(m: MetricInputs) -> dict[str, float]:
    """DPPO-Binary-TV: outside where p − p_old > δ_high (A > 0), resp. < −δ_low (A ≤ 0)."""
    diff = m.log_prob.exp() - m.old_log_prob.exp()
    inside = torch.where(m.advantages > 0, diff <= m.cfg.clip_high, diff >= -m.cfg.clip_low)
    return _dppo(m, ~inside)


def dppo_kl(m: MetricInputs) -> dict[str, float]:
    """DPPO-Binary-KL: the binary KL of (p_old, p) above δ_high while p rises (A > 0), resp. above
    δ_low while p falls (A ≤ 0); verl's 1e-8 inside the logarithm."""
    p, q = m.log_prob.exp(), m.old_log_prob.exp()
    kl = q * (m.old_log_prob - m.log_prob) + (1 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
    inside = torch.where(
        m.advantages > 0, (kl <= m.cfg.clip_high) | (p <= q), (kl <= m.cfg.clip_low) | (p >= q)
    )
    return _dppo(m, ~inside)


def clip_cov(m: MetricInputs) -> dict[str, float]:
    """verl's clip_cov: pg_clipfrac is the fraction of tokens cut (the random draw: rlkernel's
    ``cov_frac`` of the same call); −log-ratio unbounded."""
    return {
        "actor/pg_clipfrac": m.loss_metrics["cov_frac"].item(),
        "actor/ppo_kl": m.mean(-(m.log_prob - m.old_log_prob)),
    }


def kl_cov(m: MetricInputs) -> dict[str, float]:
    """verl's kl_cov: the mean |log-ratio| (unbounded) only."""
    return {"actor/ppo_kl": m.mean((m.log_prob - m.old_log_prob).abs())}
