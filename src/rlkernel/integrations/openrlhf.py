"""OpenRLHF's policy loss, computed by :func:`rlkernel.policy_loss` (docs/integrations/openrlhf.md).

    from rlkernel.integrations.openrlhf import PolicyLoss   # instead of openrlhf.models.loss's

:class:`PolicyLoss` takes the constructor parameters of OpenRLHF 0.11.2's
``openrlhf.models.loss.PolicyLoss``, and its ``forward`` takes the same arguments and returns the same
five values, ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``. The constructor maps the
settings onto a :class:`rlkernel.PolicyLossConfig` once; ``forward`` runs :func:`rlkernel.policy_loss`
with OpenRLHF's normalizers. A setting whose loss rlkernel cannot reproduce exactly raises
``ValueError`` at construction, never a different number later.

    OpenRLHF 0.11.2                              PolicyLossConfig / policy_loss
    policy_loss_type="ppo" | "gspo"              loss_type="ppo" | "gspo"
    clip_eps_low, clip_eps_high                  clip_low, clip_high
    dual_clip=c (ppo)                            dual_clip=c
    token_level_loss=True                        aggregation="token-mean"
    token_level_loss=False, or gspo              aggregation="seq-mean-token-mean"
    is_correction_level="token",                 rollout_correction="token_tis" (mode "clip")
      is_correction_gating="ratio",                or "token_mis" (mode "mask");
      is_correction_threshold=(low, high)          rollout_clip_min=low (None if low <= 0),
                                                   rollout_clip_max=high (None if high is inf)
    gspo with is_correction_level != "off"       old_logp=rollout_log_probs (OpenRLHF's gspo takes
                                                   its ratio against the rollout policy then)
    forward(batch_num_tokens=n, dp_size=d)       global_tokens=n, loss × d   (token mode)
    forward(global_batch_size=g, dp_size=d)      global_seqs=g, loss × d     (sequence mode)

Not supported (``ValueError`` at construction): ``dual_clip`` with gspo (rlkernel's dual clip is
ppo's), ``is_correction_level="seq"`` with ppo (OpenRLHF rejects sequences by their geometric-mean
ratio and keeps per-token weights; rlkernel's ``seq_*`` corrections weigh by the sequence product),
``is_correction_gating="binary_kl" | "tv"`` with ppo (no divergence gate in rlkernel), and a
correction window ``(<= 0, inf)`` (an unbounded weight). Version: OpenRLHF 0.11.2 only (its
``PolicyLoss`` constructor and correction changed from 0.11.1 to 0.11.2); construction raises
``RuntimeError`` when another version is installed. OpenRLHF itself is never imported.

Exactness, measured against OpenRLHF 0.11.2 on random ragged batches (``tests/integrations``): ppo,
with every aggregation, normalizer, dual clip and correction, gives bitwise equal losses and
gradients in float32 and float64. gspo agrees to rounding (≤ 1e-6): OpenRLHF applies the sequence
ratio to each token's advantage, rlkernel's gspo to the sequence's mean advantage, which is the same
function when a sequence's advantages share one sign. A sequence with both signs is therefore split
into its positive and its negative part, two ``policy_loss`` calls whose sum is OpenRLHF's loss.

Caveats:
    * An all-masked micro-batch without ``batch_num_tokens`` / ``global_batch_size`` gives loss 0 and
      metrics 0 here; OpenRLHF divides 0 by 0 (NaN). With them (OpenRLHF's actor always passes
      them) both give 0.
    * gspo: rlkernel bounds the sequence log-ratio at 10 (verl's guard, s ≤ e^10); OpenRLHF does
      not. The two differ only for a sequence whose mean log-ratio exceeds 10 and whose advantage
      is negative (OpenRLHF's loss grows as s, rlkernel's stops at e^10), a policy that moved by a
      factor above 22,026 per token since the rollout.
    * ``old_log_probs``, ``advantages`` and ``rollout_log_probs`` are constants (no gradient flows
      to them), as in rlkernel; OpenRLHF passes them detached.
    * The loss is computed in float32 (float64 for float64 ``log_probs``) whatever the dtypes of the
      inputs, as every rlkernel loss; OpenRLHF follows PyTorch's type promotion (a bf16
      ``log_probs`` gives a bf16 loss there). The metrics follow OpenRLHF's dtypes.
    * NaN/±inf at an active position gives a NaN loss (rlkernel's policy), including NaN
      ``rollout_log_probs`` that OpenRLHF's mask-mode correction would drop silently; garbage at
      masked positions is ignored (OpenRLHF multiplies it by 0, which keeps NaN).
"""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rlkernel import _validate as check
from rlkernel.rl import PolicyLossConfig, policy_loss
from rlkernel.rl.objectives import LOG_RATIO_BOUND

