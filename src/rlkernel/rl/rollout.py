"""Rollout-mismatch correction: detached importance weights between the rollout engine and the trainer.

The rollout engine (vLLM, SGLang, …) samples with its own kernels and precision, so its log-probs
``rollout_logp`` differ from the trainer's ``old_logp`` for the same tokens. The policy term is
reweighted by (a function of) ρ = π_old / π_rollout, detached, before the KL term is added:

    ρ_t = exp(old_logp_t − rollout_logp_t)                  token level
    ρ_i = exp(Σ_t m_t (old_logp_t − rollout_logp_t))         sequence level (product over the sequence)

    token_tis   w_t = clamp(ρ_t, min, max)                  truncated importance sampling
    seq_tis     w_i = clamp(ρ_i, min, max)
    token_mis   w_t = ρ_t · 1[min ≤ ρ_t ≤ max]              masked importance sampling (rejection)
    seq_mis     w_i = ρ_i · 1[min ≤ ρ_i ≤ max]

``min``/``max`` are ``cfg.rollout_clip_min``/``cfg.rollout_clip_max``; ``None`` means no bound on that
side. Sequence weights apply to every token of the sequence.

For ``gmpo``, whose loss is one value per sequence, token-level weights are folded into one weight per
sequence by their geometric mean exp(Σ_t m log w_t / n_i), as verl's ``geo_mean`` loss does.

Provenance: verl ``rollout_corr_helper`` (``rollout_is=token|sequence`` with
``rollout_is_threshold``, rejection sampling ``rollout_rs``), TRL ``vllm_importance_sampling_mode``
(``token_truncate | token_mask | sequence_truncate | sequence_mask``), and "When Speed Kills
Stability" (Liu, Li et al., 2025).

Caveats:
    * verl's truncated IS clamps from above only: keep ``rollout_clip_min=None`` (the default) to
      match it. verl's rejection sampling defaults its lower threshold to 1/upper; here ``None``
      means no lower bound, so pass ``rollout_clip_min=1/max`` to match. verl's rejection also
      zeroes the token in the *mask* (changing token counts); here the weight is 0 and the token
      still counts in the normalizers, as TRL's ``*_mask`` modes do.
    * verl clamps log ρ to ±20 before the exponential; here there is no such clamp: a weight that
      overflows to inf is truncated to ``max`` (TIS) or rejected (MIS) all the same, and it only
      matters without an upper bound.
    * verl's ``geo_mean`` adds 1e-10 inside the log of each token weight; here a rejected token
      (w = 0) makes the sequence weight exactly 0.
    * NaN in ``rollout_logp`` (or ``old_logp``) at an active token gives a NaN weight (never silently
      truncated or rejected). Its callers (``policy_loss``, the fused plan) turn ±inf log-probs
      into NaN first, so those give a NaN weight too rather than a weight of 0 or ``max``. A ρ that
      overflows to inf from *finite* log-probs is truncated or rejected as any large ρ is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlkernel.rl.aggregate import masked, seq_count, seq_sum


@dataclass(frozen=True)
class RolloutWeights:
    """Detached correction weights and what they did.

    Attributes:
        weight: ``[S, L]`` weights to multiply into the per-token policy loss (sequence weights
            broadcast over the sequence); finite garbage-free values at masked positions.
        changed: ``[S, L]`` bool: ρ was truncated (TIS) or rejected (MIS) at this token (for a
            sequence-level mode: for this token's sequence).
    """

    weight: torch.Tensor
    changed: torch.Tensor


def _log_rho(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    log_rho = masked(old_logp - rollout_logp, mask)
    if level == "seq":
        return log_rho.sum(-1, keepdim=True).expand(mask.shape)
    return log_rho


def _outside(rho: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """ρ < low or ρ > high; False for NaN so that a NaN weight is kept and propagates."""
    out = torch.zeros_like(rho, dtype=torch.bool)
    if low is not None:
        out = out | (rho < low)
    if high is not None:
        out = out | (rho > high)
    return out


@torch.no_grad()
def rollout_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
    *,
    per_sequence: bool = False,
) -> RolloutWeights:
    """Correction weights for ``mode`` in ``token_tis | seq_tis | token_mis | seq_mis``.

    Args:
        old_logp, rollout_logp: ``[S, L]`` float (0 at masked positions is fine; they are masked).
        mask: ``[S, L]`` bool, active tokens.
        mode: the correction (see the module docstring).
        clip_min, clip_max: the bounds (``None``: unbounded on that side).
        per_sequence: fold token weights into one geometric-mean weight per sequence (gmpo).

    Returns:
        :class:`RolloutWeights`, detached.
    """
    level, kind = mode.split("_")
    rho = torch.exp(_log_rho(old_logp, rollout_logp, mask, level))
    outside = _outside(rho, clip_min, clip_max)
    if kind == "tis":
        weight = rho.clamp(min=clip_min, max=clip_max)
    else:
        weight = torch.where(outside, torch.zeros_like(rho), rho)
    if per_sequence and level == "token":
        log_w = masked(torch.log(weight), mask)
        seq_weight = torch.exp(seq_sum(log_w, mask) / seq_count(mask, weight.dtype).clamp_min(1))
        weight = seq_weight[:, None].expand(mask.shape)
    return RolloutWeights(masked(weight, mask), outside & mask)
