"""TRL 1.16's ``GRPOConfig`` loss settings as a :class:`rlkernel.PolicyLossConfig` (and the version pin).

TRL's ``GRPOTrainer._compute_loss`` (trl/trainer/grpo_trainer.py, 1.16.0) computes, with
r = exp(logp − old_logp) per token (``importance_sampling_level="token"``) or
s_i = exp(Σ_t m·(logp − old_logp) / Σ_t m) per sequence (``"sequence"``), A the sequence's advantage:

    grpo, bnpo, dr_grpo, dapo, luspo   ℓ = −min(min(r, δ)·A, clip(r, 1 − ε, 1 + ε_high)·A)
    cispo                              ℓ = −sg[min(r, ε_high)]·A·logp
    sapo                               ℓ = −(4/τ)·σ(τ(r − 1))·A,  τ = τ_pos if A > 0 else τ_neg
    vespo                              ℓ = −sg[φ(w_i)]·A·logp,  φ(w) = e^λ·w^k·e^{−λw},
                                       w_i = exp(Σ_t m·(logp − old_logp)) (× the vLLM ratio, folded in)
    then                               ℓ ← ℓ·o_i (OPSM: 0 where A < 0 and mean(ŝ − logp) > δ)
                                       ℓ ← ℓ·e_t (top_entropy_quantile: 0 below the (1−ρ)-quantile of H)
                                       ℓ ← ℓ·w (vLLM importance weight; not vespo) + β·k3(logp, ref_logp)·c
    (c = r or s_i with ``use_bias_correction_kl``, not detached; else 1)

and aggregates ℓ over the completion mask m of a micro-batch of B sequences, in an accumulation window
of GA micro-batches (``current_gradient_accumulation_steps``; 1 in evaluation):

    grpo, sapo   Σ_i (Σ_t mℓ / max(n_i, 1)) / (B·GA)              seq-mean-token-mean, global_seqs = B·GA
    bnpo         Σ mℓ / (max(Σm, 1)·GA)                           token-mean, global_tokens = max(Σm, 1)·GA
    dr_grpo      Σ mℓ / (B·max_completion_length·GA)              seq-mean-token-sum-norm, global_seqs = B·GA
    luspo        Σ mℓ / (B·GA)                                    seq-mean-token-sum, global_seqs = B·GA
    dapo, cispo  Σ mℓ / (max(N, 1)/P · GA/steps_per_generation)   token-mean, global_tokens = that
                 (N = ``num_items_in_batch``, the generation batch's active tokens over all P
                 processes; in evaluation the divisor is max(N, 1)/P)

:func:`plan_from_trl` maps the settings onto a ``PolicyLossConfig`` plus the normalizer rule above;
:func:`policy_config_from_trl` returns the config alone. A setting whose loss rlkernel cannot
reproduce raises ``ValueError`` naming the ``GRPOConfig`` field (cispo / sapo with a sequence ratio,
vespo's KL weighted by a sequence ratio: rlkernel's ``seq_ratio`` applies to gspo and vespo only).

Caveats (where rlkernel's guards differ from TRL's unguarded formulas; see docs/integrations/trl.md):
    * rlkernel clamps the token log-ratio to ±20 before the exponential (ppo, cispo, sapo) and the
      sequence log-ratio of gspo from above at 10; TRL does not clamp.
    * TRL's β·k3 maps onto ``kl_estimator="k3_unclamped"`` (TRL's formula, no clamps), not onto
      rlkernel's default ``k3``, which clamps the exponent to ±20 and the value to ±10 (verl's guards)
      and would differ where ref_logp − logp > ~2.6 (k3 > 10).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Literal

from rlkernel import _validate as check
from rlkernel.rl import PolicyLossConfig

# The TRL releases this integration reproduces: the 1.16 series, tested against the first.
TESTED_VERSIONS: tuple[str, ...] = ("1.16.0",)
SUPPORTED_SERIES = "1.16"

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

# TRL's vLLM importance-sampling modes -> rlkernel's rollout corrections (same formulas: ρ per token
# or the product over the sequence, truncated into [min, max] or zeroed outside it).
_ROLLOUT_CORRECTIONS = {
    "token_truncate": "token_tis",
    "token_mask": "token_mis",
    "sequence_truncate": "seq_tis",
    "sequence_mask": "seq_mis",
}
# loss_type -> rlkernel aggregation, and which normalizer rule of the module docstring applies.
_AGGREGATIONS = {
    "grpo": ("seq-mean-token-mean", "sequences"),
    "sapo": ("seq-mean-token-mean", "sequences"),
    "luspo": ("seq-mean-token-sum", "sequences"),
    "dr_grpo": ("seq-mean-token-sum-norm", "sequences"),
    "bnpo": ("token-mean", "local_tokens"),
    "dapo": ("token-mean", "step_tokens"),
    "cispo": ("token-mean", "step_tokens"),
    "vespo": ("token-mean", "step_tokens"),
}

Normalizer = Literal["sequences", "local_tokens", "step_tokens"]


def installed_version() -> str | None:
    """The installed ``trl`` distribution's version, or ``None`` (read from its metadata)."""
    try:
        return importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_supported_trl() -> None:
    """:func:`check_version` of the installed TRL."""
    check_version(installed_version())


