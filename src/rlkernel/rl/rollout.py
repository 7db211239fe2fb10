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

Batch normalization (``cfg.rollout_batch_normalize``, verl's ``rollout_is_batch_normalize``): the
weights are then divided by their mean over the call,

    w̄ = Σ_t m_t w_t / Σ_t m_t                 token level (over the active tokens)
    w̄ = Σ_i w_i / #{i : n_i > 0}              sequence level (over the sequences with an active token)
    w ← w / w̄   where w̄ > 1e-8, else w unchanged (verl's guard)

after the truncation or rejection and before anything folds them (gmpo, vespo). The mean is over
this call only: verl all-reduces Σ and the count over its ranks when ``torch.distributed`` is
initialized; :func:`batch_mean_terms` and :func:`batch_normalized` let a caller do the same
(``rlkernel.integrations.verl`` does).

For ``gmpo``, whose loss is one value per sequence, token-level weights are folded into one weight per
sequence by their geometric mean exp(Σ_t m log w_t / n_i), as verl's ``geo_mean`` loss does.

Rejection sampling (``cfg.rollout_rs``, verl's ``rollout_rs``): tokens or whole sequences whose
divergence between the trainer's and the rollout engine's policy is out of bounds *leave the mask*
(the policy term, the KL and entropy terms and the local normalizers all drop them), as verl's
``compute_rollout_rejection_mask`` does to ``response_mask``. With lr_t = clamp(old_logp_t −
rollout_logp_t, ±20) (= log ρ_t, clamped as verl does):

    k1_t = −lr_t = log(π_rollout / π_old)     k2_t = lr_t² / 2     k3_t = exp(lr_t) − 1 − lr_t

    token_kX      D_t = kX_t                            (the token alone)
    seq_sum_kX    D_t = Σ_u m_u kX_u                     (every token of the sequence)
    seq_mean_kX   D_t = Σ_u m_u kX_u / n_i
    seq_max_kX    D_t = max_{u: m_u} kX_u               (k2, k3 only)

    k1:     keep ⇔ log(rollout_rs_min) ≤ D_t ≤ log(rollout_rs_max)   (a missing bound: no test)
    k2, k3: keep ⇔ D_t ≤ rollout_rs_max

The rejected tokens leave the mask m; what remains, m' = m ∧ keep, is the loss's mask: it decides
the policy term's sequence quantities (gspo's sequence ratio, per-sequence advantage means), the
aggregation's local counts (Σ m', the sequences with an active token in m') and the metrics. Global
normalizers must count m' too: :func:`rejection_mask` gives it for ``global_normalizers``. The
correction weights (``cfg.rollout_correction``) are computed over the *given* mask m, as verl
computes its IS weights before it applies the rejection (matters for ``seq_*`` weights only).

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
    * Rejection: verl's rejection accepts several comma-separated criteria (all must pass); here
      one criterion per config. verl's ``seq_mean`` divides by n_i + 1e-8 (the same in float32).
      A NaN statistic (NaN or ±inf in ``old_logp``/``rollout_logp`` at an active token of the
      token, or of the sequence for ``seq_*``) keeps the token in the mask with a NaN weight,
      so the loss is NaN; verl's comparisons would reject it silently.
    * Batch normalization: verl's local mean divides by Σ m + 1e-8 (token level); here by Σ m (a
      relative 1e-8 / Σ m). A NaN weight makes w̄ NaN, and then the weights are left as they are
      (NaN among them: the loss is NaN).
    * NaN in ``rollout_logp`` (or ``old_logp``) at an active token gives a NaN weight (never silently
      truncated or rejected). Its callers (``policy_loss``, the fused plan) turn ±inf log-probs
      into NaN first, so those give a NaN weight too rather than a weight of 0 or ``max``. A ρ that
      overflows to inf from *finite* log-probs is truncated or rejected as any large ρ is.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from rlkernel import _validate as check
from rlkernel.rl.aggregate import finite_or_nan, masked, seq_any, seq_count, seq_mean, seq_sum
from rlkernel.rl.batch import segments_for, validate_batch
from rlkernel.rl.config import PolicyLossConfig

REJECTION_LOG_RATIO_BOUND = 20.0  # verl's SAFETY_BOUND on log ρ before the divergences
BATCH_NORM_FLOOR = 1e-8  # verl: weights whose batch mean is at most this are not normalized


@dataclass(frozen=True)
class RolloutWeights:
    """Detached correction weights and what they did.

    Attributes:
        weight: ``[S, L]`` weights to multiply into the per-token policy loss (sequence weights
            broadcast over the sequence); finite garbage-free values at masked positions.
        changed: ``[S, L]`` bool: ρ was truncated (TIS) or rejected (MIS) at this token (for a
            sequence-level mode: for this token's sequence).
        norm_factor: 0-dim, the batch mean w̄ the weights were divided by (1 where they were not:
            w̄ ≤ 1e-8 or NaN), or ``None`` without batch normalization.
    """

    weight: torch.Tensor
    changed: torch.Tensor
    norm_factor: torch.Tensor | None = None


def _log_rho(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str, cp=None
) -> torch.Tensor:
    if level == "seq":
        return seq_sum(old_logp - rollout_logp, mask, cp)[:, None].expand(mask.shape)
    return masked(old_logp - rollout_logp, mask)


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
    fold_mask: torch.Tensor | None = None,
    batch_normalize: bool = False,
    cp=None,
) -> RolloutWeights:
    """Correction weights for ``mode`` in ``token_tis | seq_tis | token_mis | seq_mis``.

    Args:
        old_logp, rollout_logp: ``[S, L]`` float (0 at masked positions is fine; they are masked).
        mask: ``[S, L]`` bool, active tokens.
        mode: the correction (see the module docstring).
        clip_min, clip_max: the bounds (``None``: unbounded on that side).
        per_sequence: fold token weights into one geometric-mean weight per sequence (gmpo).
        fold_mask: the tokens that fold (the loss's mask after rejection); ``mask`` when None.
        batch_normalize: divide the weights by their mean over ``mask`` first (see the module
            docstring).
        cp: context parallelism (:mod:`rlkernel.rl.context_parallel`): the tensors are this
            rank's slice of every sequence; sequence products, the batch mean and the folding span
            every rank of the group.

    Returns:
        :class:`RolloutWeights`, detached.
    """
    level, kind = mode.split("_")
    rho = torch.exp(_log_rho(old_logp, rollout_logp, mask, level, cp))
    outside = _outside(rho, clip_min, clip_max)
    if kind == "tis":
        weight = rho.clamp(min=clip_min, max=clip_max)
    else:
        weight = torch.where(outside, torch.zeros_like(rho), rho)
    factor = None
    if batch_normalize:
        weight = masked(weight, mask)
        weight, factor = batch_normalized(weight, *batch_mean_terms(weight, mask, level, cp))
    if per_sequence and level == "token":
        weight = fold_per_sequence(weight, mask if fold_mask is None else fold_mask, cp)
    return RolloutWeights(masked(weight, mask), outside & mask, factor)