__all__ = ["PolicyLoss"]

# The OpenRLHF releases whose PolicyLoss this module reproduces; CI compares it with the first.
TESTED_VERSIONS: tuple[str, ...] = ("0.11.2",)

POLICY_LOSS_TYPES = ("ppo", "gspo")
CORRECTION_LEVELS = ("off", "token", "seq")
CORRECTION_MODES = ("mask", "clip")
CORRECTION_GATINGS = ("ratio", "binary_kl", "tv")
# OpenRLHF's ppo clamps the log-ratio to ±20 before the exponential, rlkernel's LOG_RATIO_BOUND.


def _installed_version() -> str | None:
    """The installed ``openrlhf`` distribution's version, or ``None`` (read from its metadata: the
    package itself is never imported)."""
    try:
        return importlib.metadata.version("openrlhf")
    except importlib.metadata.PackageNotFoundError:
        return None


def _check_version(installed: str | None) -> None:
    """Raise unless ``installed`` is a tested OpenRLHF version or ``None`` (OpenRLHF not installed:
    the loss is then 0.11.2's, as documented)."""
    if installed is None or installed in TESTED_VERSIONS:
        return
    raise RuntimeError(
        f"rlkernel.integrations.openrlhf.PolicyLoss reproduces OpenRLHF {', '.join(TESTED_VERSIONS)} "
        f"(tested against it in CI); the installed openrlhf is {installed}, whose PolicyLoss may take "
        f"other settings or compute another loss (0.11.1 -> 0.11.2 changed its constructor). Install "
        f"openrlhf=={TESTED_VERSIONS[-1]}, or use rlkernel.policy_loss with a PolicyLossConfig directly."
    )