def check_version(installed: str | None) -> None:
    """Raise ``RuntimeError`` unless ``installed`` is a TRL 1.16.x release (or ``None``: TRL is not
    installed, and the mapping is 1.16's, as documented)."""
    if installed is None or installed.startswith(SUPPORTED_SERIES + "."):
        return
    raise RuntimeError(
        f"rlkernel.integrations.trl reproduces TRL {SUPPORTED_SERIES}.x (tested against "
        f"{', '.join(TESTED_VERSIONS)} in CI); the installed trl is {installed}, whose GRPOTrainer may "
        f"compute another loss or name its settings differently. Install trl=={TESTED_VERSIONS[-1]}, or "
        "use rlkernel.fused_policy_loss with a PolicyLossConfig directly."
    )


@dataclass(frozen=True)
class TRLLossPlan:
    """What a ``GRPOConfig`` maps onto, decided once.

    Attributes:
        config: the policy objective (policy term, vLLM correction, KL); no entropy term.
        normalizer: how the trainer derives ``global_seqs`` / ``global_tokens`` per micro-batch:
            ``"sequences"`` (B·GA), ``"local_tokens"`` (max(Σm, 1)·GA) or ``"step_tokens"``
            (``num_items_in_batch`` rescaled; module docstring).
        entropy_bonus: TRL's entropy bonus is on (``entropy_coef != 0`` or ``use_adaptive_entropy``):
            loss −= coef·(the token mean of the entropy)/GA, whatever the loss type's normalizer.
            No ``PolicyLossConfig`` field has that form (rlkernel's bonus uses the policy's
            aggregation), so the trainer adds it.
        rollout_correction: the vLLM importance-sampling correction is on (``use_vllm`` and
            ``vllm_importance_sampling_correction``): the trainer passes the sampler's log-probs as
            ``rollout_logp``.
    """

    config: PolicyLossConfig
    normalizer: Normalizer
    entropy_bonus: bool
    rollout_correction: bool


def _field(args: object, name: str) -> object:
    try:
        return getattr(args, name)
    except AttributeError:
        raise TypeError(
            f"args must be a trl.GRPOConfig (TRL {SUPPORTED_SERIES}); {type(args).__name__} has no "
            f"field {name!r}"
        ) from None


def _unsupported(setting: str, why: str) -> ValueError:
    return ValueError(f"GRPOConfig {setting} is not supported by rlkernel.integrations.trl: {why}")


def _mask_fields(args: object) -> dict[str, object]:
    """TRL's token masks on the policy term: the off-policy sequence mask (OPSM) and the
    top-entropy-quantile mask (same field names in ``PolicyLossConfig``; its checks apply)."""
    fields: dict[str, object] = {}
    threshold = _field(args, "off_policy_mask_threshold")
    if threshold is not None:
        fields["off_policy_mask_threshold"] = check.real("off_policy_mask_threshold", threshold)
    quantile = check.real("top_entropy_quantile", _field(args, "top_entropy_quantile"))
    if not 0.0 <= quantile <= 1.0:  # NaN included
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {quantile}")
    if quantile < 1.0:
        fields["top_entropy_quantile"] = quantile
    return fields


def _rollout_fields(args: object) -> dict[str, object]:
    """The vLLM importance-sampling correction as rlkernel's rollout correction fields."""
    mode = check.choice(
        "vllm_importance_sampling_mode", _field(args, "vllm_importance_sampling_mode"), VLLM_IS_MODES
    )
    low, high = (
        _field(args, "vllm_importance_sampling_clip_min"),
        _field(args, "vllm_importance_sampling_clip_max"),
    )
    low = None if low is None else check.real("vllm_importance_sampling_clip_min", low)
    high = None if high is None else check.real("vllm_importance_sampling_clip_max", high)
    # ρ = exp(·) >= 0: a lower bound <= 0 truncates or rejects nothing (TRL's clamp / comparison with
    # it is a no-op), so it maps onto no bound.
    if low is not None and low <= 0:
        low = None
    if low is None and high is None:
        raise _unsupported(
            f"vllm_importance_sampling_mode={mode!r} with neither vllm_importance_sampling_clip_min > 0 "
            "nor vllm_importance_sampling_clip_max",
            "an unbounded importance weight; rlkernel's rollout corrections need a bound",
        )
    return dict(rollout_correction=_ROLLOUT_CORRECTIONS[mode], rollout_clip_min=low, rollout_clip_max=high)


