"""``PolicyLossConfig``: one frozen description of an RL policy objective, plus named presets.

Every field is validated on construction (``__post_init__``), so a config that exists is a config that
:func:`rlkernel.policy_loss` can run; the errors name the field. ``PolicyLossConfig.preset(name,
**overrides)`` starts from a named recipe and replaces fields (re-validated).

Presets (``—`` = the field's default; all presets have ``entropy_coef=0`` and no rollout correction):

    preset    loss_type  clip_low  clip_high  dual_clip  aggregation               kl_coef (est.)
    ppo       ppo        0.2       0.2        3.0        token-mean                0
    grpo      ppo        0.2       0.2        —          seq-mean-token-mean       0.001 (k3)
    dapo      ppo        0.2       0.28       10.0       token-mean                0
    dr_grpo   ppo        0.2       0.2        —          seq-mean-token-sum-norm   0
    gspo      gspo       3e-4      4e-4       —          seq-mean-token-mean       0
    luspo     gspo       3e-4      4e-4       —          seq-mean-token-sum        0
    cispo     cispo      None      4.0        —          token-mean                0
    sapo      sapo       0.2       0.2        —          seq-mean-token-mean       0   (τ+ 1.0, τ− 1.05)
    gmpo      gmpo       0.4       0.4        —          seq-mean-token-mean       0

What each reproduces, and where verl and TRL differ (verl ``actor_rollout_ref.actor.*`` keys, TRL
``GRPOConfig`` fields):

* ``ppo`` — verl ``policy_loss.loss_mode=vanilla`` defaults: ``clip_ratio=0.2``, ``clip_ratio_c=3.0``
  (verl applies the dual clip always; set ``dual_clip=None`` for the classic PPO clip of TRL's
  ``PPOTrainer``), ``loss_agg_mode=token-mean``, ``use_kl_loss=False``.
* ``grpo`` — DeepSeekMath GRPO as TRL ``loss_type="grpo"`` aggregates it (per-sequence token mean,
  then mean over sequences), with verl's GRPO example KL loss (``use_kl_loss=True``,
  ``kl_loss_coef=0.001``, ``kl_loss_type=low_var_kl``; needs ``ref_logp``). verl's GRPO examples use
  ``loss_agg_mode=token-mean`` and ``clip_ratio_c=3``: override ``aggregation="token-mean",
  dual_clip=3.0`` for those. TRL's ``beta`` (KL coefficient) defaults to 0.0, the paper used 0.04;
  TRL's k3 has no clamps: ``kl_estimator="k3_unclamped"`` (see :mod:`rlkernel.rl.kl`).
* ``dapo`` — the verl DAPO recipe: ``clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0``,
  ``token-mean``, no KL. TRL ``loss_type="dapo"``, ``epsilon_high=0.28`` has no dual clip (it
  differs only where A < 0 and r > 10) and normalizes by the global token count: pass
  ``global_tokens`` for the same. Dynamic sampling and overlong shaping live outside the loss.
* ``dr_grpo`` — Dr. GRPO: Σ mℓ / (#seqs · MAX_TOKENS). TRL ``loss_type="dr_grpo"`` divides by
  ``batch · max_completion_length``; verl ``loss_agg_mode=seq-mean-token-sum-norm`` by
  ``global_batch_size · loss_scale_factor`` (default: the padded width). Set ``norm_length`` to the
  maximum completion length for TRL's constant; advantages via
  ``group_advantages(..., estimator="dr_grpo")`` (no std scaling).
* ``gspo`` — GSPO paper / verl ``loss_mode=gspo`` with its recipe bounds ``clip_ratio_low=3e-4,
  clip_ratio_high=4e-4``, ``seq-mean-token-mean``; TRL ``importance_sampling_level="sequence"``,
  ``loss_type="grpo"``, ``epsilon=3e-4``, ``epsilon_high=4e-4``. verl implements the ``gspo_token``
  form and forces ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says; with that aggregation and
  a per-sequence advantage ``gspo`` and ``gspo_token`` have equal values and gradients.
* ``luspo`` — TRL ``loss_type="luspo"`` (sequence-level ratio, loss ℓ_i·|y_i| averaged over
  sequences = ``seq-mean-token-sum`` of the broadcast sequence loss). TRL's mean also counts
  sequences without tokens; here they are excluded (pass ``global_seqs`` = batch size to match).
  verl has no equivalent (its gspo forces ``seq-mean-token-mean``).
* ``cispo`` — MiniMax-M1 CISPO with the ScaleRL cap ε_max = 5: weight sg[min(r, 5)], no lower bound,
  ``token-mean``. TRL ``loss_type="cispo"`` clamps at ``epsilon_high`` itself (``epsilon_high=5.0``
  ↔ ``clip_high=4.0``). verl ``loss_mode=cispo`` clamps to [1 − clip_ratio_low, 1 + clip_ratio_high]
  (set ``clip_low`` for a lower bound).
* ``sapo`` — SAPO paper / verl ``loss_mode=sapo`` / TRL ``loss_type="sapo"``: ``tau_pos=1.0``,
  ``tau_neg=1.05``, ``seq-mean-token-mean`` (verl forces it). The clip fields are unused.
* ``gmpo`` — verl ``loss_mode=geo_mean`` with the GMPO recipe ``clip_ratio_low=clip_ratio_high=0.4``
  (bounds in log space). verl ignores ``loss_agg_mode`` and averages the per-sequence losses over all
  B rows (also empty ones); ``seq-mean-token-mean`` is the same without empty rows (pass
  ``global_seqs=B`` to count them). TRL has no GMPO.

Loss types without a preset (issue 14; formulas in :mod:`rlkernel.rl.objectives`), and the
framework settings they reproduce:

* ``vespo`` — TRL ``loss_type="vespo"``: ℓ = −sg[φ(w_i)]·A·logp with the Gamma weight
  φ(w) = e^λ·w^k·e^{−λw} of the sequence ratio w_i = exp(Σ_t m·lr) (``seq_ratio="product"``, the
  default for vespo). Fields ↔ TRL: ``vespo_k_pos``/``vespo_lambda_pos``/``vespo_k_neg``/
  ``vespo_lambda_neg`` ↔ the same names (defaults 2, 3, 3, 2); TRL's normalizer is the step's token
  count: ``aggregation="token-mean"`` with ``global_tokens``. TRL's vLLM importance ratio
  (``vllm_importance_sampling_mode``) is folded into w_i, not multiplied into the loss: here
  ``rollout_correction`` does the same for vespo (``token_truncate`` ↔ ``token_tis``, ``token_mask``
  ↔ ``token_mis``, ``sequence_*`` ↔ ``seq_*``, ``vllm_importance_sampling_clip_min``/``_max``
  ↔ ``rollout_clip_min``/``rollout_clip_max``).
* ``dppo_tv`` / ``dppo_kl`` — verl ``policy_loss.loss_mode=dppo_tv|dppo_kl`` (DPPO-Binary-TV/-KL):
  ℓ = −A·sg[min(r, c)]·logp·sg[in trust region]. verl's ``clip_ratio_low``/``clip_ratio_high`` (the
  divergence thresholds) ↔ ``clip_low``/``clip_high``; verl's ``clip_ratio_c`` (ActorConfig default
  3.0; the function's own fallback 20.0) ↔ ``dppo_ratio_cap`` (default 20.0).
* ``clip_cov`` / ``kl_cov`` — verl ``loss_mode=clip_cov|kl_cov``: ``clip_cov_ratio``,
  ``clip_cov_lb``, ``clip_cov_ub``, ``kl_cov_ratio`` ↔ the same names, ``kl_cov_coef`` ↔
  ``ppo_kl_coef`` (verl's PolicyLossConfig default 0.1); clip bounds as for ``ppo``. The token
  selection is verl's, random draw included (:mod:`rlkernel.rl.covariance`).
* ``dro`` — verl ``loss_mode=dro``: ℓ = −(A·logp − ½β·lr²), ``dro_beta`` ↔ ``dro_beta`` (required).
* ``token-sum`` — verl ``loss_agg_mode=token-sum`` (Σ m·ℓ; verl's × dp_size is the caller's).
* ``kl_ratio_weighted`` — TRL ``use_bias_correction_kl`` (the KL term times the importance ratio,
  not detached); ``seq_ratio`` — the sequence ratio's convention (TRL's and verl's GSPO use
  ``geo_mean``; TRL's VESPO and the sequence-level rollout corrections use the product).

Caveats:
    * Presets describe the loss only; advantages (``group_advantages``), dynamic sampling, reward
      shaping and the global normalizers of a distributed step are the caller's.
    * ``kl_estimator`` keeps the spelling it was given (verl aliases included); the loss resolves it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, get_args

from rlkernel import _validate as check
from rlkernel.rl.aggregate import AGGREGATIONS, Aggregation
from rlkernel.rl.kl import canonical_kl_estimator

LossType = Literal[
    "ppo",
    "gspo",
    "gspo_token",
    "cispo",
    "sapo",
    "gmpo",
    "reinforce",
    "vespo",
    "dppo_tv",
    "dppo_kl",
    "clip_cov",
    "kl_cov",
    "dro",
]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)  # one list of names

RolloutCorrection = Literal["token_tis", "seq_tis", "token_mis", "seq_mis"]
ROLLOUT_CORRECTIONS: tuple[str, ...] = ("token_tis", "seq_tis", "token_mis", "seq_mis")

# verl's rollout rejection criteria (``rollout_rs``): level × divergence (see rlkernel.rl.rollout).
RolloutRejection = Literal[
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
]
ROLLOUT_REJECTIONS: tuple[str, ...] = RolloutRejection.__args__

# Loss types with PPO's extra knobs (dual clip, delta).
_PPO_ONLY = ("ppo",)

# The numeric fields (checked for the float32 range) and those that must be > 0.
_FLOAT_FIELDS = (
    "clip_low",
    "clip_high",
    "dual_clip",
    "delta",
    "kl_coef",
    "entropy_coef",
    "rollout_clip_min",
    "rollout_clip_max",
    "sapo_tau_pos",
    "sapo_tau_neg",
)
_POSITIVE_FIELDS = (
    "dual_clip",
    "delta",
    "rollout_clip_min",
    "rollout_clip_max",
    "sapo_tau_pos",
    "sapo_tau_neg",
)
# --- issue 14: the sequence-ratio conventions, and the numeric fields of that block -------------
SeqRatio = Literal["geo_mean", "product"]
SEQ_RATIOS: tuple[str, ...] = ("geo_mean", "product")
# The loss types that have a sequence importance ratio (seq_ratio applies to them only).
SEQ_RATIO_LOSS_TYPES: tuple[str, ...] = ("gspo", "gspo_token", "vespo")
_MORE_FLOAT_FIELDS = (
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "dppo_ratio_cap",
    "clip_cov_ratio",
    "clip_cov_lb",
    "clip_cov_ub",
    "kl_cov_ratio",
    "kl_cov_coef",
    "dro_beta",
)
_MORE_POSITIVE_FIELDS = ("dppo_ratio_cap", "clip_cov_ratio", "kl_cov_ratio", "dro_beta")

# The largest norm_length: a token length (int32), exactly an int64 and a float32-range number
# wherever the loss multiplies by it.
NORM_LENGTH_MAX = 2**31 - 1


def _optional(check_fn, name: str, value: object) -> Any:
    return None if value is None else check_fn(name, value)


@dataclass(frozen=True)
class PolicyLossConfig:
    """The RL policy objective: loss type, clipping, aggregation, KL, entropy, rollout correction.

    Attributes:
        loss_type: ``ppo | gspo | gspo_token | cispo | sapo | gmpo | reinforce | vespo | dppo_tv |
            dppo_kl | clip_cov | kl_cov | dro`` (see :mod:`rlkernel.rl.objectives` for each
            formula).
        clip_low: lower clip ε_low ≥ 0: the ratio is clipped below at 1 − ε_low (``gmpo``: the
            log-ratio at −ε_low; ``dppo_*``: the divergence threshold where A ≤ 0). ``None`` (no
            lower bound) is allowed for ``cispo`` only.
        clip_high: upper clip ε_high ≥ 0: 1 + ε_high (``gmpo``: log-ratio ε_high; ``dppo_*``: the
            divergence threshold where A > 0).
        dual_clip: dual-clip constant c > 1 (``ppo`` only): where A < 0, ℓ = min(ℓ, −c·A).
        delta: cap δ > 1 on the ratio of the unclipped PPO term, r → min(r, δ) (``ppo`` only; TRL's
            two-sided GRPO ``delta``).
        aggregation: ``token-mean | seq-mean-token-mean | seq-mean-token-sum |
            seq-mean-token-sum-norm | token-sum``.
        norm_length: the constant length of ``seq-mean-token-sum-norm`` (int in [1, 2**31 − 1]);
            ``None`` uses the padded width (packed input: the longest sequence).
        kl_coef: weight ≥ 0 of the per-token KL penalty against ``ref_logp`` (> 0 requires
            ``ref_logp``).
        kl_estimator: ``k1 | k2 | k3 | abs | k1+ | k3+ | k3_unclamped`` or a verl alias (``kl``,
            ``mse``, ``low_var_kl``, ``kl+``, ``low_var_kl+``).
        entropy_coef: entropy bonus weight (finite; ≠ 0 requires ``entropy``): loss −= coef·agg(H).
        rollout_correction: ``None | token_tis | seq_tis | token_mis | seq_mis`` (requires
            ``rollout_logp``; see :mod:`rlkernel.rl.rollout`).
        rollout_clip_min: lower bound (> 0) of the rollout weight, or ``None`` for none.
        rollout_clip_max: upper bound (> 0) of the rollout weight, or ``None`` for none; default 2.0
            (verl's ``rollout_is_threshold``). At least one bound is required with a correction.
        sapo_tau_pos: SAPO temperature (> 0) where A > 0.
        sapo_tau_neg: SAPO temperature (> 0) where A ≤ 0.
        rollout_rs: ``None`` or verl's rollout rejection criterion: ``token_k1 | token_k2 |
            token_k3 | seq_sum_k{1,2,3} | seq_mean_k{1,2,3} | seq_max_k{2,3}``. Tokens (or whole
            sequences) whose divergence between ``old_logp`` and ``rollout_logp`` is out of bounds
            leave the mask (requires ``rollout_logp``).
        rollout_rs_min: k1 criteria only: lower bound (> 0) on the ratio π_rollout/π_old (the
            k1 statistic is compared with its log); ``None``: no lower bound (verl's default is
            1/``rollout_rs_max``: pass it to match).
        rollout_rs_max: upper bound (> 0): on the ratio for k1 (``None``: none; at least one bound
            is required), on the divergence for k2/k3 (required).
        off_policy_mask_threshold: TRL's off-policy sequence mask δ (≥ 0), or ``None`` (off): the
            policy term of a token with A < 0 whose sequence has mean(rollout_logp − logp) > δ is
            dropped.
        top_entropy_quantile: TRL's ρ in [0, 1]: only the tokens whose entropy is at least the
            (1 − ρ)-quantile of the active tokens' entropies keep their policy term (requires
            ``entropy``); 1.0 (the default) is off. (Formulas of the last five fields:
            :mod:`rlkernel.rl.rollout` and :mod:`rlkernel.rl.masks`.)
        rollout_batch_normalize: divide the correction's weights by their mean over this call
            (verl's ``rollout_is_batch_normalize``): over the active tokens for ``token_*``, over
            the sequences with an active token for ``seq_*``; no division when that mean is
            ≤ 1e-8 (verl's guard). Requires ``rollout_correction``.

    More loss types, the sequence-ratio convention and the ratio-weighted KL (issue 14; the
    formulas are in :mod:`rlkernel.rl.objectives`):

        seq_ratio: ``None | "geo_mean" | "product"``: the sequence importance ratio of ``gspo``,
            ``gspo_token`` and ``vespo``: ``geo_mean`` s_i = exp(Σ_t m·lr / n_i), ``product``
            s_i = exp(Σ_t m·lr). ``None`` (default) is the loss type's own convention: ``geo_mean``
            for ``gspo``/``gspo_token`` (GSPO paper, verl ``gspo``, TRL
            ``importance_sampling_level="sequence"``), ``product`` for ``vespo`` (TRL). Setting it
            for another loss type is an error.
        kl_ratio_weighted: multiply the per-token KL by the importance ratio (TRL's
            ``use_bias_correction_kl``): r_t = exp(lr_t) (``gspo``: s_i; ``gspo_token``: s_it), not
            detached, as TRL. No effect when ``kl_coef == 0`` (the ``kl_ref`` metric is weighted).
        vespo_k_pos, vespo_lambda_pos: VESPO's Gamma shape k ≥ 0 and rate λ ≥ 0 where A ≥ 0
            (TRL ``vespo_k_pos=2.0``, ``vespo_lambda_pos=3.0``); λ is floored at 1e-4 as TRL does.
        vespo_k_neg, vespo_lambda_neg: the same where A < 0 (TRL ``3.0``, ``2.0``).
        dppo_ratio_cap: ``dppo_tv``/``dppo_kl``: the truncation c > 0 of the detached ratio
            weight sg[min(r, c)], or ``None`` for none; default 20.0 (verl's in-function default;
            verl's ``ActorConfig`` passes its ``clip_ratio_c``, default 3.0). The divergence
            thresholds of ``dppo_*`` are ``clip_low`` / ``clip_high`` (verl's ``clip_ratio_low`` /
            ``clip_ratio_high``).
        clip_cov_ratio: ``clip_cov``: the fraction ∈ (0, 1] of the active tokens whose gradient
            may be cut (verl ``clip_cov_ratio``, default 2e-4).
        clip_cov_lb, clip_cov_ub: ``clip_cov``: the covariance window (lb, ub), lb < ub, of the
            tokens eligible for the cut (verl ``clip_cov_lb=1.0``, ``clip_cov_ub=5.0``).
        kl_cov_ratio: ``kl_cov``: the fraction ∈ (0, 1] of the active tokens with the largest
            covariance that get the |lr| penalty (verl ``kl_cov_ratio``, default 2e-4).
        kl_cov_coef: ``kl_cov``: the weight ≥ 0 of that penalty (verl ``ppo_kl_coef``, default 0.1).
        dro_beta: ``dro``: the weight β > 0 of the quadratic log-ratio penalty; required by
            ``dro`` (verl ``dro_beta``, no default) and rejected by every other loss type.

    Every number must also be usable in float32, where the loss is computed: a magnitude at most
    the largest float32 (~3.4e38), and a positive field (``dual_clip``, ``delta``, the rollout
    bounds, the SAPO temperatures) at least the smallest normal float32 (~1.2e-38).

    Raises:
        TypeError: a field of the wrong type (e.g. a string clip bound, a bool, a float
            ``norm_length``).
        ValueError: a value out of range (negative, NaN, inf, an int too large for a float, beyond
            the float32 range, ``norm_length`` above 2**31 − 1) or an unknown name; the message
            names the field.
    """

    loss_type: LossType = "ppo"
    clip_low: float | None = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    delta: float | None = None
    aggregation: Aggregation = "token-mean"
    norm_length: int | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    rollout_correction: RolloutCorrection | None = None
    rollout_clip_min: float | None = None
    rollout_clip_max: float | None = 2.0
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    # --- issue 14 (more loss types, sequence-ratio convention, ratio-weighted KL) ----------------
    seq_ratio: SeqRatio | None = None
    kl_ratio_weighted: bool = False
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    dppo_ratio_cap: float | None = 20.0
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    kl_cov_coef: float = 0.1
    dro_beta: float | None = None
    # --- Token masks: rollout rejection (verl rollout_rs), off-policy sequence mask and entropy
    # quantile (TRL); see rlkernel.rl.rollout and rlkernel.rl.masks. Checked by _check_masks.
    rollout_rs: RolloutRejection | None = None
    rollout_rs_min: float | None = None
    rollout_rs_max: float | None = None
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    # --- verl's rollout_is_batch_normalize: the correction's weights divided by their batch mean.
    rollout_batch_normalize: bool = False

    def __post_init__(self) -> None:
        check.choice("loss_type", self.loss_type, LOSS_TYPES)
        check.choice("aggregation", self.aggregation, AGGREGATIONS)
        self._check_clips()
        if self.norm_length is not None:
            check.positive_int("norm_length", self.norm_length, maximum=NORM_LENGTH_MAX)
        check.nonneg_float("kl_coef", self.kl_coef)
        canonical_kl_estimator(self.kl_estimator, "kl_estimator")
        check.finite_float("entropy_coef", self.entropy_coef)
        self._check_rollout()
        check.positive_float("sapo_tau_pos", self.sapo_tau_pos)
        check.positive_float("sapo_tau_neg", self.sapo_tau_neg)
        self._check_fp32()
        self._check_more_losses()
        self._check_masks()
        check.boolean("rollout_batch_normalize", self.rollout_batch_normalize)
        if self.rollout_batch_normalize and self.rollout_correction is None:
            raise ValueError(
                "rollout_batch_normalize=True needs rollout_correction (it normalizes the correction's "
                "weights; precomputed rollout_weights are the caller's to normalize)"
            )

    def _check_fp32(self) -> None:
        """Every number must survive the float32 math (and the kernels' float32 scalars) as it is:
        a value beyond the float32 range would become inf there, a positive one below the smallest
        normal float32 would become 0 (or lose its precision)."""
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                check.fp32_float(name, float(value), positive=name in _POSITIVE_FIELDS)

    def _check_clips(self) -> None:
        if self.clip_low is None:
            if self.loss_type != "cispo":
                raise ValueError(
                    f"clip_low=None (no lower bound) is only valid for loss_type='cispo', "
                    f"got loss_type={self.loss_type!r}"
                )
        else:
            check.nonneg_float("clip_low", self.clip_low)
        check.nonneg_float("clip_high", self.clip_high)
        for name in ("dual_clip", "delta"):
            value = getattr(self, name)
            if value is None:
                continue
            if self.loss_type not in _PPO_ONLY:
                raise ValueError(f"{name} applies to loss_type='ppo' only, got loss_type={self.loss_type!r}")
            if check.positive_float(name, value) <= 1.0:
                raise ValueError(f"{name} must be > 1, got {value}")

    def _check_rollout(self) -> None:
        if self.rollout_correction is not None:
            check.choice("rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        low = _optional(check.positive_float, "rollout_clip_min", self.rollout_clip_min)
        high = _optional(check.positive_float, "rollout_clip_max", self.rollout_clip_max)
        if low is not None and high is not None and low > high:
            raise ValueError(f"rollout_clip_min ({low}) must be <= rollout_clip_max ({high})")
        if self.rollout_correction is not None and low is None and high is None:
            raise ValueError(
                f"rollout_correction={self.rollout_correction!r} needs rollout_clip_min or rollout_clip_max"
            )

    # --- issue 14 (more loss types, sequence-ratio convention, ratio-weighted KL) ----------------
    def _check_more_losses(self) -> None:
        """The fields of the issue-14 block: types, ranges, the loss types they belong to, and the
        float32 range (as :meth:`_check_fp32` does for the fields above)."""
        if self.seq_ratio is not None:
            check.choice("seq_ratio", self.seq_ratio, SEQ_RATIOS)
            if self.loss_type not in SEQ_RATIO_LOSS_TYPES:
                raise ValueError(
                    f"seq_ratio applies to loss_type in {SEQ_RATIO_LOSS_TYPES} only (the loss types with a "
                    f"sequence ratio), got loss_type={self.loss_type!r}"
                )
        check.boolean("kl_ratio_weighted", self.kl_ratio_weighted)
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "kl_cov_coef"):
            check.nonneg_float(name, getattr(self, name))
        if self.dppo_ratio_cap is not None:
            check.positive_float("dppo_ratio_cap", self.dppo_ratio_cap)
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            fraction = check.positive_float(name, getattr(self, name))
            if fraction > 1.0:
                raise ValueError(
                    f"{name} is a fraction of the active tokens: it must be in (0, 1], got {fraction}"
                )
        low = check.finite_float("clip_cov_lb", self.clip_cov_lb)
        high = check.finite_float("clip_cov_ub", self.clip_cov_ub)
        if low >= high:
            raise ValueError(
                f"clip_cov_lb ({low}) must be < clip_cov_ub ({high}): the window (lb, ub) is open"
            )
        if self.dro_beta is not None:
            if self.loss_type != "dro":
                raise ValueError(
                    f"dro_beta applies to loss_type='dro' only, got loss_type={self.loss_type!r}"
                )
            check.positive_float("dro_beta", self.dro_beta)
        elif self.loss_type == "dro":
            raise ValueError("loss_type='dro' requires dro_beta (> 0), the weight of its log-ratio penalty")
        for name in _MORE_FLOAT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                check.fp32_float(name, float(value), positive=name in _MORE_POSITIVE_FIELDS)

    def _check_masks(self) -> None:
        """The token-mask fields (rollout rejection, off-policy sequence mask, entropy quantile)."""
        if self.rollout_rs is not None:
            check.choice("rollout_rs", self.rollout_rs, ROLLOUT_REJECTIONS)
        low = _optional(check.positive_float, "rollout_rs_min", self.rollout_rs_min)
        high = _optional(check.positive_float, "rollout_rs_max", self.rollout_rs_max)
        for name, value in (("rollout_rs_min", low), ("rollout_rs_max", high)):
            if value is not None:
                check.fp32_float(name, value, positive=True)
        if self.rollout_rs is None:
            if low is not None or high is not None:
                raise ValueError("rollout_rs_min / rollout_rs_max need rollout_rs (the rejection criterion)")
        elif self.rollout_rs.endswith("k1"):
            if low is None and high is None:
                raise ValueError(f"rollout_rs={self.rollout_rs!r} needs rollout_rs_min or rollout_rs_max")
            if low is not None and high is not None and low > high:
                raise ValueError(f"rollout_rs_min ({low}) must be <= rollout_rs_max ({high})")
        else:
            if low is not None:
                raise ValueError(
                    f"rollout_rs_min applies to the k1 criteria only (a ratio bound); rollout_rs="
                    f"{self.rollout_rs!r} is a divergence >= 0 with an upper bound only"
                )
            if high is None:
                raise ValueError(f"rollout_rs={self.rollout_rs!r} needs rollout_rs_max (its upper bound)")
        if self.off_policy_mask_threshold is not None:
            delta = check.nonneg_float("off_policy_mask_threshold", self.off_policy_mask_threshold)
            check.fp32_float("off_policy_mask_threshold", delta)
        quantile = check.real("top_entropy_quantile", self.top_entropy_quantile)
        if not 0.0 <= quantile <= 1.0:  # also NaN
            raise ValueError(
                f"top_entropy_quantile must be in [0, 1] (1 = off), got {self.top_entropy_quantile!r}"
            )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> PolicyLossConfig:
        """A named recipe (see the module docstring's table), with ``overrides`` replacing fields.

        Args:
            name: one of :data:`PRESETS` (``ppo, grpo, dapo, dr_grpo, gspo, luspo, cispo, sapo, gmpo``).
            **overrides: field values replacing the preset's, validated like the constructor's.

        Raises:
            ValueError: unknown preset name (the message lists the valid ones).
            TypeError: an override that is not a field of ``PolicyLossConfig``.
        """
        if not isinstance(name, str) or name not in PRESETS:
            raise ValueError(f"preset name must be one of {tuple(PRESETS)}, got {name!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(
                f"unknown PolicyLossConfig field(s) in overrides: {unknown}; fields are {sorted(fields)}"
            )
        return cls(**{**PRESETS[name], **overrides})


_PRESETS: dict[str, dict[str, Any]] = {
    "ppo": dict(loss_type="ppo", clip_low=0.2, clip_high=0.2, dual_clip=3.0, aggregation="token-mean"),
    "grpo": dict(
        loss_type="ppo",
        clip_low=0.2,
        clip_high=0.2,
        aggregation="seq-mean-token-mean",
        kl_coef=0.001,
        kl_estimator="k3",
    ),
    "dapo": dict(loss_type="ppo", clip_low=0.2, clip_high=0.28, dual_clip=10.0, aggregation="token-mean"),
    "dr_grpo": dict(loss_type="ppo", clip_low=0.2, clip_high=0.2, aggregation="seq-mean-token-sum-norm"),
    "gspo": dict(loss_type="gspo", clip_low=3e-4, clip_high=4e-4, aggregation="seq-mean-token-mean"),
    "luspo": dict(loss_type="gspo", clip_low=3e-4, clip_high=4e-4, aggregation="seq-mean-token-sum"),
    "cispo": dict(loss_type="cispo", clip_low=None, clip_high=4.0, aggregation="token-mean"),
    "sapo": dict(loss_type="sapo", aggregation="seq-mean-token-mean", sapo_tau_pos=1.0, sapo_tau_neg=1.05),
    "gmpo": dict(loss_type="gmpo", clip_low=0.4, clip_high=0.4, aggregation="seq-mean-token-mean"),
}

# Read-only views: a preset table that a caller could mutate would defeat the frozen config.
PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {name: MappingProxyType(values) for name, values in _PRESETS.items()}
)