def _threshold(value: object) -> tuple[float, float]:
    """``is_correction_threshold`` as ``(low, high)``: two numbers, not NaN."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"is_correction_threshold must be a pair (low, high) of numbers, got {value!r}")
    low, high = (check.real("is_correction_threshold", v) for v in value)
    if math.isnan(low) or math.isnan(high):
        raise ValueError(f"is_correction_threshold must not be NaN, got {value!r}")
    return low, high


@dataclass(frozen=True)
class _Plan:
    """What the constructor decided, once.

    Attributes:
        config: the objective :func:`rlkernel.policy_loss` runs.
        ratio_against_rollout: gspo with a correction level: the ratio is taken against
            ``rollout_log_probs`` (OpenRLHF's gspo), which then stands in for ``old_logp``.
        window: ``(mode, low, high)`` of a ppo correction, as OpenRLHF gave them (for its
            ``is_filter_ratio`` metric), or ``None``.
    """

    config: PolicyLossConfig
    ratio_against_rollout: bool
    window: tuple[str, float, float] | None


def _plan(
    clip_eps_low: object,
    clip_eps_high: object,
    dual_clip: object,
    token_level_loss: object,
    policy_loss_type: object,
    level: object,
    mode: object,
    gating: object,
    threshold: object,
) -> _Plan:
    """Validate OpenRLHF's constructor settings and map them onto a :class:`PolicyLossConfig`."""
    check.choice("policy_loss_type", policy_loss_type, POLICY_LOSS_TYPES)
    check.boolean("token_level_loss", token_level_loss)
    check.nonneg_float("clip_eps_low", clip_eps_low)
    check.nonneg_float("clip_eps_high", clip_eps_high)
    if dual_clip is not None and check.positive_float("dual_clip", dual_clip) <= 1.0:
        raise ValueError(f"dual_clip must be > 1.0, got {dual_clip}")
    # OpenRLHF's own checks (its constructor raises for these too).
    check.choice("is_correction_level", level, CORRECTION_LEVELS)
    check.choice("is_correction_mode", mode, CORRECTION_MODES)
    check.choice("is_correction_gating", gating, CORRECTION_GATINGS)
    if mode == "clip" and (level == "seq" or gating != "ratio"):
        raise ValueError(
            "is_correction_mode='clip' requires is_correction_level='token' and is_correction_gating='ratio'"
        )
    low = high = None
    if level != "off":
        low, high = _threshold(threshold)
        if gating != "ratio" and low > 0:
            raise ValueError(
                f"is_correction_gating={gating!r} takes an upper bound only: is_correction_threshold must "
                f"be (0, delta), got {threshold!r}"
            )

    gspo = policy_loss_type == "gspo"
    if gspo and dual_clip is not None:
        raise ValueError(
            "dual_clip with policy_loss_type='gspo' is not supported: rlkernel's dual clip is ppo's (a "
            "per-token bound), OpenRLHF applies it to the sequence ratio; use dual_clip=None with gspo"
        )
    fields: dict[str, object] = {}
    window = None
    # OpenRLHF's gspo ignores mode, gating and threshold: a correction level only moves its ratio
    # onto the rollout policy (handled in forward). Only ppo multiplies the loss by a weight.
    if level != "off" and not gspo:
        if gating != "ratio":
            raise ValueError(
                f"is_correction_gating={gating!r} is not supported: rlkernel's rollout correction gates on "
                "the importance ratio only, not on a divergence; use is_correction_gating='ratio'"
            )
        if level == "seq":
            raise ValueError(
                "is_correction_level='seq' is not supported: OpenRLHF rejects a sequence by its "
                "geometric-mean ratio and keeps per-token weights, rlkernel's sequence corrections weigh "
                "by the sequence product; use is_correction_level='token'"
            )
        if high <= 0 or low > high:
            raise ValueError(
                f"is_correction_threshold must be (low, high), low <= high, high > 0; got {threshold!r}"
            )
        # ρ = exp(·) >= 0: a lower bound <= 0 clamps or rejects nothing, an upper bound of inf neither.
        fields = dict(
            rollout_correction="token_tis" if mode == "clip" else "token_mis",
            rollout_clip_min=None if low <= 0 else low,
            rollout_clip_max=None if high == math.inf else high,
        )
        if fields["rollout_clip_min"] is None and fields["rollout_clip_max"] is None:
            raise ValueError(
                f"is_correction_threshold={threshold!r} bounds nothing (an unbounded importance weight); "
                "rlkernel's corrections need a bound: give a low > 0 or a finite high"
            )
        window = (mode, low, high)
    config_fields = dict(
        loss_type=policy_loss_type,
        clip_low=clip_eps_low,
        clip_high=clip_eps_high,
        dual_clip=dual_clip,
        # OpenRLHF's gspo always aggregates per sample, whatever token_level_loss says.
        aggregation="token-mean" if token_level_loss and not gspo else "seq-mean-token-mean",
        **fields,
    )
    try:
        config = PolicyLossConfig(**config_fields)
    except (TypeError, ValueError) as error:
        raise type(error)(
            f"these OpenRLHF settings map onto PolicyLossConfig({config_fields}), which rejects them: {error}"
        ) from error
    return _Plan(config=config, ratio_against_rollout=gspo and level != "off", window=window)


def _active(action_mask: object, log_probs: torch.Tensor) -> torch.Tensor:
    """``action_mask`` as a bool ``[B, T]`` tensor (``None``: every token is active).

    OpenRLHF multiplies by the mask, so a fractional value would weigh a token; rlkernel only tells
    active from masked. OpenRLHF's masks are bool; an int or float mask is checked to be 0/1 (one
    host sync) rather than silently read as ``!= 0``.
    """
    if action_mask is None:
        return torch.ones(log_probs.shape, dtype=torch.bool, device=log_probs.device)
    mask = check.mask_tensor("action_mask", action_mask)
    check.same_shape("action_mask", mask, "log_probs", log_probs.shape)
    check.same_device("action_mask", mask, "log_probs", log_probs.device)
    if mask.dtype == torch.bool:
        return mask
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(
            f"action_mask must hold 0 and 1 only (OpenRLHF would weigh tokens by other values), got "
            f"{check.describe(mask)} with other values"
        )
    return mask != 0


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """OpenRLHF's ``masked_mean(x, mask, dim=None)``, but 0 (not 0/0) when nothing is active and
    blind to garbage at masked positions."""
    return torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)