def _policy_fields(args: object, loss_type: str, level: str) -> dict[str, object]:
    """The policy term: loss type, clip bounds, delta."""
    epsilon = check.nonneg_float("epsilon", _field(args, "epsilon"))
    high = _field(args, "epsilon_high")
    epsilon_high = epsilon if high is None else check.nonneg_float("epsilon_high", high)
    delta = _field(args, "delta")
    sequence = level == "sequence"
    if loss_type == "cispo":
        if sequence:
            raise _unsupported(
                "loss_type='cispo' with importance_sampling_level='sequence'",
                "rlkernel's cispo weighs each token by its own ratio; it has no sequence-ratio form",
            )
        if epsilon_high < 1.0:
            raise _unsupported(
                f"loss_type='cispo' with epsilon_high={epsilon_high} < 1",
                "TRL's cispo clamps the ratio itself at epsilon_high (the ScaleRL ε_max, recommended 5.0); "
                "rlkernel's upper bound is 1 + clip_high with clip_high >= 0",
            )
        return dict(loss_type="cispo", clip_low=None, clip_high=epsilon_high - 1.0)
    if loss_type == "vespo":
        # VESPO's weight reads the product ratio of the sequence whatever importance_sampling_level
        # says (the level only picks TRL's KL weight, checked in plan_from_trl).
        names = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
        return dict(loss_type="vespo", **{name: check.real(name, _field(args, name)) for name in names})
    if loss_type == "sapo":
        if sequence:
            raise _unsupported(
                "loss_type='sapo' with importance_sampling_level='sequence'",
                "rlkernel's sapo gates each token's own ratio; it has no sequence-ratio form",
            )
        return dict(
            loss_type="sapo",
            sapo_tau_pos=check.positive_float("sapo_temperature_pos", _field(args, "sapo_temperature_pos")),
            sapo_tau_neg=check.positive_float("sapo_temperature_neg", _field(args, "sapo_temperature_neg")),
        )
    fields: dict[str, object] = dict(
        loss_type="gspo" if sequence else "ppo", clip_low=epsilon, clip_high=epsilon_high
    )
    if delta is not None:
        delta = check.real("delta", delta)
        if sequence:
            raise _unsupported(
                "delta with importance_sampling_level='sequence'",
                "rlkernel's two-sided cap δ applies to the token ratio of ppo; its gspo has no δ",
            )
        if not delta > 1.0:
            raise _unsupported(
                f"delta={delta}", "rlkernel's two-sided cap needs δ > 1 (TRL recommends δ > 1 + ε)"
            )
        fields["delta"] = delta
    return fields


def plan_from_trl(args: object) -> TRLLossPlan:
    """Map a ``trl.GRPOConfig``'s loss settings (TRL 1.16) onto a :class:`TRLLossPlan`.

    Args:
        args: a ``trl.GRPOConfig`` (any object with its fields).

    Raises:
        RuntimeError: the installed TRL is not a 1.16.x release.
        TypeError: ``args`` lacks a ``GRPOConfig`` field, or a field has the wrong type.
        ValueError: a value TRL would reject or rlkernel cannot reproduce; the message names the
            ``GRPOConfig`` field (docs/integrations/trl.md lists them).
    """
    require_supported_trl()
    loss_type = check.choice("loss_type", _field(args, "loss_type"), LOSS_TYPES)
    level = check.choice(
        "importance_sampling_level", _field(args, "importance_sampling_level"), IMPORTANCE_SAMPLING_LEVELS
    )
    beta = check.nonneg_float("beta", _field(args, "beta"))
    aggregation, normalizer = _AGGREGATIONS[loss_type]
    fields = _policy_fields(args, loss_type, level)
    fields["aggregation"] = aggregation
    if loss_type == "dr_grpo":
        length = _field(args, "max_completion_length")
        if length is None:
            raise _unsupported(
                "loss_type='dr_grpo' with max_completion_length=None", "its normalizer is that length"
            )
        fields["norm_length"] = check.positive_int("max_completion_length", length)
    if beta > 0:
        # use_bias_correction_kl (TRL's default True): the k3 term times TRL's coef_1, not detached.
        weighted = bool(_field(args, "use_bias_correction_kl"))
        if weighted and loss_type == "vespo" and level == "sequence":
            raise _unsupported(
                "loss_type='vespo' with importance_sampling_level='sequence', beta > 0 and "
                "use_bias_correction_kl=True",
                "TRL weighs the KL term by the geometric-mean sequence ratio there; rlkernel's vespo weighs "
                "it by the token ratio. Use importance_sampling_level='token' or "
                "use_bias_correction_kl=False",
            )
        # TRL's k3 has no clamps: rlkernel's k3 (verl's ±20 / ±10 guards) would differ at large drifts.
        fields.update(kl_coef=beta, kl_estimator="k3_unclamped", kl_ratio_weighted=weighted)
    fields.update(_mask_fields(args))
    rollout = bool(_field(args, "use_vllm")) and bool(_field(args, "vllm_importance_sampling_correction"))
    if rollout:
        fields.update(_rollout_fields(args))
    try:
        config = PolicyLossConfig(**fields)
    except (TypeError, ValueError) as error:
        raise type(error)(
            f"these GRPOConfig settings map onto PolicyLossConfig({fields}), which rejects them: {error}"
        ) from error
    entropy_coef = check.finite_float("entropy_coef", _field(args, "entropy_coef"))
    bonus = entropy_coef != 0.0 or bool(_field(args, "use_adaptive_entropy"))
    return TRLLossPlan(config=config, normalizer=normalizer, entropy_bonus=bonus, rollout_correction=rollout)