@torch.no_grad()
def batch_mean_terms(
    weight: torch.Tensor, mask: torch.Tensor, level: str, cp=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(total, count)``, 0-dim, whose ratio is the batch mean w̄ of the weights (module docstring).

    Args:
        weight: ``[S, L]`` float weights (sequence level: one value repeated over each sequence's
            active tokens); any value at masked positions.
        mask: ``[S, L]`` bool, the active tokens.
        level: ``"token"`` (Σ_t m_t w_t, Σ_t m_t) or ``"seq"`` (Σ_i w_i, #sequences with an active
            token).
        cp: context parallelism: the terms of the unsplit batch (every rank's slice).

    A caller that normalizes over several (data-parallel) ranks all-reduces both (a sum) before
    :func:`batch_normalized`.
    """
    if level == "seq":  # w_i from the sequence's reduced sums: the same on every rank of cp
        has = seq_any(mask, cp)
        return torch.where(has, seq_mean(weight, mask, cp), 0.0).sum(), has.sum().to(weight.dtype)
    total, count = masked(weight, mask).sum(), mask.sum()
    if cp is not None:
        total, count = cp.sum(total), cp.sum(count)
    return total, count.to(weight.dtype)


@torch.no_grad()
def batch_normalized(
    weight: torch.Tensor, total: torch.Tensor, count: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight / w̄, w̄)`` with w̄ = total / count, or ``(weight, 1)`` where w̄ ≤ 1e-8 or is NaN
    (verl's guard; no host sync). ``count`` 0 (no active token) gives w̄ = 0: unchanged."""
    mean = total / count.clamp_min(1)
    normalize = mean > BATCH_NORM_FLOOR
    return torch.where(normalize, weight / mean, weight), torch.where(normalize, mean, 1.0)


@torch.no_grad()
def fold_per_sequence(weight: torch.Tensor, mask: torch.Tensor, cp=None) -> torch.Tensor:
    """``[S, L]`` token weights → their geometric mean exp(Σ_t m log w_t / n_i) on every position of
    the sequence (verl ``geo_mean``'s folding of token IS weights for a per-sequence loss); ``cp``:
    over every rank's slice of the sequence."""
    log_w = masked(torch.log(weight), mask)
    seq_weight = torch.exp(seq_sum(log_w, mask, cp) / seq_count(mask, weight.dtype, cp).clamp_min(1))
    return seq_weight[:, None].expand(mask.shape)


@dataclass(frozen=True)
class Rejection:
    """What rollout rejection does to one batch (all ``[S, L]``).

    Attributes:
        keep: bool, the tokens that stay: active and not rejected (the loss's mask m').
        rejected: bool, the active tokens that were rejected.
        weight: float, 1 everywhere except NaN at active tokens whose statistic is NaN (they stay
            in ``keep``: multiplied into the policy term, the NaN reaches the loss).
    """

    keep: torch.Tensor
    rejected: torch.Tensor
    weight: torch.Tensor


def _divergence(log_rho: torch.Tensor, estimator: str) -> torch.Tensor:
    lr = log_rho.clamp(-REJECTION_LOG_RATIO_BOUND, REJECTION_LOG_RATIO_BOUND)
    if estimator == "k1":
        return -lr
    if estimator == "k2":
        return 0.5 * lr * lr
    return torch.exp(lr) - 1.0 - lr  # k3, verl's spelling (not expm1: same rounding as verl)


def _statistic(divergence: torch.Tensor, mask: torch.Tensor, level: str, cp=None) -> torch.Tensor:
    """``[S, L]``: the divergence itself (token level) or its sequence sum / mean / max broadcast
    (``cp``: over every rank's slice of the sequence)."""
    if level == "token":
        return divergence
    if level == "seq_sum":
        per_seq = seq_sum(divergence, mask, cp)
    elif level == "seq_mean":
        per_seq = seq_sum(divergence, mask, cp) / seq_count(mask, divergence.dtype, cp).clamp_min(1)
    else:  # seq_max; 0 for a sequence without active tokens (as verl); NaN propagates
        if mask.shape[-1] == 0:  # empty rows (amax needs a non-empty dimension)
            per_seq = divergence.new_full(mask.shape[:-1], -math.inf)
        else:
            per_seq = torch.where(mask, divergence, -math.inf).amax(-1)
        if cp is not None:
            per_seq = cp.max(per_seq)
        per_seq = torch.where(seq_any(mask, cp), per_seq, 0.0)
    return per_seq[:, None].expand(mask.shape)


@torch.no_grad()
def rejection(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    criterion: str,
    low: float | None,
    high: float | None,
    cp=None,
) -> Rejection:
    """verl's rollout rejection (see the module docstring) on the padded layout.

    Args:
        old_logp, rollout_logp: ``[S, L]`` float (any value at masked positions; ±inf at active
            ones must already be NaN, as ``policy_loss`` and the plan make them).
        mask: ``[S, L]`` bool, the active tokens.
        criterion: one of ``rlkernel.rl.config.ROLLOUT_REJECTIONS``.
        low, high: ``cfg.rollout_rs_min`` / ``cfg.rollout_rs_max`` (ratio bounds for k1, an upper
            divergence bound for k2/k3).
        cp: context parallelism: the sequence statistics span every rank's slice.

    Returns:
        :class:`Rejection`, detached.
    """
    level, estimator = criterion.rsplit("_", 1)
    stat = _statistic(_divergence(masked(old_logp - rollout_logp, mask), estimator), mask, level, cp)
    inside = torch.ones_like(mask)
    if estimator == "k1":
        if low is not None:
            inside = inside & (stat >= math.log(low))
        if high is not None:
            inside = inside & (stat <= math.log(high))
    else:
        inside = stat <= high
    invalid = stat.isnan() & mask
    rejected = mask & ~inside & ~invalid
    weight = torch.where(invalid, math.nan, torch.ones_like(stat))
    return Rejection(keep=mask & ~rejected, rejected=rejected, weight=weight)


def rejection_mask(
    cfg: PolicyLossConfig,
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    cp_group: object | None = None,
    cp_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """The mask that remains after ``cfg``'s rollout rejection: bool, the shape of ``mask``.

    The tokens a loss with ``cfg.rollout_rs`` keeps; pass it to ``rlkernel.global_normalizers``
    so that the step's normalizers count what the loss counts (verl computes its global token
    counts from the rejected mask). Without ``cfg.rollout_rs`` it is ``mask != 0``.

    Args:
        cfg: a ``PolicyLossConfig``.
        old_logp, rollout_logp: float, the shape of ``mask`` (``[B, T]``, or packed ``[N]`` with
            ``cu_seqlens``): the log-probs the loss will be given (on-policy calls: the current
            log-probs, detached).
        mask: bool/int/float, active where ``!= 0``.
        cu_seqlens: int ``[S + 1]`` for packed input.
        cp_group, cp_positions: context parallelism, as in ``policy_loss`` (the tensors are this
            rank's slice of every sequence; a sequence criterion reads the whole sequence). A
            collective with the cross-rank checks of ``policy_loss``.

    Raises:
        TypeError / ValueError: as ``policy_loss`` for the same tensors (under ``cp_group`` on
            every rank alike).
    """
    if not isinstance(cfg, PolicyLossConfig):
        raise TypeError(f"cfg must be a PolicyLossConfig, got {type(cfg).__name__}")
    cp = None
    if cp_group is not None:
        # The loss's own cross-rank check, on these tensors (the KL and advantages play no part).
        cp = validate_batch(
            dataclasses.replace(cfg, kl_coef=0.0), old_logp, old_logp=old_logp,
            advantages=torch.zeros_like(old_logp) if isinstance(old_logp, torch.Tensor) else None,
            mask=mask, rollout_logp=rollout_logp, cu_seqlens=cu_seqlens, like_name="old_logp",
            cp_group=cp_group, cp_positions=cp_positions,
        ).cp  # fmt: skip
    elif cp_positions is not None:
        raise ValueError("cp_positions applies with cp_group only (a context-parallel slice's positions)")
    mask = check.mask_tensor("mask", mask)
    check.float_like("old_logp", old_logp, "mask", mask)
    check.float_like("rollout_logp", rollout_logp, "mask", mask)
    seg = segments_for(mask, cu_seqlens, name="mask")
    active = mask != 0
    if cfg.rollout_rs is None:
        return active
    act2 = seg.to_padded(active, fill=False)

    def padded(x: torch.Tensor) -> torch.Tensor:
        return finite_or_nan(seg.to_padded(x.detach().to(torch.promote_types(x.dtype, torch.float32))))

    bounds = (cfg.rollout_rs_min, cfg.rollout_rs_max)
    keep = rejection(padded(old_logp), padded(rollout_logp), act2, cfg.rollout_rs, *bounds, cp).keep
    if not seg.is_packed:
        return keep
    flat = torch.zeros(mask.shape[0] + 1, dtype=torch.bool, device=mask.device)
    flat[seg.gather_index.reshape(-1)] = keep.reshape(-1)  # padding slots all write the spare entry
    return flat[:-1] & active
