"""verl's ``rollout_corr/*`` metrics of ``bypass_mode``, by verl 0.9.1's definitions.

verl's bypass loss returns, after its policy loss's own metrics, what its rollout-correction helper
(``verl.trainer.ppo.rollout_corr_helper``) measures of the current policy (π, ``log_prob``) against
the rollout policy (μ, ``old_log_prob``) over the given response mask m (before rejection). With
lr = log π − log μ per token, L_i = Σ_t m·lr per sequence, ⟨x⟩ = Σ m·x / (Σ m + 1e-8) (verl's
``masked_mean``; per sequence ⟨x⟩_i), means over all B rows unless said otherwise:

    importance weights (rollout_is set; w the truncated / IcePop weights before batch normalization,
    raw = exp(clamp(lr, ±20))·m per token, exp(clamp(L_i, ±20))·m per sequence; u, l the bounds,
    l = 1/u for TIS):
      sequence  rollout_is_max exp(min(max_i L_i, 20)), _min exp(min_i L_i), _mean ⟨w⟩,
                _ratio_fraction_high / _low: mean_i [L_i > log u] / [L_i < log l]
      token     rollout_is_mean ⟨w⟩, _ratio_fraction_high ⟨raw > u⟩, _low ⟨raw < l⟩,
                _max / _min over the active w
      both      _std of clamp(w, 0, u) (0 with ≤ 1 active token), _eff_sample_size 1/⟨v²⟩ with
                v = clamp(w, 0, u) / (⟨clamp(w, 0, u)⟩ + 1e-8), _seq_mean / _seq_std (unbiased) /
                _seq_max / _seq_min of ⟨w⟩_i, _seq_max_deviation max |⟨w⟩_i − 1|,
                _seq_fraction_high / _low: mean_i [⟨raw⟩_i > u] / [⟨raw⟩_i < l];
                IcePop: rollout_is_oob_ratio ⟨raw ∉ [l, u]⟩; batch normalization:
                rollout_is_batch_norm_factor (the mean divided by, 1 when none)
    rejection (rollout_rs set), per criterion c (its statistic D, per token or per sequence;
    thresholds: log-ratio bounds for k1, [0, upper] for k2/k3):
      rollout_rs_c_mean ⟨D⟩, _max, _min (over sequences with a token for seq_*), _fraction_high,
      _fraction_low (k1 only, else 0), _std of D clamped to the thresholds, _seq_mean, _seq_std,
      _seq_max, _seq_min, _seq_max_deviation, _seq_fraction_high (_seq_fraction_low: k1) over the
      sequences with a token, _masked_fraction ⟨rejected⟩, _seq_masked_fraction; then
      rollout_rs_masked_fraction ⟨rejected by any⟩, rollout_rs_seq_masked_fraction (mean_i over all
      rows of "a token rejected")
    off-policy diagnostics (always): training_ppl mean_i exp(−⟨log π⟩_i), training_log_ppl,
      kl ⟨log μ − log π⟩, k3_kl ⟨e^lr − lr − 1⟩, rollout_ppl, rollout_log_ppl, log_ppl_diff (mean,
      _abs_diff, _max, _min of ⟨log μ⟩_i − ⟨log π⟩_i), ppl_ratio, chi2_token ⟨exp(clamp(lr, ±20))²⟩ − 1,
      chi2_seq mean_i exp(2·clamp(L_i, ±20)) − 1

Each key is prefixed ``rollout_corr/``; values are Python floats. The statistics are verl's own
formulas (its ``masked_mean``, its float32 log-thresholds), written here from them; the weights
``w`` and the rejection itself come from rlkernel (:mod:`rlkernel.rl.rollout`), which gives verl's
except where log ρ < −20 (a weight below e^−20 ≈ 2e-9 that verl rounds up to it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from verl.utils import torch_functional as verl_F

PREFIX = "rollout_corr/"
SAFETY_BOUND = 20.0  # verl's clamp on log-ratios before an exponential


@dataclass(frozen=True)
class Criterion:
    """One rejection criterion as verl parsed it: ``name`` (``token_k1`` …), ``lower`` / ``upper``
    (k1: ratio bounds; k2/k3: ``lower`` None, ``upper`` the divergence bound)."""

    name: str
    lower: float | None
    upper: float

    @property
    def level(self) -> str:
        return "token" if self.name.startswith("token") else "sequence"


def _item(x: torch.Tensor) -> float:
    return x.detach().item()


def _float32_log(value: float, device: torch.device) -> torch.Tensor:
    # verl compares with torch.log(torch.tensor(threshold)): a float32 logarithm.
    return torch.log(torch.tensor(value, device=device))


def importance_weight_metrics(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    level: str,
    upper: float,
    lower: float | None,
    norm_factor: float | None,
) -> dict[str, float]:
    """verl's ``compute_is_metrics`` (+ IcePop's ``oob_ratio`` and the batch-norm factor).

    Args:
        log_ratio: ``[B, T]`` log π − log μ (any value at masked positions).
        mask: ``[B, T]`` bool, the given response mask.
        weights: ``[B, T]`` the truncated (TIS) or zeroed (IcePop) weights, before batch
            normalization, 0 at masked positions.
        level: ``"token"`` or ``"sequence"``.
        upper, lower: the thresholds (``lower`` None: TIS, whose lower threshold for the metrics is
            1/upper).
        norm_factor: the batch-normalization factor, or None without batch normalization.
    """
    m = mask
    icepop = lower is not None
    low = lower if icepop else 1.0 / upper
    out: dict[str, float] = {}
    clamped = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if level == "sequence":
        log_seq = verl_F.masked_sum(log_ratio, m, axis=-1)
        raw = torch.exp(log_seq.clamp(-SAFETY_BOUND, SAFETY_BOUND))[:, None].expand_as(log_ratio) * m
        out["rollout_is_max"] = _item(torch.exp(log_seq.max().clamp(max=SAFETY_BOUND)))
        out["rollout_is_min"] = _item(torch.exp(log_seq.min()))
        out["rollout_is_mean"] = _item(verl_F.masked_mean(weights, m))
        out["rollout_is_ratio_fraction_high"] = _item(
            (log_seq > _float32_log(upper, m.device)).float().mean()
        )
        out["rollout_is_ratio_fraction_low"] = _item((log_seq < _float32_log(low, m.device)).float().mean())
    else:
        raw = torch.exp(clamped) * m
        out["rollout_is_mean"] = _item(verl_F.masked_mean(weights, m))
        out["rollout_is_ratio_fraction_high"] = _item(verl_F.masked_mean((raw > upper).float(), m))
        out["rollout_is_ratio_fraction_low"] = _item(verl_F.masked_mean((raw < low).float(), m))
        out["rollout_is_max"] = _item(weights.masked_fill(~m, -math.inf).max())
        out["rollout_is_min"] = _item(weights.masked_fill(~m, math.inf).min())
    bounded = weights.clamp(min=0.0, max=upper)
    mean_bounded = verl_F.masked_mean(bounded, m)
    if m.sum() > 1:
        variance = verl_F.masked_mean(bounded.square(), m) - mean_bounded.square()
        out["rollout_is_std"] = _item(variance.clamp(min=0.0).sqrt())
    else:
        out["rollout_is_std"] = 0.0
    normalized = bounded / (mean_bounded + 1e-8)
    out["rollout_is_eff_sample_size"] = 1.0 / _item(verl_F.masked_mean(normalized.square(), m))
    seq_mean = verl_F.masked_mean(weights, m, axis=-1)
    out["rollout_is_seq_mean"] = _item(seq_mean.mean())
    out["rollout_is_seq_std"] = _item(seq_mean.std()) if seq_mean.numel() > 1 else 0.0
    out["rollout_is_seq_max"] = _item(seq_mean.max())
    out["rollout_is_seq_min"] = _item(seq_mean.min())
    out["rollout_is_seq_max_deviation"] = _item((seq_mean - 1.0).abs().max())
    raw_seq_mean = verl_F.masked_mean(raw, m, axis=-1)
    out["rollout_is_seq_fraction_high"] = _item((raw_seq_mean > upper).float().mean())
    out["rollout_is_seq_fraction_low"] = _item((raw_seq_mean < low).float().mean())
    if icepop:
        outside = (raw < lower) | (raw > upper)
        out["rollout_is_oob_ratio"] = _item(verl_F.masked_mean(outside.float(), m))
    if norm_factor is not None:
        out["rollout_is_batch_norm_factor"] = norm_factor
    return out


def _token_divergence(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if estimator == "k1":
        return -lr
    if estimator == "k2":
        return 0.5 * lr**2
    return torch.exp(lr) - 1.0 - lr


def _sequence_statistic(divergence: torch.Tensor, mask: torch.Tensor, reduce: str) -> torch.Tensor:
    if reduce == "sum":
        return verl_F.masked_sum(divergence, mask, axis=-1)
    if reduce == "mean":
        return verl_F.masked_mean(divergence, mask, axis=-1)
    largest = divergence.masked_fill(~mask, -math.inf).max(dim=-1).values
    return torch.where(largest == -math.inf, torch.zeros_like(largest), largest)


def _criterion_metrics(
    c: Criterion, log_ratio: torch.Tensor, mask: torch.Tensor
) -> tuple[dict[str, float], torch.Tensor]:
    """One criterion's metrics (verl's ``compute_rs_metrics`` and masked fractions) and its keep."""
    m = mask
    estimator = c.name.rsplit("_", 1)[1]
    token_stat = _token_divergence(log_ratio, estimator)
    k1 = estimator == "k1"
    upper = math.log(c.upper) if k1 else c.upper
    lower = math.log(c.lower) if k1 else 0.0
    per_seq = None
    if c.level == "token":
        stat = token_stat
    else:
        per_seq = _sequence_statistic(token_stat, m, c.name.split("_")[1])
        stat = per_seq[:, None].expand_as(log_ratio)
    keep = (stat >= lower) & (stat <= upper) if k1 else stat <= upper
    valid = m.sum(-1) > 0
    seq_values = (per_seq if per_seq is not None else verl_F.masked_mean(stat, m, axis=-1))[valid]
    key = f"rollout_rs_{c.name}"
    out = {f"{key}_mean": _item(verl_F.masked_mean(stat, m))}
    by_sequence = c.level == "sequence" and seq_values.numel() > 0
    if by_sequence:
        out[f"{key}_max"], out[f"{key}_min"] = _item(seq_values.max()), _item(seq_values.min())
        out[f"{key}_fraction_high"] = _item((seq_values > upper).float().mean())
        out[f"{key}_fraction_low"] = _item((seq_values < lower).float().mean()) if k1 else 0.0
    else:
        out[f"{key}_max"] = _item(stat.masked_fill(~m, -math.inf).max())
        out[f"{key}_min"] = _item(stat.masked_fill(~m, math.inf).min())
        out[f"{key}_fraction_high"] = _item(verl_F.masked_mean((stat > upper).float(), m))
        out[f"{key}_fraction_low"] = _item(verl_F.masked_mean((stat < lower).float(), m)) if k1 else 0.0
    if m.sum() > 1:
        bounded = stat.clamp(min=lower, max=upper)
        mean_bounded = verl_F.masked_mean(bounded, m)
        variance = verl_F.masked_mean(bounded.square(), m) - mean_bounded.square()
        out[f"{key}_std"] = _item(variance.clamp(min=0.0).sqrt())
    else:
        out[f"{key}_std"] = 0.0
    # (verl reports zeros for these without a sequence with a token; bypass raises for that batch.)
    out[f"{key}_seq_mean"] = _item(seq_values.mean())
    out[f"{key}_seq_std"] = _item(seq_values.std()) if seq_values.numel() > 1 else 0.0
    out[f"{key}_seq_max"], out[f"{key}_seq_min"] = _item(seq_values.max()), _item(seq_values.min())
    out[f"{key}_seq_max_deviation"] = _item(seq_values.abs().max())
    out[f"{key}_seq_fraction_high"] = _item((seq_values > upper).float().mean())
    if k1:
        out[f"{key}_seq_fraction_low"] = _item((seq_values < lower).float().mean())
    dtype = log_ratio.dtype  # verl's keep masks are in the log-ratio's dtype
    out[f"{key}_masked_fraction"] = _item(verl_F.masked_mean((~keep).to(dtype), m))
    seq_kept = (keep | ~m).all(-1)
    out[f"{key}_seq_masked_fraction"] = _item((~seq_kept & valid).to(dtype).sum() / valid.float().sum())
    return out, keep


def rejection_metrics(
    criteria: tuple[Criterion, ...], log_ratio: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """verl's ``compute_rollout_rejection_mask`` metrics: each criterion's, then the combined ones."""
    out: dict[str, float] = {}
    keep = torch.ones_like(mask)
    for c in criteria:
        metrics, kept = _criterion_metrics(c, log_ratio, mask)
        out.update(metrics)
        keep = keep & kept
    out["rollout_rs_masked_fraction"] = _item(verl_F.masked_mean((~keep).to(log_ratio.dtype), mask))
    out["rollout_rs_seq_masked_fraction"] = _item((~keep & mask).any(-1).float().mean())
    return out


def off_policy_metrics(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor):
    """verl's ``compute_offpolicy_metrics`` (π = ``log_prob``, μ = ``rollout_log_prob``)."""
    m = mask
    mean_train = verl_F.masked_mean(log_prob, m, axis=-1)
    mean_rollout = verl_F.masked_mean(rollout_log_prob, m, axis=-1)
    log_ratio = log_prob - rollout_log_prob
    diff = mean_rollout - mean_train
    log_seq = verl_F.masked_sum(log_ratio, m, axis=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    return {
        "training_ppl": _item(torch.exp(-mean_train).mean()),
        "training_log_ppl": _item((-mean_train).mean()),
        "kl": _item(verl_F.masked_mean(rollout_log_prob - log_prob, m)),
        "k3_kl": _item(verl_F.masked_mean(torch.exp(log_ratio) - log_ratio - 1, m)),
        "rollout_ppl": _item(torch.exp(-mean_rollout).mean()),
        "rollout_log_ppl": _item((-mean_rollout).mean()),
        "log_ppl_diff": _item(diff.mean()),
        "log_ppl_abs_diff": _item(diff.abs().mean()),
        "log_ppl_diff_max": _item(diff.max()),
        "log_ppl_diff_min": _item(diff.min()),
        "ppl_ratio": _item(torch.exp(diff).mean()),
        "chi2_token": _item(verl_F.masked_mean(rho.square(), m) - 1.0),
        "chi2_seq": _item(torch.exp(2.0 * log_seq).mean() - 1.0),
    }


def prefixed(metrics: dict[str, float]) -> dict[str, float]:
    return {PREFIX + key: value for key, value in metrics.items()}
