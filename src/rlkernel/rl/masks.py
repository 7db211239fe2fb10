"""Token masks on the policy term: TRL's off-policy sequence mask and top-entropy-quantile mask.

Both give a detached 0/1 weight per token that multiplies the *policy term* only (before the
rollout weight and the KL term are applied, as TRL multiplies ``per_token_loss``); the mask of the
aggregation is unchanged, so the dropped tokens still count in the normalizers (TRL semantics; verl's
rollout rejection, :mod:`rlkernel.rl.rollout`, removes tokens from the mask instead).

Off-policy sequence mask (OPSM, DeepSeek-V3.2 eq. 9; TRL ``GRPOConfig.off_policy_mask_threshold``):

    D_i = Σ_t m_t (ŝ_t − sg[logp_t]) / max(n_i, 1)      mean k1 of the sampling policy vs the current
    o_t = 1[A_t ≥ 0  or  D_i ≤ δ]

with ŝ = ``rollout_logp`` when given, else ``old_logp`` (else, on-policy, sg[logp]: D_i = 0), as TRL
reads ``sampling_per_token_logps`` or falls back to the old log-probs; δ =
``cfg.off_policy_mask_threshold``; A_t the token's advantage (a per-sequence advantage on every
token). Only sequences with a negative advantage *and* a large drift lose their policy term.

Top-entropy quantile (Beyond the 80/20 Rule; TRL ``GRPOConfig.top_entropy_quantile`` = ρ):

    τ   = quantile_{1−ρ}({H_t : m_t})            linear interpolation, as ``torch.quantile``
    e_t = 1[H_t ≥ τ]                             ties at τ are all kept

over the active tokens of this call. ρ = 1 is off; ρ = 0 keeps only the tokens of the largest
entropy. The entropy bonus acts on the same tokens: −entropy_coef·agg(e·H) (TRL's bonus is the mean
entropy over e·m: see the caveats).

Caveats:
    * TRL computes the entropy quantile over the tokens of all data-parallel ranks (a gather);
      here it is over the tokens of the call (the micro-batch on this rank; with a context-parallel
      group, of the unsplit micro-batch: every rank of the group).
    * TRL replaces a NaN in ŝ − logp by 0 (a token vLLM could not score is no evidence); here a
      NaN or ±inf in ŝ or logp at an active token makes that sequence's weight NaN (a NaN loss),
      and a NaN entropy at an active token makes every weight NaN, rather than being hidden.
    * TRL's entropy bonus is Σ e·m·H / Σ e·m whatever the loss's normalization; here the bonus is
      aggregated like the loss, agg(e·H), with the loss's normalizers.
"""

from __future__ import annotations

import math

import torch

from rlkernel.rl.aggregate import masked, seq_count, seq_sum


@torch.no_grad()
def off_policy_weight(
    logp: torch.Tensor,
    sampling_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
    cp=None,
) -> torch.Tensor:
    """``[S, L]`` OPSM weight o_t (1, 0, or NaN for a sequence whose D_i is NaN).

    Args:
        logp: ``[S, L]`` current log-probs (read detached).
        sampling_logp: ``[S, L]`` the sampling policy's log-probs ŝ (see the module docstring).
        adv: ``[S, L]`` per-token advantages.
        mask: ``[S, L]`` bool, active tokens.
        threshold: δ.
        cp: context parallelism: D_i over every rank's slice of the sequence.
    """
    drift = seq_sum(masked(sampling_logp - logp.detach(), mask), mask, cp)
    drift = drift / seq_count(mask, drift.dtype, cp).clamp_min(1)
    keep = (adv >= 0) | (drift <= threshold)[:, None]
    weight = keep.to(drift.dtype)
    return torch.where(drift.isnan()[:, None] & mask, math.nan, weight)


@torch.no_grad()
def quantile_threshold(values: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """0-dim: ``torch.quantile(values[mask], q)`` (linear interpolation) without a host sync.

    The active values are sorted first (inactive ones become +inf, after them), and the rank
    q·(n − 1) is read from the sorted values on the device, with the operations of
    ``torch.quantile`` (so the threshold has its bits). NaN among the active values gives NaN
    (as ``torch.quantile``); no active value gives +inf (nothing passes ``≥``). Unlike
    ``torch.quantile`` there is no 2**24-element limit.
    """
    dtype = values.dtype
    flat = torch.where(mask, values, math.inf).reshape(-1)
    if flat.numel() == 0:
        return torch.full((), math.inf, dtype=dtype, device=values.device)
    ordered = torch.sort(flat).values
    n = mask.sum()
    ranks = (torch.tensor(q, dtype=dtype, device=values.device) * (n - 1).to(dtype)).clamp_min(0)
    below = ranks.to(torch.int64)
    above = ranks.ceil().to(torch.int64)
    threshold = torch.lerp(ordered[below], ordered[above], ranks - below.to(dtype))
    threshold = torch.where(n > 0, threshold, math.inf)  # (lerp(inf, inf, 0) would be NaN)
    has_nan = (values.isnan() & mask).any()
    return torch.where(has_nan, math.nan, threshold)


@torch.no_grad()
def entropy_weight(entropy: torch.Tensor, mask: torch.Tensor, quantile: float, cp=None) -> torch.Tensor:
    """``[S, L]`` top-entropy-quantile weight e_t: 1 where H_t ≥ the (1 − ``quantile``)-quantile of
    the active entropies, else 0; NaN everywhere active when an active entropy is NaN. ``cp``
    (context parallelism): the quantile of the unsplit batch's active entropies (every rank's
    values gathered into the unsplit layout: the same threshold, bit for bit)."""
    h = entropy.detach()
    if cp is None:
        threshold = quantile_threshold(h, mask, 1.0 - quantile)
    else:
        threshold = quantile_threshold(cp.to_global(h), cp.to_global(mask, False), 1.0 - quantile)
    keep = (h >= threshold) & mask
    weight = keep.to(h.dtype)
    return torch.where(threshold.isnan() & mask, math.nan, weight)