class PolicyLoss(nn.Module):
    """OpenRLHF 0.11.2's ``PolicyLoss`` (ppo and gspo), computed by :func:`rlkernel.policy_loss`.

    Args:
        clip_eps_low: ε_low >= 0, the ratio's lower clip 1 − ε_low.
        clip_eps_high: ε_high >= 0, the upper clip 1 + ε_high.
        dual_clip: dual-clip constant c > 1 (ppo only), or ``None``.
        token_level_loss: ``True``: the masked token mean of the batch; ``False``: the mean over
            sequences of each sequence's token mean (forced for gspo, as OpenRLHF does).
        policy_loss_type: ``"ppo"`` or ``"gspo"``.
        is_correction_level: ``"off"``, ``"token"`` (or ``"seq"``: not supported with ppo).
        is_correction_mode: ``"clip"`` (truncate ρ into the window) or ``"mask"`` (weight 0 outside).
        is_correction_gating: ``"ratio"`` (``"binary_kl"`` / ``"tv"``: not supported with ppo).
        is_correction_threshold: ``(low, high)``, the window on ρ = π_old / π_rollout.

    Raises:
        RuntimeError: an installed OpenRLHF that is not a tested version (``TESTED_VERSIONS``).
        TypeError: a setting of the wrong type (e.g. a non-bool ``token_level_loss``).
        ValueError: a setting OpenRLHF rejects, or one rlkernel cannot reproduce exactly (module
            docstring); the message names the setting.

    The settings are read-only attributes of the same names; ``config`` is the
    :class:`rlkernel.PolicyLossConfig` they map onto.
    """

    def __init__(
        self,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        dual_clip: float | None = None,
        token_level_loss: bool = True,
        policy_loss_type: str = "ppo",
        is_correction_level: str = "off",
        is_correction_mode: str = "mask",
        is_correction_gating: str = "ratio",
        is_correction_threshold: Sequence[float] = (0.5, 5.0),
    ) -> None:
        super().__init__()
        _check_version(_installed_version())
        self._plan = _plan(
            clip_eps_low,
            clip_eps_high,
            dual_clip,
            token_level_loss,
            policy_loss_type,
            is_correction_level,
            is_correction_mode,
            is_correction_gating,
            is_correction_threshold,
        )
        self._settings = dict(
            clip_eps_low=clip_eps_low,
            clip_eps_high=clip_eps_high,
            dual_clip=dual_clip,
            token_level_loss=token_level_loss and policy_loss_type != "gspo",
            policy_loss_type=policy_loss_type,
            is_correction_level=is_correction_level,
            is_correction_mode=is_correction_mode,
            is_correction_gating=is_correction_gating,
            is_correction_threshold=is_correction_threshold,
        )

    # OpenRLHF's attributes, read-only: assigning one would not change the mapped config.
    clip_eps_low = property(lambda self: self._settings["clip_eps_low"])
    clip_eps_high = property(lambda self: self._settings["clip_eps_high"])
    dual_clip = property(lambda self: self._settings["dual_clip"])
    token_level_loss = property(lambda self: self._settings["token_level_loss"])
    policy_loss_type = property(lambda self: self._settings["policy_loss_type"])
    is_correction_level = property(lambda self: self._settings["is_correction_level"])
    is_correction_mode = property(lambda self: self._settings["is_correction_mode"])
    is_correction_gating = property(lambda self: self._settings["is_correction_gating"])
    is_correction_threshold = property(lambda self: self._settings["is_correction_threshold"])

    @property
    def config(self) -> PolicyLossConfig:
        """The :class:`rlkernel.PolicyLossConfig` the settings map onto."""
        return self._plan.config

    def extra_repr(self) -> str:
        return f"config={self.config}"

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: torch.Tensor | None = None,
        rollout_log_probs: torch.Tensor | None = None,
        dp_size: int = 1,
        batch_num_tokens: float | torch.Tensor | None = None,
        global_batch_size: float | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The policy loss of one micro-batch and OpenRLHF's four statistics.

        Args:
            log_probs: float ``[B, T]``, the current policy's log-probs of the response tokens
                (differentiable).
            old_log_probs: float ``[B, T]``, the log-probs when the batch was made; constant.
            advantages: float ``[B, T]``, one per token; constant.
            action_mask: bool ``[B, T]`` (or int/float holding 0 and 1), the response tokens;
                ``None``: every token.
            rollout_log_probs: float ``[B, T]``, the rollout engine's log-probs; required with a
                correction level, ignored without one; constant.
            dp_size: int >= 1, the data-parallel world size; multiplies the loss when the
                normalizer of the mode is given (OpenRLHF's compensation for gradient averaging).
            batch_num_tokens: token mode's normalizer, the step's active-token count over all
                micro-batches and ranks (number >= 0 or 0-dim tensor); the local count when ``None``.
            global_batch_size: sequence mode's normalizer, the step's count of sequences with
                tokens; the local count when ``None``.

        Returns:
            ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``: ``loss`` a 0-dim float32
            (float64 for float64 ``log_probs``) tensor, differentiable in ``log_probs``;
            ``clip_ratio`` (float32) the fraction of active tokens whose clipped branch is taken;
            ``ppo_kl`` the mean of old − new log-prob; ``vllm_kl`` the mean of rollout − old
            log-prob and ``is_filter_ratio`` (float32) the fraction of tokens outside the window,
            both ``None`` without a ppo correction. Statistics are detached means over the active
            tokens (0 when there are none).

        Raises:
            TypeError: a non-tensor or non-float input, a non-int ``dp_size``.
            ValueError: shapes (``[B, T]`` for all), devices, a non-0/1 mask, a missing
                ``rollout_log_probs``, ``dp_size`` < 1, a negative or non-finite normalizer.
        """
        check.float_tensor("log_probs", log_probs)
        if log_probs.dim() != 2:
            raise ValueError(
                f"log_probs must be [B, T] (batch x response tokens), got {check.describe(log_probs)}"
            )
        check.float_like("old_log_probs", old_log_probs, "log_probs", log_probs)
        check.float_like("advantages", advantages, "log_probs", log_probs)
        mask = _active(action_mask, log_probs)
        check.positive_int("dp_size", dp_size)
        batch_num_tokens = check.normalizer("batch_num_tokens", batch_num_tokens, log_probs.device)
        global_batch_size = check.normalizer("global_batch_size", global_batch_size, log_probs.device)
        plan, cfg = self._plan, self._plan.config
        if plan.ratio_against_rollout or cfg.rollout_correction is not None:
            if rollout_log_probs is None:
                raise ValueError(
                    f"rollout_log_probs is required with is_correction_level={self.is_correction_level!r}"
                )
            check.float_like("rollout_log_probs", rollout_log_probs, "log_probs", log_probs)

        token_mode = cfg.aggregation == "token-mean"
        normalizer = batch_num_tokens if token_mode else global_batch_size
        options = dict(global_tokens=normalizer) if token_mode else dict(global_seqs=normalizer)
        if cfg.rollout_correction is not None:
            options["rollout_logp"] = rollout_log_probs
        base = rollout_log_probs if plan.ratio_against_rollout else old_log_probs
        if cfg.loss_type == "gspo":
            loss = self._gspo_loss(log_probs, base, advantages, mask, options)
        else:
            loss = policy_loss(log_probs, base, advantages, mask, cfg, **options).loss
        if normalizer is not None:  # OpenRLHF scales by dp_size only with a global normalizer
            loss = loss * dp_size
        return (loss, *self._statistics(log_probs, old_log_probs, base, advantages, mask, rollout_log_probs))

    def _gspo_loss(self, log_probs, base, advantages, mask, options) -> torch.Tensor:
        """OpenRLHF's gspo: ℓ_it = −min(s_i·A_it, clip(s_i)·A_it), per-sample aggregated.

        rlkernel's gspo uses the sequence's mean advantage Ā_i: for A_it of one sign that is the
        same loss (−A·min(s, clip(s)) for A >= 0, −A·max(s, clip(s)) for A <= 0, linear in A), so a
        sequence whose advantages have both signs is split into its positive and negative parts
        and the aggregation, linear too, adds the two calls. Sequences of one sign stay whole in
        the first call (the second sees A = 0 there), so the usual outcome-reward case (A constant
        per sequence) is one ordinary gspo call plus an exact 0. No host sync either way.
        """
        cfg = self._plan.config
        adv = advantages.detach()
        mixed = (((adv > 0) & mask).any(-1) & ((adv < 0) & mask).any(-1))[:, None]
        first = torch.where(mixed, adv.clamp(min=0), adv)
        second = torch.where(mixed, adv.clamp(max=0), 0.0)
        one = policy_loss(log_probs, base, first, mask, cfg, **options).loss
        return one + policy_loss(log_probs, base, second, mask, cfg, **options).loss

    @torch.no_grad()
    def _statistics(self, log_probs, old_log_probs, base, advantages, mask, rollout_log_probs):
        """OpenRLHF's ``clip_ratio``, ``ppo_kl``, ``vllm_kl``, ``is_filter_ratio`` (detached)."""
        cfg, window = self._plan.config, self._plan.window
        logp, old = log_probs.detach(), old_log_probs.detach()
        log_ratio = logp - old
        if cfg.loss_type == "gspo":  # the sequence ratio on every token of the sequence
            seq_log_ratio = torch.where(mask, logp - base.detach(), 0.0).sum(-1) / mask.sum(-1).clamp(min=1)
            ratio = seq_log_ratio.exp()[:, None]
        else:
            ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
        unclipped = ratio * advantages
        clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * advantages
        clip_ratio = _masked_mean((clipped < unclipped).float(), mask)
        ppo_kl = _masked_mean(-log_ratio, mask)
        if window is None:
            return clip_ratio, ppo_kl, None, None
        mode, low, high = window
        rollout = rollout_log_probs.detach()
        rho = (old - rollout).exp()
        if mode == "clip":
            filtered = (rho < low) | (rho > high)
        else:  # a NaN ρ counts as filtered in mask mode, as OpenRLHF's ~keep does
            filtered = ~((rho >= low) & (rho <= high))
        return clip_ratio, ppo_kl, _masked_mean(rollout - old, mask), _masked_mean(filtered.float(), mask)