def policy_config_from_trl(args: object) -> PolicyLossConfig:
    """The :class:`rlkernel.PolicyLossConfig` of a ``trl.GRPOConfig``'s loss (TRL 1.16).

    The config holds the policy term, the vLLM importance-sampling correction and the KL term. TRL's
    normalizers are per-call arguments (``global_tokens`` / ``global_seqs``, see the module
    docstring and docs/integrations/trl.md); :class:`RLKernelGRPOTrainer` passes them.

    Args:
        args: a ``trl.GRPOConfig`` (any object with its fields).

    Returns:
        The ``PolicyLossConfig``.

    Raises:
        RuntimeError: the installed TRL is not a 1.16.x release.
        TypeError: ``args`` lacks a ``GRPOConfig`` field, or a field has the wrong type.
        ValueError: a setting rlkernel cannot reproduce (the message names it), including TRL's
            entropy bonus (``entropy_coef != 0`` or ``use_adaptive_entropy``): TRL subtracts the
            token mean of the entropy whatever the loss type's normalizer, which no
            ``PolicyLossConfig`` expresses (``RLKernelGRPOTrainer`` adds it itself).
    """
    plan = plan_from_trl(args)
    if plan.entropy_bonus:
        raise _unsupported(
            "entropy_coef != 0 / use_adaptive_entropy in a PolicyLossConfig",
            "TRL's bonus is the token mean of the entropy divided by the accumulation steps whatever the "
            "loss type's normalizer, while rlkernel's entropy_coef uses the policy's aggregation; "
            "RLKernelGRPOTrainer adds TRL's bonus itself",
        )
    return plan.config


def step_normalizers(
    plan: TRLLossPlan,
    *,
    batch_size: int,
    local_tokens: object,
    num_items_in_batch: object,
    accumulation_steps: int,
    num_processes: int,
    steps_per_generation: int,
    training: bool,
) -> dict[str, object]:
    """``global_seqs`` / ``global_tokens`` of one micro-batch, by TRL's rule (module docstring).

    Args:
        plan: from :func:`plan_from_trl`.
        batch_size: B, the micro-batch's sequences (empty ones included, as TRL's mean counts them).
        local_tokens: 0-dim tensor, the micro-batch's active-token count Σm.
        num_items_in_batch: 0-dim tensor, the generation batch's active tokens over all processes.
        accumulation_steps: ``current_gradient_accumulation_steps`` (used in training only).
        num_processes, steps_per_generation: the accelerator's process count, the config's field.
        training: the model is in training mode (else TRL's evaluation normalizers).

    Returns:
        ``{"global_seqs": ...}`` or ``{"global_tokens": ...}`` for ``policy_loss``.
    """
    ga = accumulation_steps if training else 1
    if plan.normalizer == "sequences":
        return {"global_seqs": batch_size * ga}
    if plan.normalizer == "local_tokens":
        return {"global_tokens": local_tokens.clamp(min=1.0) * ga}
    # TRL's own order of operations (the same float32 rounding).
    tokens = num_items_in_batch.clamp(min=1.0) / num_processes
    if training:
        tokens = tokens * accumulation_steps / steps_per_generation
    return {"global_tokens": tokens}
