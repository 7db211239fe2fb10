"""verl's policy losses computed by :func:`rlkernel.policy_loss`: the mode table and the loss functions.

A verl policy loss is a function registered in ``verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY``
and called by verl's actor (``verl.workers.utils.losses.ppo_loss``) as

    pg_loss, pg_metrics = fn(old_log_prob=, log_prob=, advantages=, response_mask=,
                             loss_agg_mode=, config=, rollout_is_weights=)

with ``[B, T]`` tensors, the actor config (whose ``global_batch_info`` dict carries ``dp_size``,
``batch_num_tokens``, ``global_batch_size`` and ``loss_scale_factor``), and returns the 0-dim loss and a
dict of Python floats. :func:`make_policy_loss_fn` builds such a function for one row of
:data:`LOSS_MODES`:

    verl loss_mode   PolicyLossConfig                    verl actor settings read
    vanilla          loss_type="ppo", dual_clip=c         clip_ratio(_low/_high), clip_ratio_c
    gspo             loss_type="gspo_token"               clip_ratio(_low/_high)
    sapo             loss_type="sapo"                     tau_pos, tau_neg
    cispo            loss_type="cispo"                    clip_ratio(_low/_high)
    geo_mean         loss_type="gmpo"                     clip_ratio(_low/_high)
    gpg              loss_type="reinforce"                —
    dro              loss_type="dro", dro_beta=β           policy_loss.dro_beta
    dppo_tv          loss_type="dppo_tv", dppo_ratio_cap=c  clip_ratio(_low/_high), clip_ratio_c (c)
    dppo_kl          loss_type="dppo_kl", dppo_ratio_cap=c  clip_ratio(_low/_high), clip_ratio_c (c)
    clip_cov         loss_type="clip_cov"                 clip_ratio(_low/_high), policy_loss.clip_cov_ratio,
                                                          clip_cov_lb, clip_cov_ub
    kl_cov           loss_type="kl_cov"                   policy_loss.kl_cov_ratio, ppo_kl_coef (kl_cov_coef)

(clip_cov draws its tokens from torch's default CPU generator as verl's does: the same seed, the same
tokens.)

A further verl mode is one more :class:`LossMode` row (its loss type, the settings it reads, verl's
metrics of it); the registration probes it like the others (:mod:`.probe`). ``bypass_mode``, whose
loss type, IS weights and rejection come from ``config.policy_loss.rollout_correction``, is the row
:data:`.bypass.BYPASS_MODE`, which computes itself (``LossMode.run``).

How the per-token loss becomes verl's scalar is a :class:`Convention`, chosen per ``loss_agg_mode`` by
the probe at registration (verl's releases differ here):

    as given      loss_agg_mode → aggregation, global_batch_info's normalizers, loss × dp_size
    seq-mean      seq-mean-token-mean whatever loss_agg_mode says (sapo; gspo in verl 0.7)
    rows          the mean of the per-sequence losses over all B rows, no normalizers (geo_mean)
    horizon       seq-mean-token-sum-norm as Σ mℓ / loss_scale_factor (or T), no sequence count and
                  no dp_size (verl 0.7)

Metrics are verl's, by verl's definitions (``actor/pg_clipfrac``, ``actor/ppo_kl``,
``actor/pg_clipfrac_lower``; none for gpg): :mod:`.metrics`.

``rollout_is_weights`` (verl's detached per-token rollout importance weights, ``[B, T]``) is passed as
:func:`policy_loss`'s ``rollout_weights``: it multiplies the policy term per token as in verl (gmpo:
folded per sequence by the geometric mean, as verl's geo_mean does).

Caveats:
    * A ``dp_size > 1`` without the normalizer of the aggregation raises ``ValueError``, as verl
      0.9.1's ``agg_loss`` does.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rlkernel import _validate as check
from rlkernel.integrations.verl import metrics
from rlkernel.integrations.verl.metrics import MetricInputs
from rlkernel.rl import PolicyLossConfig, policy_loss

# The parameters verl calls a policy loss with (by keyword), in the order of its PolicyLossFn.
POLICY_LOSS_PARAMETERS = (
    "old_log_prob",
    "log_prob",
    "advantages",
    "response_mask",
    "loss_agg_mode",
    "config",
    "rollout_is_weights",
)
# verl's loss_agg_mode values (ActorConfig's list) and the ones rlkernel has an aggregation for.
VERL_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
AGG_MODES = VERL_AGG_MODES
# The global_batch_info entry each aggregation divides by, as verl's agg_loss does (token-sum: none,
# Σ mℓ × dp_size only).
NORMALIZER_OF: dict[str, str | None] = {
    "token-mean": "batch_num_tokens",
    "token-sum": None,
    "seq-mean-token-mean": "global_batch_size",
    "seq-mean-token-sum": "global_batch_size",
    "seq-mean-token-sum-norm": "global_batch_size",
}
GLOBAL_BATCH_KEYS = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")
SUM_NORM = "seq-mean-token-sum-norm"

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, Any]]]


def setting(config: Any, name: str, default: Any = None) -> Any:
    """``config.<name>`` of a verl actor config (``ActorConfig``, a ``DictConfig`` or a dict)."""
    getter = getattr(config, "get", None)
    if callable(getter):
        return getter(name, default)
    return getattr(config, name, default)


@dataclass(frozen=True)
class GlobalBatchInfo:
    """``config.global_batch_info``, validated (verl's ``agg_loss`` keyword arguments).

    Attributes:
        dp_size: data-parallel world size (int >= 1); verl multiplies the loss by it.
        batch_num_tokens: active tokens of the mini-batch over all micro-batches and ranks, or None.
        global_batch_size: sequences of the mini-batch over all ranks, or None.
        loss_scale_factor: the constant length of ``seq-mean-token-sum-norm``, or None (T).
    """

    dp_size: int = 1
    batch_num_tokens: float | torch.Tensor | None = None
    global_batch_size: float | torch.Tensor | None = None
    loss_scale_factor: int | None = None

    @classmethod
    def of(cls, config: Any, device: torch.device) -> GlobalBatchInfo:
        info = setting(config, "global_batch_info", None)
        if info is None:
            return cls()
        if not isinstance(info, Mapping):
            raise TypeError(f"config.global_batch_info must be a dict, got {type(info).__name__}")
        unknown = sorted(set(info) - set(GLOBAL_BATCH_KEYS))
        if unknown:
            raise ValueError(
                f"config.global_batch_info has key(s) {unknown} that verl's agg_loss does not take; "
                f"its keys are {GLOBAL_BATCH_KEYS}"
            )
        dp_size = info.get("dp_size", 1)
        if isinstance(dp_size, numbers.Integral) and not isinstance(dp_size, bool):
            dp_size = int(dp_size)
        factor = info.get("loss_scale_factor")
        if isinstance(factor, float) and factor.is_integer():
            factor = int(factor)
        return cls(
            dp_size=check.positive_int("config.global_batch_info['dp_size']", dp_size),
            batch_num_tokens=check.normalizer(
                "config.global_batch_info['batch_num_tokens']", info.get("batch_num_tokens"), device
            ),
            global_batch_size=check.normalizer(
                "config.global_batch_info['global_batch_size']", info.get("global_batch_size"), device
            ),
            loss_scale_factor=None
            if factor is None
            else check.positive_int(
                "config.global_batch_info['loss_scale_factor']", factor, maximum=2**31 - 1
            ),
        )


@dataclass(frozen=True)
class Normalizers:
    """What :func:`rlkernel.policy_loss` is called with, and the factor verl applies after."""

    aggregation: str
    global_tokens: float | torch.Tensor | None = None
    global_seqs: float | torch.Tensor | None = None
    norm_length: int | None = None
    scale: int = 1


@dataclass(frozen=True)
class Convention:
    """How a verl loss mode turns its per-token loss into the scalar (module docstring's table).

    Attributes:
        label: for messages.
        aggregation: the rlkernel aggregation it always uses, or ``None``: ``loss_agg_mode``'s.
        scope: ``"global"`` (global_batch_info's normalizers, × dp_size), ``"rows"`` (÷ B, nothing
            else) or ``"horizon"`` (``seq-mean-token-sum-norm`` without sequence count or dp_size).
    """

    label: str
    aggregation: str | None
    scope: str

    def applies_to(self, loss_agg_mode: str) -> bool:
        return self.scope != "horizon" or loss_agg_mode == SUM_NORM

    def normalizers(self, loss_agg_mode: str, info: GlobalBatchInfo, rows: int) -> Normalizers:
        if self.scope == "rows":
            return Normalizers("seq-mean-token-mean", global_seqs=rows)
        if self.scope == "horizon":
            return Normalizers(SUM_NORM, global_seqs=1, norm_length=info.loss_scale_factor)
        aggregation = self.aggregation or loss_agg_mode
        key = NORMALIZER_OF[aggregation]
        if key is None:  # token-sum: Σ mℓ, no normalizer, × dp_size
            return Normalizers(aggregation, scale=info.dp_size)
        value = getattr(info, key)
        if value is None and info.dp_size > 1:
            raise ValueError(
                f"config.global_batch_info[{key!r}] is required when dp_size > 1 ({aggregation}; "
                f"dp_size={info.dp_size}), as in verl's agg_loss: without it the loss is a local mean"
            )
        token_mode = key == "batch_num_tokens"
        return Normalizers(
            aggregation,
            global_tokens=value if token_mode else None,
            global_seqs=None if token_mode else value,
            norm_length=info.loss_scale_factor if aggregation == SUM_NORM else None,
            scale=info.dp_size,
        )


AS_GIVEN = Convention(
    "loss_agg_mode as given, global_batch_info's normalizers, loss × dp_size", None, "global"
)
SEQ_MEAN = Convention("seq-mean-token-mean whatever loss_agg_mode says", "seq-mean-token-mean", "global")
ROWS = Convention("the mean of the per-sequence losses over all B rows (no loss_agg_mode)", None, "rows")
HORIZON = Convention(
    "seq-mean-token-sum-norm as Σ / loss_scale_factor (no sequence count, no dp_size)", None, "horizon"
)
# In the order the probe tries them: the first that reproduces verl is the one used.
CONVENTIONS = (AS_GIVEN, SEQ_MEAN, ROWS, HORIZON)


def _clip_bounds(config: Any) -> dict[str, Any]:
    """verl's ``clip_ratio_low`` / ``clip_ratio_high``, each falling back to ``clip_ratio``."""
    ratio = setting(config, "clip_ratio")
    low, high = setting(config, "clip_ratio_low"), setting(config, "clip_ratio_high")
    return dict(clip_low=ratio if low is None else low, clip_high=ratio if high is None else high)


def _vanilla_fields(config: Any) -> dict[str, Any]:
    # verl applies the dual clip always (clip_ratio_c, default 3.0) and asserts it is > 1.
    return dict(_clip_bounds(config), dual_clip=setting(config, "clip_ratio_c", 3.0))


def _sapo_fields(config: Any) -> dict[str, Any]:
    return dict(sapo_tau_pos=setting(config, "tau_pos"), sapo_tau_neg=setting(config, "tau_neg"))


def _no_fields(config: Any) -> dict[str, Any]:
    return {}


def _dro_fields(config: Any) -> dict[str, Any]:
    """DRO's −(A·logp − β/2·lr²): rlkernel's ``dro`` (the whole term weighted by rollout weights, as
    verl's)."""
    beta = setting(setting(config, "policy_loss", {}), "dro_beta")
    if not isinstance(beta, (int, float)) or isinstance(beta, bool):
        raise TypeError(f"policy_loss.dro_beta must be a number > 0 for loss_mode dro, got {beta!r}")
    if not beta > 0:
        # verl raises this too (a 0 or negative β would be a plain reinforce, or a reward for drift)
        raise ValueError(f"policy_loss.dro_beta must be > 0 for loss_mode dro, got {beta!r}")
    return dict(dro_beta=beta)


def _dppo_fields(config: Any) -> dict[str, Any]:
    # verl reads config.get("clip_ratio_c", 20.0): ActorConfig's default 3.0, 20.0 for a config without it
    return dict(_clip_bounds(config), dppo_ratio_cap=setting(config, "clip_ratio_c", 20.0))


def _nested(config: Any, name: str, default: float) -> Any:
    """``config.policy_loss.<name>``, verl's fallback when ``None`` (as its covariance losses read it)."""
    value = setting(setting(config, "policy_loss", {}), name)
    return default if value is None else value


def _clip_cov_fields(config: Any) -> dict[str, Any]:
    return dict(
        _clip_bounds(config),
        clip_cov_ratio=_nested(config, "clip_cov_ratio", 2e-4),
        clip_cov_lb=_nested(config, "clip_cov_lb", 1.0),
        clip_cov_ub=_nested(config, "clip_cov_ub", 5.0),
    )


def _kl_cov_fields(config: Any) -> dict[str, Any]:
    return dict(
        kl_cov_ratio=_nested(config, "kl_cov_ratio", 2e-4), kl_cov_coef=_nested(config, "ppo_kl_coef", 1.0)
    )


_CLIP_KEYS = {"clip_low": "clip_ratio_low (or clip_ratio)", "clip_high": "clip_ratio_high (or clip_ratio)"}


@dataclass(frozen=True, eq=False)  # compared and hashed by identity (a cache key; ``keys`` is a dict)
class LossMode:
    """One verl loss mode that rlkernel reproduces: a row of :data:`LOSS_MODES`.

    Attributes:
        verl_name: verl's ``loss_mode``; the registered name is ``"rk_" + verl_name``.
        loss_type: the :class:`PolicyLossConfig` loss type.
        fields: verl actor config → the other :class:`PolicyLossConfig` fields (clip bounds, …).
        keys: each of those fields → the actor setting it comes from (for error messages).
        metrics: verl's metrics of this mode, from :class:`MetricInputs`.
        run: for a mode that is not one :func:`policy_loss` call of a fixed loss type
            (``bypass_mode``: :mod:`.bypass`), the whole ``(loss, metrics)`` computation, called as
            :func:`compute` is; ``fields``, ``keys`` and ``metrics`` are then unused.
    """

    verl_name: str
    loss_type: str
    fields: Callable[[Any], dict[str, Any]] = _no_fields
    keys: Mapping[str, str] = dataclasses.field(default_factory=dict)
    metrics: Callable[[MetricInputs], dict[str, float]] | None = None
    run: Callable[..., tuple[torch.Tensor, dict[str, Any]]] | None = None

    @property
    def name(self) -> str:
        return f"rk_{self.verl_name}"


LOSS_MODES: tuple[LossMode, ...] = (
    LossMode("vanilla", "ppo", _vanilla_fields, {**_CLIP_KEYS, "dual_clip": "clip_ratio_c"}, metrics.vanilla),
    LossMode("gspo", "gspo_token", _clip_bounds, _CLIP_KEYS, metrics.gspo),
    LossMode(
        "sapo", "sapo", _sapo_fields, {"sapo_tau_pos": "tau_pos", "sapo_tau_neg": "tau_neg"}, metrics.sapo
    ),
    LossMode("cispo", "cispo", _clip_bounds, _CLIP_KEYS, metrics.cispo),
    LossMode("geo_mean", "gmpo", _clip_bounds, _CLIP_KEYS, metrics.geo_mean),
    LossMode("gpg", "reinforce", _no_fields, {}, metrics.gpg),
    LossMode("dro", "dro", _dro_fields, {"dro_beta": "policy_loss.dro_beta"}, metrics.dro),
    LossMode(
        "dppo_tv", "dppo_tv", _dppo_fields, {**_CLIP_KEYS, "dppo_ratio_cap": "clip_ratio_c"}, metrics.dppo_tv
    ),
    LossMode(
        "dppo_kl", "dppo_kl", _dppo_fields, {**_CLIP_KEYS, "dppo_ratio_cap": "clip_ratio_c"}, metrics.dppo_kl
    ),
    LossMode(
        "clip_cov",
        "clip_cov",
        _clip_cov_fields,
        {**_CLIP_KEYS, **{k: f"policy_loss.{k}" for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")}},
        metrics.clip_cov,
    ),
    LossMode(
        "kl_cov",
        "kl_cov",
        _kl_cov_fields,
        {"kl_cov_ratio": "policy_loss.kl_cov_ratio", "kl_cov_coef": "policy_loss.ppo_kl_coef"},
        metrics.kl_cov,
    ),
)


def loss_config(mode: LossMode, aggregation: str, norm_length: int | None, fields: tuple) -> PolicyLossConfig:
    """The :class:`PolicyLossConfig` of one call (``fields``: sorted ``(name, value)`` pairs)."""
    try:  # cached: every micro-batch of a run maps the same settings
        return _cached_loss_config(mode, aggregation, norm_length, fields)
    except TypeError:  # an unhashable setting (a list, …): build it to get the error that names it
        return _loss_config(mode, aggregation, norm_length, fields)


def _loss_config(
    mode: LossMode, aggregation: str, norm_length: int | None, fields: tuple
) -> PolicyLossConfig:
    values = dict(fields)
    try:
        return PolicyLossConfig(
            loss_type=mode.loss_type, aggregation=aggregation, norm_length=norm_length, **values
        )
    except (TypeError, ValueError) as error:
        named = ", ".join(f"actor.{mode.keys.get(k, k)}={v!r}" for k, v in values.items())
        raise type(error)(
            f"{mode.name}: verl's settings {named or '(none)'} map onto PolicyLossConfig(loss_type="
            f"{mode.loss_type!r}, {', '.join(f'{k}={v!r}' for k, v in values.items())}), which rejects "
            f"them: {error}"
        ) from error


_cached_loss_config = functools.lru_cache(maxsize=256)(_loss_config)


def _response_mask(mask: object, log_prob: torch.Tensor) -> torch.Tensor:
    """``response_mask`` as bool ``[B, T]``; an int/float mask must hold 0 and 1 only (verl
    multiplies by it, so other values would weigh tokens; one host sync), a bool mask costs none."""
    mask = check.mask_tensor("response_mask", mask)
    check.same_shape("response_mask", mask, "log_prob", log_prob.shape)
    check.same_device("response_mask", mask, "log_prob", log_prob.device)
    if mask.dtype == torch.bool:
        return mask
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(
            f"response_mask must hold 0 and 1 only (verl would weigh tokens by other values), got "
            f"{check.describe(mask)} with other values"
        )
    return mask != 0


@dataclass(frozen=True)
class Batch:
    """A micro-batch as verl passes it, validated: ``[B, T]`` tensors, the bool mask and verl's
    ``rollout_is_weights`` (``[B, T]`` float, detached; ``None``: none)."""

    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    weights: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        old_log_prob: object,
        log_prob: object,
        advantages: object,
        response_mask: object,
        rollout_is_weights: object = None,
    ) -> Batch:
        check.float_tensor("log_prob", log_prob)
        if log_prob.dim() != 2:
            raise ValueError(
                f"log_prob must be [B, T] (batch x response tokens), got {check.describe(log_prob)}"
            )
        check.float_like("old_log_prob", old_log_prob, "log_prob", log_prob)
        check.float_like("advantages", advantages, "log_prob", log_prob)
        if rollout_is_weights is not None:
            check.float_like("rollout_is_weights", rollout_is_weights, "log_prob", log_prob)
            rollout_is_weights = rollout_is_weights.detach()  # verl's are computed without gradient
        mask = _response_mask(response_mask, log_prob)
        return cls(old_log_prob, log_prob, advantages, mask, rollout_is_weights)


def compute(
    mode: LossMode, convention: Convention, loss_agg_mode: str, config: Any, batch: Batch
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``(pg_loss, pg_metrics)`` of ``mode`` under ``convention``, by :func:`policy_loss`.

    Raises:
        TypeError, ValueError: a setting or ``global_batch_info`` entry rlkernel rejects.
    """
    if mode.run is not None:
        return mode.run(mode, convention, loss_agg_mode, config, batch)
    info = GlobalBatchInfo.of(config, batch.log_prob.device)
    norm = convention.normalizers(loss_agg_mode, info, batch.log_prob.shape[0])
    fields = tuple(sorted(mode.fields(config).items()))
    cfg = loss_config(mode, norm.aggregation, norm.norm_length, fields)
    out = policy_loss(
        batch.log_prob,
        batch.old_log_prob,
        batch.advantages,
        batch.mask,
        cfg,
        global_tokens=norm.global_tokens,
        global_seqs=norm.global_seqs,
        rollout_weights=batch.weights,
    )
    loss = out.loss if norm.scale == 1 else out.loss * norm.scale
    detached = MetricInputs(
        batch.old_log_prob.detach(),
        batch.log_prob.detach(),
        batch.advantages.detach(),
        batch.mask,
        cfg,
        out.metrics,
    )
    return loss, mode.metrics(detached)


@dataclass(frozen=True)
class ModePlan:
    """What the registration decided for one mode (:mod:`.probe`).

    Attributes:
        mode: the row.
        default_agg: verl's default ``loss_agg_mode`` for this mode (its signature's).
        conventions: ``loss_agg_mode`` → the :class:`Convention` that reproduces verl.
        refused: ``loss_agg_mode`` → why none does (the message the loss raises).
        unavailable: why the whole mode cannot be reproduced (the loss raises it), or ``None``.
    """

    mode: LossMode
    default_agg: str
    conventions: Mapping[str, Convention]
    refused: Mapping[str, str]
    unavailable: str | None = None


def _convention(plan: ModePlan, loss_agg_mode: object) -> Convention:
    check.choice("loss_agg_mode", loss_agg_mode, VERL_AGG_MODES)
    if loss_agg_mode in plan.refused:
        raise RuntimeError(plan.refused[loss_agg_mode])
    return plan.conventions[loss_agg_mode]


def make_policy_loss_fn(plan: ModePlan) -> PolicyLossFn:
    """The verl policy-loss function of ``plan.mode`` (verl's signature, defaults and returns)."""
    mode = plan.mode

    def policy_loss_fn(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = plan.default_agg,
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        if plan.unavailable is not None:
            raise RuntimeError(plan.unavailable)
        if config is None:
            raise ValueError(
                f"config is required: {mode.name} reads verl's actor config (as verl's own loss)"
            )
        batch = Batch.of(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
        return compute(mode, _convention(plan, loss_agg_mode), loss_agg_mode, config, batch)

    policy_loss_fn.__name__ = policy_loss_fn.__qualname__ = f"compute_policy_loss_{mode.name}"
    policy_loss_fn.__doc__ = (
        f"verl's policy loss {mode.verl_name!r} (registered as {mode.name!r}), computed by "
        f"rlkernel.policy_loss with loss_type={mode.loss_type!r}: same arguments (old_log_prob, "
        "log_prob, advantages, response_mask: [B, T]; loss_agg_mode; config: the actor config; "
        "rollout_is_weights: [B, T] or None) and the same (loss, metrics) return as verl's."
    )
    return policy_loss_fn
