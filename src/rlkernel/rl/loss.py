"""``policy_loss``: the full RL objective of one micro-batch, from per-token log-probs to a scalar.

    ℓ_t  = w_t · policy_term_t  +  kl_coef · KL(logp_t, ref_logp_t)
    loss = agg(ℓ)  −  entropy_coef · agg(entropy)

where ``policy_term`` is the loss type's per-token term (:mod:`rlkernel.rl.objectives`), w the detached
rollout-correction weight (:mod:`rlkernel.rl.rollout`; 1 without correction), KL the per-token
estimator (:mod:`rlkernel.rl.kl`) and ``agg`` the configured aggregation with its global normalizers
(:mod:`rlkernel.rl.aggregate`).

Masking: a token is active where ``mask != 0``. Every input is passed through ``torch.where`` with the
mask before any arithmetic, so NaN/inf garbage at masked positions (padding, prompt tokens) never
reaches the loss or the gradients, masked tokens get exactly 0 gradient, and an all-masked batch
gives loss 0 and zero gradients, with or without global normalizers (a global normalizer of 0, the
count of a step that is all-masked everywhere, included).

Non-finite input: NaN, +inf or −inf at an *active* position of an input the loss reads (``logp``,
``advantages``, ``old_logp`` — except for ``reinforce``, whose loss −A·logp does not read it —,
``ref_logp`` when ``kl_coef > 0``, ``rollout_logp`` with a rollout correction, ``entropy`` when
``entropy_coef != 0``) gives a NaN loss, never a finite one. ±inf is turned into NaN before any
arithmetic: otherwise the log-ratio clamp (±20), the k3 clamps or a rollout weight truncated or
rejected to a finite value would absorb it. The metrics that read such an input are NaN too.

Metrics (detached 0-dim tensors, no host sync; over the active tokens of this call; 0 when none):

    clip_frac_low / clip_frac_high   fraction where the lower / upper clip is active (ppo, gspo*,
                                     gmpo: where the clipped branch is taken given sign(A);
                                     cispo: where the IS weight is clamped; sapo/reinforce: 0)
    clip_frac                        clip_frac_low + clip_frac_high
    clip_frac_dual                   (only with dual_clip) fraction where the dual clip is active
    approx_kl                        mean k3(logp, old_logp), the policy's drift since the rollout
    ratio_mean / ratio_min / ratio_max   of r = exp(clamp(logp − old_logp, ±20))
    kl_ref                           (with ref_logp) mean of the configured KL estimator
    entropy_mean                     (with entropy) mean entropy
    rollout_weight_mean              (with a rollout correction) mean of the applied weight
    rollout_frac_truncated           (TIS) fraction of tokens whose ρ was truncated
    rollout_frac_masked              (MIS) fraction of tokens whose ρ was rejected
    vespo_phi_mean                   (vespo) mean Gamma weight φ over the active tokens
    cov_frac                         (clip_cov / kl_cov) fraction of tokens cut / penalized

For ``gspo`` and ``gspo_token`` the clip fractions and ratio statistics are over sequences (those with
at least one active token) and about the sequence ratio s_i, the quantity that is clipped (``vespo``:
its ratio w_i, clip fractions 0). For ``dppo_*`` the clip fractions are the tokens outside the trust
region, by sign(A).

With ``cfg.kl_ratio_weighted`` the KL term (and ``kl_ref``) is KL·ρ, ρ the loss type's importance
ratio (:func:`rlkernel.rl.objectives.importance_ratio`, differentiable, as TRL's
``use_bias_correction_kl``).

Caveats:
    * Metrics are local to the call (micro-batch), not normalized globally; average them as you log.
    * ``rollout_logp`` is ignored when ``cfg.rollout_correction`` is ``None``.
    * ``clip_cov`` and ``kl_cov`` read counts and selections on the host (a sync, as verl), and
      ``clip_cov`` draws from torch's default CPU generator (:mod:`rlkernel.rl.covariance`).
    * Packed input whose token count equals its sequence count makes ``advantages`` of shape ``[N]``
      ambiguous; it is read per token (equal to per sequence when every sequence has one token).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlkernel import _validate as check
from rlkernel._autocast import without_autocast
from rlkernel.rl import objectives, rollout
from rlkernel.rl.aggregate import (
    Normalizer,
    Segments,
    aggregate,
    finite_or_nan,
    masked,
    masked_mean,
    seq_mean,
)
from rlkernel.rl.batch import LossBatch, validate_batch
from rlkernel.rl.config import PolicyLossConfig
from rlkernel.rl.kl import canonical_kl_estimator, kl_terms


class PolicyLossOutput:
    """The result of :func:`policy_loss`.

    Attributes:
        loss: 0-dim float32 (float64 for float64 ``logp``) tensor, differentiable in ``logp`` and
            ``entropy``.
        metrics: name → detached 0-dim tensor (see :mod:`rlkernel.rl.loss` for the names). Computed
            on first access, from detached copies of the step's tensors: a training loop that does
            not read them does not pay for their ~60 small kernel launches.
    """

    __slots__ = ("loss", "_metrics", "_compute")

    def __init__(
        self,
        loss: torch.Tensor,
        metrics: dict[str, torch.Tensor] | None = None,
        *,
        compute_metrics: Callable[[], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        if (metrics is None) == (compute_metrics is None):
            raise TypeError("PolicyLossOutput needs exactly one of metrics or compute_metrics")
        self.loss = loss
        self._metrics = metrics
        self._compute = compute_metrics

    @property
    def metrics(self) -> dict[str, torch.Tensor]:
        if self._metrics is None:
            self._metrics = self._compute()
            self._compute = None  # drop the references to the step's tensors
        return self._metrics

    def __repr__(self) -> str:
        return f"PolicyLossOutput(loss={self.loss!r})"


@dataclass(frozen=True)
class _Batch:
    """Validated inputs on the padded ``[S, L]`` layout, sanitized at masked positions."""

    segments: Segments
    mask: torch.Tensor
    logp: torch.Tensor
    old_logp: torch.Tensor
    adv: torch.Tensor
    adv_seq: torch.Tensor
    ref_logp: torch.Tensor | None
    rollout_logp: torch.Tensor | None
    entropy: torch.Tensor | None


def _advantages(batch: LossBatch, mask: torch.Tensor, dtype: torch.dtype):
    """(per-token ``[S, L]``, per-sequence ``[S]``) advantages, detached and sanitized."""
    adv, seg = batch.advantages.detach(), batch.segments
    if not batch.advantages_per_seq:
        tokens = masked(finite_or_nan(seg.to_padded(adv).to(dtype)), mask)
        return tokens, seq_mean(tokens, mask)
    per_seq = masked(finite_or_nan(adv.to(dtype)), mask.any(-1))
    return masked(per_seq[:, None].expand(mask.shape), mask), per_seq


def _padded_batch(logp: torch.Tensor, entropy: torch.Tensor | None, batch: LossBatch) -> _Batch:
    """The validated inputs on the padded ``[S, L]`` layout, sanitized at masked positions."""
    seg, cfg = batch.segments, batch.cfg
    dtype = torch.float64 if logp.dtype == torch.float64 else torch.float32
    active = seg.to_padded(batch.mask != 0, fill=False)

    def padded(x: torch.Tensor | None, *, constant: bool = True) -> torch.Tensor | None:
        # ±inf at an active position becomes NaN (the clamps of the algebra would hide it).
        if x is None:
            return None
        x = x.detach() if constant else x
        return masked(finite_or_nan(seg.to_padded(x).to(dtype)), active)

    adv, adv_seq = _advantages(batch, active, dtype)
    return _Batch(
        segments=seg,
        mask=active,
        logp=padded(logp, constant=False),
        old_logp=padded(batch.old_logp),
        adv=adv,
        adv_seq=adv_seq,
        ref_logp=padded(batch.ref_logp),
        rollout_logp=padded(batch.rollout_logp) if cfg.rollout_correction is not None else None,
        entropy=padded(entropy, constant=False),
    )


@without_autocast
def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: PolicyLossConfig,
    *,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    global_tokens: Normalizer | int = None,
    global_seqs: Normalizer | int = None,
    cu_seqlens: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """The RL policy loss of one micro-batch, and its metrics.

    Args:
        logp: ``[B, T]`` padded, or ``[N]`` packed with ``cu_seqlens``; float log-probs of the sampled
            tokens under the current policy (differentiable).
        old_logp: log-probs under the policy that produced the batch (the trainer's, before the
            update); same shape/device as ``logp``; constant.
        advantages: float, one per sequence (``[B]`` / ``[S]``) or one per token (the shape of
            ``logp``); constant.
        mask: bool/int/float, the shape of ``logp``; a token is active where ``mask != 0``.
        cfg: the objective (:class:`PolicyLossConfig`).
        ref_logp: reference-policy log-probs, required when ``cfg.kl_coef > 0``; constant.
        rollout_logp: the rollout engine's log-probs, required when ``cfg.rollout_correction`` is
            set; constant.
        entropy: per-token entropy (differentiable), required when ``cfg.entropy_coef != 0``.
        global_tokens: normalizer of ``token-mean`` for the whole step (int, float or 0-dim tensor,
            >= 0); the local active-token count when ``None``. 0 (a step with no active token on
            any rank) gives loss 0 for this all-masked call; a tensor that is 0 while this call has
            active tokens, negative or not finite gives a NaN loss (it cannot be checked on the
            host without a sync).
        global_seqs: normalizer of the ``seq-mean-*`` modes for the whole step (same rules); the
            local count of sequences with an active token when ``None``.
        cu_seqlens: int ``[S + 1]`` cumulative lengths (0, …, N) for packed input; ``None`` for
            padded input.

    Returns:
        :class:`PolicyLossOutput`: ``loss`` (0-dim, float32, or float64 for float64 ``logp``) and
        ``metrics`` (detached 0-dim tensors).

    Raises:
        TypeError: a non-tensor or wrong-dtype input, ``cfg`` not a ``PolicyLossConfig``.
        ValueError: shape/device mismatches, bad ``cu_seqlens``, a missing ``ref_logp`` /
            ``entropy`` / ``rollout_logp`` that ``cfg`` needs, a negative or non-finite number as
            a normalizer.
    """
    check.float_tensor("logp", logp)
    batch = validate_batch(
        cfg,
        logp,
        old_logp=old_logp,
        advantages=advantages,
        mask=mask,
        ref_logp=ref_logp,
        rollout_logp=rollout_logp,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        cu_seqlens=cu_seqlens,
    )
    if entropy is not None:
        check.float_like("entropy", entropy, "logp", logp)
    return loss_from_batch(logp, entropy, batch)


def loss_from_batch(logp: torch.Tensor, entropy: torch.Tensor | None, inputs: LossBatch) -> PolicyLossOutput:
    """:func:`policy_loss` of ``logp`` (and ``entropy``) with already validated inputs.

    Args:
        logp: float, ``inputs.token_shape``, on ``inputs.device`` (checked by the caller).
        entropy: the same shape, or None; required when ``cfg.entropy_coef != 0``.
        inputs: from :func:`rlkernel.rl.batch.validate_batch`.
    """
    cfg = inputs.cfg
    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError(f"entropy is required when cfg.entropy_coef != 0 (entropy_coef={cfg.entropy_coef})")
    batch = _padded_batch(logp, entropy, inputs)
    global_tokens, global_seqs = inputs.global_tokens, inputs.global_seqs

    def agg(per_token: torch.Tensor) -> torch.Tensor:
        return aggregate(
            per_token,
            batch.mask,
            cfg.aggregation,
            global_tokens=global_tokens,
            global_seqs=global_seqs,
            norm_length=cfg.norm_length,
            width=batch.segments.max_len,
        )

    weights = None
    if cfg.rollout_correction is not None:
        weights = rollout.rollout_weights(
            batch.old_logp,
            batch.rollout_logp,
            batch.mask,
            cfg.rollout_correction,
            cfg.rollout_clip_min,
            cfg.rollout_clip_max,
            per_sequence=cfg.loss_type in objectives.ROLLOUT_PER_SEQUENCE,
        )
    term = objectives.policy_term(
        cfg, batch.logp, batch.old_logp, batch.adv, batch.adv_seq, batch.mask, rollout_w=weights
    )
    per_token = term.loss
    if weights is not None and not term.rollout_folded:
        per_token = per_token * weights.weight
    kl = None
    if batch.ref_logp is not None and cfg.kl_coef > 0:
        kl = _kl(cfg, batch, batch.logp)
        per_token = per_token + cfg.kl_coef * kl
    loss = agg(per_token)
    if cfg.entropy_coef != 0:
        loss = loss - cfg.entropy_coef * agg(batch.entropy)
    return PolicyLossOutput(loss, compute_metrics=lambda: _metrics(cfg, batch, term, kl, weights))


def _kl(cfg: PolicyLossConfig, batch: _Batch, logp: torch.Tensor) -> torch.Tensor:
    """``[S, L]``: the configured KL estimator of ``logp`` against ``ref_logp``; with
    ``cfg.kl_ratio_weighted``, times the loss type's importance ratio (differentiable, as TRL's
    ``use_bias_correction_kl``)."""
    kl = kl_terms(logp, batch.ref_logp, canonical_kl_estimator(cfg.kl_estimator, "cfg.kl_estimator"))
    if cfg.kl_ratio_weighted:
        kl = kl * objectives.importance_ratio(cfg, logp, batch.old_logp, batch.mask)
    return kl


@torch.no_grad()
def _metrics(cfg, batch: _Batch, term, kl, weights) -> dict[str, torch.Tensor]:
    m = batch.mask
    low = masked_mean(term.clipped_low.to(batch.logp.dtype), term.ratio_mask)
    high = masked_mean(term.clipped_high.to(batch.logp.dtype), term.ratio_mask)
    metrics = {"clip_frac_low": low, "clip_frac_high": high, "clip_frac": low + high}
    if term.clipped_dual is not None:
        metrics["clip_frac_dual"] = masked_mean(term.clipped_dual.to(batch.logp.dtype), m)
    logp, old = batch.logp.detach(), batch.old_logp
    metrics["approx_kl"] = masked_mean(kl_terms(logp, old, "k3"), m)
    metrics.update(_ratio_stats(term.ratio, term.ratio_mask))
    for name, values, valid in term.extra:
        metrics[name] = masked_mean(values.to(batch.logp.dtype), valid)
    if batch.ref_logp is not None:
        if kl is None:  # ref_logp given for monitoring only (kl_coef == 0)
            kl = _kl(cfg, batch, logp)
        metrics["kl_ref"] = masked_mean(kl.detach(), m)
    if batch.entropy is not None:
        metrics["entropy_mean"] = masked_mean(batch.entropy.detach(), m)
    if weights is not None:
        metrics["rollout_weight_mean"] = masked_mean(weights.weight, m)
        name = "rollout_frac_truncated" if cfg.rollout_correction.endswith("tis") else "rollout_frac_masked"
        metrics[name] = masked_mean(weights.changed.to(batch.logp.dtype), m)
    return metrics


def _ratio_stats(ratio: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean/min/max of ``ratio`` over ``valid``; all 0 when nothing is valid (no host sync)."""
    any_valid = valid.any()
    inf = torch.full((), float("inf"), dtype=ratio.dtype, device=ratio.device)
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    smallest = torch.where(valid, ratio, inf).amin() if ratio.numel() else inf
    largest = torch.where(valid, ratio, -inf).amax() if ratio.numel() else -inf
    return {
        "ratio_mean": masked_mean(ratio, valid),
        "ratio_min": torch.where(any_valid, smallest, zero),
        "ratio_max": torch.where(any_valid, largest, zero),
    }
