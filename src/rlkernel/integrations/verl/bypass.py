"""verl's ``bypass_mode`` policy loss by rlkernel's algebra: the row ``rk_bypass_mode``.

In bypass mode (verl 0.9.1, ``RolloutCorrectionConfig.bypass_mode=True``) verl's trainer skips the
old-policy forward pass and passes the rollout engine's log-probs as ``old_log_prob``; its loss
``core_algos.compute_policy_loss_bypass_mode`` reads ``config.policy_loss.rollout_correction`` and,
with π = ``log_prob`` (current), μ = ``old_log_prob`` (rollout), m = ``response_mask``:

    rejection   m' = m ∧ keep_c for every criterion c of ``rollout_rs`` (comma-separated, all must
                pass), each computed from sg[π] against μ (``rollout_rs_threshold``: one entry per
                criterion or one for all; k1: ``"lower_upper"`` ratio bounds, one number u meaning
                [1/u, u]; k2/k3: an upper bound)
    IS weights  ``rollout_is`` token | sequence (None: none): ρ = sg[π]/μ per token or the product
                over the sequence; ``rollout_is_threshold`` u: TIS w = min(ρ, u); ``"l_u"``:
                IcePop w = ρ·1[l ≤ ρ ≤ u]; over m (before the rejection);
                ``rollout_is_batch_normalize``: w / mean(w) (all ranks' mean when
                ``torch.distributed`` is initialized, as verl's)
    ppo_clip    verl's vanilla loss with ratio π/μ over m' — dual clip ``clip_ratio_c`` included,
                NO IS weights (the ratio is the correction); metrics: vanilla's over m'
    reinforce   −A·log π·w over m' (w = 1 without IS weights); metric ``actor/ppo_kl`` over m'

then ``rollout_corr/*`` metrics of all that (:mod:`.rollout_metrics`). Here: rejection by
:func:`rlkernel.rl.rollout.rejection` per criterion (verl's statistics, bit for bit), weights by
:func:`rlkernel.rl.rollout.rollout_weights` (``token_tis``/``seq_tis`` with max u, or
``token_mis``/``seq_mis`` with [l, u]) and :func:`rlkernel.rl.rollout.batch_normalized`, and the
loss by :func:`rlkernel.policy_loss` (``loss_type="ppo"`` with ``old_logp`` = μ and the vanilla
row's settings, or ``loss_type="reinforce"`` on-policy, ``old_logp=None``) on the mask m' with
``rollout_weights=w``; aggregation and ``global_batch_info`` as every mode (the probed convention).

Caveats:
    * verl raises ``ValueError`` for a micro-batch without an active token (its helper needs one);
      so does ``rk_bypass_mode``.
    * A NaN or ±inf log-prob at an active token gives a NaN loss (rlkernel's rule) where verl's
      comparisons would reject the token (rejection) or drop its weight (IcePop).
    * ``rollout_is_weights`` is checked like every mode's (shape, dtype) and then ignored, as verl
      ignores it.
    * Weights below e^−20 (log ρ < −20): verl clamps log ρ to ±20 first; rlkernel's weight is the
      exact ρ (a difference below 2.1e-9 per weight).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch

from rlkernel.integrations.verl import losses, metrics, rollout_metrics
from rlkernel.integrations.verl.losses import Batch, Convention, GlobalBatchInfo, LossMode, setting
from rlkernel.integrations.verl.rollout_metrics import Criterion
from rlkernel.rl import policy_loss, rollout
from rlkernel.rl.aggregate import finite_or_nan
from rlkernel.rl.config import ROLLOUT_REJECTIONS

SETTINGS = "policy_loss.rollout_correction"
LOSS_TYPES = ("ppo_clip", "reinforce")
IS_LEVELS = ("token", "sequence")


def _number(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{SETTINGS}.{name}: {text!r} is not a number") from None
    if math.isnan(value):
        raise ValueError(f"{SETTINGS}.{name}: got NaN")
    return value


def _spec_text(name: str, spec: object) -> str:
    """A threshold setting (a number or a string) as verl reads it: its string form."""
    if isinstance(spec, bool) or not isinstance(spec, (numbers.Real, str)):
        raise TypeError(f"{SETTINGS}.{name} must be a number or a string, got {type(spec).__name__} {spec!r}")
    return spec.strip() if isinstance(spec, str) else str(float(spec))


def parse_is_threshold(spec: object) -> tuple[float, float | None]:
    """``rollout_is_threshold`` → (upper, lower): a number u (TIS, lower None) or ``"l_u"`` (IcePop);
    0 < l ≤ u (verl's rules). ValueError / TypeError naming the setting."""
    text = _spec_text("rollout_is_threshold", spec)
    if not text:
        raise ValueError(f"{SETTINGS}.rollout_is_threshold must not be an empty string")
    lower, sep, upper_text = text.partition("_") if "_" in text else (None, "", text)
    upper = _number("rollout_is_threshold", upper_text)
    lower = None if lower is None else _number("rollout_is_threshold", lower)
    if upper <= 0 or (lower is not None and (lower <= 0 or lower > upper)):
        raise ValueError(
            f"{SETTINGS}.rollout_is_threshold must be an upper bound > 0 or 'lower_upper' with "
            f"0 < lower <= upper, got {spec!r}"
        )
    return upper, lower


def parse_rejection(rollout_rs: object, spec: object) -> tuple[Criterion, ...]:
    """``rollout_rs`` (comma-separated criteria, duplicates dropped) with ``rollout_rs_threshold``
    (one entry per criterion, or one for all) → the criteria with their bounds (verl's rules)."""
    if not isinstance(rollout_rs, str):
        raise TypeError(f"{SETTINGS}.rollout_rs must be a string or None, got {type(rollout_rs).__name__}")
    names = list(dict.fromkeys(part.strip() for part in rollout_rs.split(",") if part.strip()))
    unknown = [n for n in names if n not in ROLLOUT_REJECTIONS]
    if not names or unknown:
        raise ValueError(
            f"{SETTINGS}.rollout_rs must name criteria among {ROLLOUT_REJECTIONS} (comma-separated), "
            f"got {rollout_rs!r}"
        )
    if spec is None:
        raise ValueError(f"{SETTINGS}.rollout_rs_threshold is required with rollout_rs={rollout_rs!r}")
    if isinstance(spec, str):
        entries = [part.strip() for part in spec.split(",") if part.strip()]
    else:
        entries = [_spec_text("rollout_rs_threshold", spec)]
    if len(entries) not in (1, len(names)):
        raise ValueError(
            f"{SETTINGS}.rollout_rs_threshold needs one entry or one per criterion ({len(names)} for "
            f"{names}), got {spec!r}"
        )
    entries = entries * len(names) if len(entries) == 1 else entries
    criteria = []
    for name, entry in zip(names, entries, strict=True):
        lower_text, _, upper_text = entry.partition("_") if "_" in entry else (None, "", entry)
        upper = _number("rollout_rs_threshold", upper_text)
        if not name.endswith("k1"):
            if lower_text is not None:
                raise ValueError(
                    f"{SETTINGS}.rollout_rs_threshold for {name!r} is an upper bound only, got {entry!r}"
                )
            lower = None
        else:  # a ratio window; one number u means [1/u, u]
            lower = 1.0 / upper if lower_text is None else _number("rollout_rs_threshold", lower_text)
        if upper <= 0 or (lower is not None and (lower <= 0 or lower > upper)):
            raise ValueError(
                f"{SETTINGS}.rollout_rs_threshold for {name!r} must be > 0 (k1: 0 < lower <= upper), got "
                f"{entry!r}"
            )
        criteria.append(Criterion(name, lower, upper))
    return tuple(criteria)


@dataclass(frozen=True)
class BypassSettings:
    """``config.policy_loss.rollout_correction`` of verl's actor config, validated.

    Attributes:
        loss_type: ``"ppo_clip"`` or ``"reinforce"``.
        rollout_is: ``"token"``, ``"sequence"`` or None (no IS weights: also when the threshold is
            None, as verl).
        is_upper, is_lower: the IS thresholds (``is_lower`` None: TIS; else IcePop).
        batch_normalize: verl's ``rollout_is_batch_normalize``.
        criteria: the rejection criteria (empty: none).
    """

    loss_type: str
    rollout_is: str | None
    is_upper: float | None
    is_lower: float | None
    batch_normalize: bool
    criteria: tuple[Criterion, ...]

    @classmethod
    def of(cls, config: Any) -> BypassSettings:
        corr = setting(setting(config, "policy_loss", None), "rollout_correction")
        if corr is None:
            raise ValueError(
                f"rk_bypass_mode needs the actor config's {SETTINGS} (verl's trainer sets it in bypass "
                "mode), got none"
            )
        loss_type = setting(corr, "loss_type", "ppo_clip")
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"{SETTINGS}.loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
        level = setting(corr, "rollout_is", None)
        if level is not None and level not in IS_LEVELS:
            raise ValueError(f"{SETTINGS}.rollout_is must be one of {IS_LEVELS} or None, got {level!r}")
        threshold = setting(corr, "rollout_is_threshold", 2.0)
        upper = lower = None
        if level is not None and threshold is not None:
            upper, lower = parse_is_threshold(threshold)
        else:
            level = None
        normalize = setting(corr, "rollout_is_batch_normalize", False)
        if not isinstance(normalize, bool):
            raise TypeError(f"{SETTINGS}.rollout_is_batch_normalize must be a bool, got {normalize!r}")
        rs = setting(corr, "rollout_rs", None)
        criteria = () if rs is None else parse_rejection(rs, setting(corr, "rollout_rs_threshold", None))
        return cls(loss_type, level, upper, lower, normalize, criteria)


# The loss of each loss_type: verl's vanilla (ppo) and the plain policy gradient (gpg's row), under
# bypass_mode's name (so that a rejected setting's message names rk_bypass_mode).
_ROWS = {
    "ppo_clip": dataclasses.replace(
        next(r for r in losses.LOSS_MODES if r.verl_name == "vanilla"), verl_name="bypass_mode"
    ),
    "reinforce": dataclasses.replace(
        next(r for r in losses.LOSS_MODES if r.verl_name == "gpg"), verl_name="bypass_mode"
    ),
}


def _weights(s: BypassSettings, current, roll, mask) -> tuple[torch.Tensor | None, torch.Tensor | None, Any]:
    """(the weights before and after batch normalization, the factor as a float or None)."""
    if s.rollout_is is None:
        return None, None, None
    level = "token" if s.rollout_is == "token" else "seq"
    mode = f"{level}_{'tis' if s.is_lower is None else 'mis'}"
    upper = None if math.isinf(s.is_upper) else s.is_upper
    raw = rollout.rollout_weights(current, roll, mask, mode, s.is_lower, upper).weight
    if not s.batch_normalize:
        return raw, raw, None
    total, count = rollout.batch_mean_terms(raw, mask, level)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # verl's distributed_masked_mean: the sum and the count over every rank (the default group).
        torch.distributed.all_reduce(total)
        torch.distributed.all_reduce(count)
    weights, factor = rollout.batch_normalized(raw, total, count)
    return raw, weights, factor.item()


def _rejection(s: BypassSettings, current, roll, mask) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(m', the NaN marker of statistics that are NaN, or None without rejection)."""
    keep, marker = mask, None
    for c in s.criteria:
        low = c.lower if c.name.endswith("k1") else None
        r = rollout.rejection(current, roll, mask, c.name, low, c.upper)
        keep = keep & r.keep
        marker = r.weight if marker is None else marker * r.weight
    return keep, marker


def compute(
    mode: LossMode, convention: Convention, loss_agg_mode: str, config: Any, batch: Batch
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``(pg_loss, pg_metrics)`` of ``bypass_mode`` (module docstring), by rlkernel.

    Raises:
        ValueError, TypeError: a bad ``rollout_correction`` setting, an all-masked micro-batch (as
            verl), or what the mapped ``PolicyLossConfig`` rejects.
    """
    s = BypassSettings.of(config)
    mask = batch.mask
    if not bool(mask.any()):
        raise ValueError(
            "rk_bypass_mode: response_mask has no active token; verl's bypass_mode raises for it too "
            "(its rollout-correction helper needs one)"
        )
    dtype = torch.float64 if batch.log_prob.dtype == torch.float64 else torch.float32
    current = finite_or_nan(batch.log_prob.detach().to(dtype))
    roll = finite_or_nan(batch.old_log_prob.detach().to(dtype))
    raw, weights, factor = _weights(s, current, roll, mask)
    keep, marker = _rejection(s, current, roll, mask)
    ppo = s.loss_type == "ppo_clip"
    applied = weights if not ppo else None  # ppo_clip: the ratio π/μ is the correction
    if marker is not None:
        applied = marker if applied is None else applied * marker
    info = GlobalBatchInfo.of(config, batch.log_prob.device)
    norm = convention.normalizers(loss_agg_mode, info, batch.log_prob.shape[0])
    row = _ROWS[s.loss_type]
    fields = tuple(sorted(row.fields(config).items()))
    cfg = losses.loss_config(row, norm.aggregation, norm.norm_length, fields)
    out = policy_loss(
        batch.log_prob,
        batch.old_log_prob if ppo else None,
        batch.advantages,
        keep,
        cfg,
        global_tokens=norm.global_tokens,
        global_seqs=norm.global_seqs,
        rollout_weights=applied,
    )
    loss = out.loss if norm.scale == 1 else out.loss * norm.scale
    inputs = metrics.MetricInputs(roll, current, batch.advantages.detach(), keep, cfg)
    pg = metrics.vanilla(inputs) if ppo else {"actor/ppo_kl": inputs.mean(roll - current)}
    log_ratio = current - roll
    corr: dict[str, float] = {}
    if raw is not None:
        corr.update(
            rollout_metrics.importance_weight_metrics(
                log_ratio, mask, raw, s.rollout_is, s.is_upper, s.is_lower, factor
            )
        )
    if s.criteria:
        corr.update(rollout_metrics.rejection_metrics(s.criteria, log_ratio, mask))
    corr.update(rollout_metrics.off_policy_metrics(current, roll, mask))
    return loss, {**pg, **rollout_metrics.prefixed(corr)}


BYPASS_MODE = LossMode("bypass_mode", "ppo | reinforce", run=compute)
