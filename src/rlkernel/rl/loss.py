"""``policy_loss``: the full RL objective of one micro-batch, from per-token log-probs to a scalar.

    ℓ_t  = o_t · e_t · w_t · policy_term_t  +  kl_coef · KL(logp_t, ref_logp_t)
    loss = agg_m'(ℓ)  −  entropy_coef · agg_m'(e · entropy)

where ``policy_term`` is the loss type's per-token term (:mod:`rlkernel.rl.objectives`), w the detached
rollout weight (a correction's, :mod:`rlkernel.rl.rollout`, or the given ``rollout_weights``; 1
without), o and e the off-policy sequence mask and the top-entropy-quantile mask
(:mod:`rlkernel.rl.masks`; 1 when off), KL the per-token estimator (:mod:`rlkernel.rl.kl`) and
``agg_m'`` the configured aggregation with its global normalizers (:mod:`rlkernel.rl.aggregate`)
over m' = the mask less the tokens rollout rejection (``cfg.rollout_rs``) removed (m' = m without
it). o and e keep the token in m' (it still counts in the normalizers); rejection removes it.

On-policy (``old_logp=None``): old_logp = sg[logp] everywhere (ratio 1 in value, its gradient that
of logp; rollout weights, rejection and the off-policy mask read sg[logp] as the old log-probs).

Masking: a token is active where ``mask != 0``. Every input is passed through ``torch.where`` with the
mask before any arithmetic, so NaN/inf garbage at masked positions (padding, prompt tokens) never
reaches the loss or the gradients, masked tokens get exactly 0 gradient, and an all-masked batch
gives loss 0 and zero gradients, with or without global normalizers (a global normalizer of 0, the
count of a step that is all-masked everywhere, included).

Non-finite input: NaN, +inf or −inf at an *active* position of an input the loss reads (``logp``,
``advantages``, ``old_logp`` — except for ``reinforce``, whose loss −A·logp does not read it —,
``ref_logp`` when ``kl_coef > 0``, ``rollout_logp`` with a rollout correction, rejection or the
off-policy mask, ``rollout_weights``, ``entropy`` when ``entropy_coef != 0`` or
``top_entropy_quantile < 1``) gives a NaN loss, never a finite one. ±inf is turned into NaN before any
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
    rollout_weight_mean              (a correction or rollout_weights) mean of the applied weight
    rollout_frac_truncated           (TIS) fraction of tokens whose ρ was truncated
    rollout_frac_masked              (MIS) fraction of tokens whose ρ was rejected
    rollout_norm_factor              (rollout_batch_normalize) the batch mean the weights were divided
                                     by (1 where they were not)
    vespo_phi_mean                   (vespo) mean Gamma weight φ over the active tokens
    cov_frac                         (clip_cov / kl_cov) fraction of tokens cut / penalized
    rollout_rs_frac_rejected         (rollout_rs) fraction of the given active tokens rejected
    off_policy_frac_masked           (off_policy_mask_threshold) fraction whose policy term o drops
    entropy_frac_masked              (top_entropy_quantile < 1) fraction whose policy term e drops

For ``gspo`` and ``gspo_token`` the clip fractions and ratio statistics are over sequences (those with
at least one active token) and about the sequence ratio s_i, the quantity that is clipped (``vespo``:
its ratio w_i, clip fractions 0). For ``dppo_*`` the clip fractions are the tokens outside the trust
region, by sign(A).

With ``cfg.kl_ratio_weighted`` the KL term (and ``kl_ref``) is KL·ρ, ρ the loss type's importance
ratio (:func:`rlkernel.rl.objectives.importance_ratio`, differentiable, as TRL's
``use_bias_correction_kl``).

Context parallelism (``cp_group``): the inputs are each rank's slice of every sequence; every
sequence or batch sum above is reduced over the group (:mod:`rlkernel.rl.context_parallel`), so the
rank losses add up to the unsplit loss, each rank's gradient is its slice of the unsplit gradient,
and the metrics are the unsplit call's on every rank (reading them is a collective).

Caveats:
    * Metrics are local to the call (micro-batch), not normalized globally; average them as you log.
    * ``rollout_logp`` is ignored when ``cfg.rollout_correction`` is ``None``.
    * ``clip_cov`` and ``kl_cov`` read counts and selections on the host (a sync, as verl), and
      ``clip_cov`` draws from torch's default CPU generator (:mod:`rlkernel.rl.covariance`).
    * ``rollout_logp`` is read only by a rollout correction, rollout rejection and the off-policy
      mask; otherwise it is ignored. ``rollout_weights`` should be ≥ 0 (they are not checked: a
      negative weight flips the token's term; with ``gmpo`` its log is NaN).
    * Packed input whose token count equals its sequence count makes 1-D ``advantages`` ambiguous:
      accepted only when every sequence has one token (both readings agree), else ``ValueError``;
      ``[S, 1]`` is always per sequence (:func:`rlkernel.rl.batch.advantages_layout`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlkernel import _validate as check
from rlkernel._autocast import without_autocast
from rlkernel.ops.routes import Route
from rlkernel.rl import masks, objectives, rollout
from rlkernel.rl.aggregate import (
    Normalizer,
    Segments,
    aggregate,
    finite_or_nan,
    masked,
    seq_any,
    seq_mean,
)
from rlkernel.rl.batch import CallChecks, LossBatch, validate_batch
from rlkernel.rl.config import PolicyLossConfig
from rlkernel.rl.kl import canonical_kl_estimator, kl_terms

if TYPE_CHECKING:
    from rlkernel.rl.context_parallel import ContextParallel


class PolicyLossOutput:
    """The result of :func:`policy_loss`.

    Attributes:
        loss: 0-dim float32 (float64 for float64 ``logp``) tensor, differentiable in ``logp`` and
            ``entropy``.
        metrics: name → detached 0-dim tensor (see :mod:`rlkernel.rl.loss` for the names). Computed
            on first access, from detached copies of the step's tensors: a training loop that does
            not read them does not pay for their ~60 small kernel launches.
        route: the :class:`~rlkernel.ops.routes.Route` the call took (``fused_policy_loss``), or
            None (``policy_loss``: the algebra on given log-probs). ``str(out.route)`` reads it.
    """

    __slots__ = ("loss", "route", "_metrics", "_compute")

    def __init__(
        self,
        loss: torch.Tensor,
        metrics: dict[str, torch.Tensor] | None = None,
        *,
        compute_metrics: Callable[[], dict[str, torch.Tensor]] | None = None,
        route: Route | None = None,
    ) -> None:
        if (metrics is None) == (compute_metrics is None):
            raise TypeError("PolicyLossOutput needs exactly one of metrics or compute_metrics")
        self.loss = loss
        self.route = route
        self._metrics = metrics
        self._compute = compute_metrics

    @property
    def metrics(self) -> dict[str, torch.Tensor]:
        if self._metrics is None:
            self._metrics = self._compute()
            self._compute = None  # drop the references to the step's tensors
        return self._metrics

    def __repr__(self) -> str:
        route = "" if self.route is None else f", route='{self.route}'"
        return f"PolicyLossOutput(loss={self.loss!r}{route})"


@dataclass(frozen=True)
class _Batch:
    """Validated inputs on the padded ``[S, L]`` layout, sanitized at masked positions.

    ``mask`` is the loss's mask: the given one less the tokens rollout rejection removed
    (``given_mask`` is the one given). ``old_logp`` is sg[logp] for an on-policy call."""

    segments: Segments
    mask: torch.Tensor
    logp: torch.Tensor
    old_logp: torch.Tensor
    adv: torch.Tensor
    adv_seq: torch.Tensor
    ref_logp: torch.Tensor | None
    rollout_logp: torch.Tensor | None
    entropy: torch.Tensor | None
    given_mask: torch.Tensor
    rollout_weights: torch.Tensor | None = None
    rejection: rollout.Rejection | None = None
    cp: ContextParallel | None = None


def _reads_rollout_logp(cfg: PolicyLossConfig) -> bool:
    """Whether ``cfg`` reads ``rollout_logp`` (a correction, rejection, or the off-policy mask)."""
    return (
        cfg.rollout_correction is not None
        or cfg.rollout_rs is not None
        or cfg.off_policy_mask_threshold is not None
    )


def padded_advantages(batch: LossBatch, mask: torch.Tensor, dtype: torch.dtype):
    """(per-token ``[S, L]``, per-sequence ``[S]``) advantages, detached and sanitized (±inf → NaN,
    0 where ``mask`` is off); per-token advantages average into A_i over ``mask`` (with a
    context-parallel group, over every rank's slice of the sequence)."""
    adv, seg = batch.advantages.detach(), batch.segments
    if not batch.advantages_per_seq:
        tokens = masked(finite_or_nan(seg.to_padded(adv).to(dtype)), mask)
        return tokens, seq_mean(tokens, mask, batch.cp)
    per_seq = masked(finite_or_nan(adv.to(dtype)), seq_any(mask, batch.cp))
    return masked(per_seq[:, None].expand(mask.shape), mask), per_seq


def padded_width(batch: LossBatch) -> int:
    """L, the padded width that ``seq-mean-token-sum-norm`` divides by when ``cfg.norm_length`` is
    None: this call's (``[B, T]``: T; packed: the longest sequence), or with a context-parallel
    group the unsplit batch's. 1 where no aggregation reads it (no collective for it then)."""
    cfg = batch.cfg
    if cfg.aggregation != "seq-mean-token-sum-norm" or cfg.norm_length is not None:
        return 1
    return batch.segments.max_len if batch.cp is None else batch.cp.width


def _padded_batch(logp: torch.Tensor, entropy: torch.Tensor | None, batch: LossBatch) -> _Batch:
    """The validated inputs on the padded ``[S, L]`` layout, sanitized at masked positions."""
    seg, cfg = batch.segments, batch.cfg
    dtype = torch.float64 if logp.dtype == torch.float64 else torch.float32
    given = seg.to_padded(batch.mask != 0, fill=False)

    def padded(x: torch.Tensor | None, *, constant: bool = True) -> torch.Tensor | None:
        # ±inf at an active position becomes NaN (the clamps of the algebra would hide it).
        if x is None:
            return None
        x = x.detach() if constant else x
        return masked(finite_or_nan(seg.to_padded(x).to(dtype)), given)

    logp2 = padded(logp, constant=False)
    # On-policy (old_logp=None): the old log-probs are the current ones, detached (ratio 1 in value,
    # the gradient of logp through it).
    old2 = padded(batch.old_logp) if batch.old_logp is not None else logp2.detach()
    rollout2 = padded(batch.rollout_logp) if _reads_rollout_logp(cfg) else None
    rejected, active = None, given
    if cfg.rollout_rs is not None:
        rejected = rollout.rejection(
            old2, rollout2, given, cfg.rollout_rs, cfg.rollout_rs_min, cfg.rollout_rs_max, batch.cp
        )
        active = rejected.keep
    adv, adv_seq = padded_advantages(batch, active, dtype)
    return _Batch(
        segments=seg,
        mask=active,
        logp=logp2,
        old_logp=old2,
        adv=adv,
        adv_seq=adv_seq,
        ref_logp=padded(batch.ref_logp),
        rollout_logp=rollout2,
        entropy=padded(entropy, constant=False),
        given_mask=given,
        rollout_weights=padded(batch.rollout_weights),
        rejection=rejected,
        cp=batch.cp,
    )


@without_autocast
def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: PolicyLossConfig,
    *,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    rollout_weights: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    global_tokens: Normalizer | int = None,
    global_seqs: Normalizer | int = None,
    cu_seqlens: torch.Tensor | None = None,
    cp_group: object | None = None,
    cp_positions: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """The RL policy loss of one micro-batch, and its metrics.

    Args:
        logp: ``[B, T]`` padded, or ``[N]`` packed with ``cu_seqlens``; float log-probs of the sampled
            tokens under the current policy (differentiable).
        old_logp: log-probs under the policy that produced the batch (the trainer's, before the
            update); same shape/device as ``logp``; constant. ``None``: on-policy, the old
            log-probs are ``logp.detach()`` (ratio 1 in value, its gradient that of logp).
        advantages: float, one per sequence (``[B]`` / ``[S]``, or packed ``[S, 1]``) or one per
            token (the shape of ``logp``); constant. Packed with N = S tokens and an empty sequence,
            a 1-D tensor is ambiguous and raises: give ``[S, 1]`` for one per sequence.
        mask: bool/int/float, the shape of ``logp``; a token is active where ``mask != 0``.
        cfg: the objective (:class:`PolicyLossConfig`).
        ref_logp: reference-policy log-probs, required when ``cfg.kl_coef > 0``; constant.
        rollout_logp: the rollout engine's log-probs, required when ``cfg.rollout_correction`` or
            ``cfg.rollout_rs`` is set; read by ``cfg.off_policy_mask_threshold`` when given;
            constant.
        rollout_weights: precomputed importance weights, the shape of ``logp`` (verl's
            ``rollout_is_weights``), multiplied into the policy term like a correction's weights;
            detached; not together with ``cfg.rollout_correction``.
        entropy: per-token entropy (differentiable), required when ``cfg.entropy_coef != 0`` or
            ``cfg.top_entropy_quantile < 1``.
        global_tokens: normalizer of ``token-mean`` for the whole step (int, float or 0-dim tensor,
            >= 0); the local active-token count when ``None``. 0 (a step with no active token on
            any rank) gives loss 0 for this all-masked call; a tensor that is 0 while this call has
            active tokens, negative or not finite gives a NaN loss (it cannot be checked on the
            host without a sync).
        global_seqs: normalizer of the ``seq-mean-*`` modes for the whole step (same rules); the
            local count of sequences with an active token when ``None``.
        cu_seqlens: int ``[S + 1]`` cumulative lengths (0, …, N) for packed input; ``None`` for
            padded input.
        cp_group: context parallelism: a ``torch.distributed`` process group whose ranks each hold
            a slice of the token positions of every sequence (the same S sequences, in the same
            order, on every rank; all per-token inputs are this rank's slice). Every sequence sum
            (sequence ratios, seq-mean normalizers, per-sequence advantages, sequence-level
            rollout corrections, rejection and masks) spans the group: the rank losses add up to
            the loss of the unsplit batch, each rank's gradient is its slice of the unsplit
            gradient, and the metrics are the unsplit batch's on every rank. A collective (see
            ``docs/guides/multi-gpu.md``): every rank of the group makes the call, runs the
            backward, and reads the metrics (or none does). ``None``: one rank holds whole
            sequences.
        cp_positions: with ``cp_group``: int, the shape of ``logp``, each token's position in its
            sequence (0 … n_i − 1 over the ranks, each position on one rank), e.g. Megatron's
            load-balanced layout from ``rlkernel.distributed.context_parallel_split``. ``None``:
            contiguous slices in rank order (rank 0 holds the first piece of every sequence).

    Returns:
        :class:`PolicyLossOutput`: ``loss`` (0-dim, float32, or float64 for float64 ``logp``) and
        ``metrics`` (detached 0-dim tensors).

    Raises:
        TypeError: a non-tensor or wrong-dtype input, ``cfg`` not a ``PolicyLossConfig``.
        ValueError: shape/device mismatches, bad ``cu_seqlens``, a missing ``ref_logp`` /
            ``entropy`` / ``rollout_logp`` that ``cfg`` needs, ``rollout_weights`` with
            ``cfg.rollout_correction``, a negative or non-finite number as a normalizer. With
            ``cp_group``: on every rank alike when any rank's inputs fail these checks, the ranks'
            layouts or settings differ, or ``cp_positions`` is not a partition of the sequences.
    """
    error = None
    try:
        check.float_tensor("logp", logp)
    except (TypeError, ValueError) as err:
        if cp_group is None:
            raise
        error = err  # raised by every rank of cp_group (validate_batch)

    def entropy_checks() -> None:
        if entropy is not None:
            check.float_like("entropy", entropy, "logp", logp)

    batch = validate_batch(
        cfg,
        logp,
        old_logp=old_logp,
        advantages=advantages,
        mask=mask,
        ref_logp=ref_logp,
        rollout_logp=rollout_logp,
        rollout_weights=rollout_weights,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        cu_seqlens=cu_seqlens,
        cp_group=cp_group,
        cp_positions=cp_positions,
        cp_checks=CallChecks(sources=(logp,), error=error, later=entropy_checks, entropy=entropy is not None),
    )
    if cp_group is None:
        entropy_checks()
    return loss_from_batch(logp, entropy, batch)


def loss_from_batch(logp: torch.Tensor, entropy: torch.Tensor | None, inputs: LossBatch) -> PolicyLossOutput:
    """:func:`policy_loss` of ``logp`` (and ``entropy``) with already validated inputs.

    Args:
        logp: float, ``inputs.token_shape``, on ``inputs.device`` (checked by the caller).
        entropy: the same shape, or None; required when ``cfg.entropy_coef != 0`` or
            ``cfg.top_entropy_quantile < 1``.
        inputs: from :func:`rlkernel.rl.batch.validate_batch`.
    """
    cfg = inputs.cfg
    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError(f"entropy is required when cfg.entropy_coef != 0 (entropy_coef={cfg.entropy_coef})")
    if cfg.top_entropy_quantile < 1 and entropy is None:
        raise ValueError(
            f"entropy is required when cfg.top_entropy_quantile < 1 (top_entropy_quantile="
            f"{cfg.top_entropy_quantile})"
        )
    batch = _padded_batch(logp, entropy, inputs)
    global_tokens, global_seqs = inputs.global_tokens, inputs.global_seqs
    width = padded_width(inputs)

    def agg(per_token: torch.Tensor) -> torch.Tensor:
        return aggregate(
            per_token,
            batch.mask,
            cfg.aggregation,
            global_tokens=global_tokens,
            global_seqs=global_seqs,
            norm_length=cfg.norm_length,
            width=width,
            cp=batch.cp,
        )

    correction = None
    if cfg.rollout_correction is not None:
        # Over the given mask, as verl computes its IS weights before its rejection.
        correction = rollout.rollout_weights(
            batch.old_logp,
            batch.rollout_logp,
            batch.given_mask,
            cfg.rollout_correction,
            cfg.rollout_clip_min,
            cfg.rollout_clip_max,
            per_sequence=cfg.loss_type in objectives.ROLLOUT_PER_SEQUENCE,
            fold_mask=batch.mask,
            batch_normalize=cfg.rollout_batch_normalize,
            cp=batch.cp,
        )
    term = objectives.policy_term(
        cfg, batch.logp, batch.old_logp, batch.adv, batch.adv_seq, batch.mask,
        rollout_w=correction, cp=batch.cp,
    )  # fmt: skip
    per_token, applied = _weighted_policy_term(cfg, batch, term, correction)
    weights = applied.pop("correction")
    kl = None
    if batch.ref_logp is not None and cfg.kl_coef > 0:
        kl = _kl(cfg, batch, batch.logp)
        per_token = per_token + cfg.kl_coef * kl
    loss = agg(per_token)
    if cfg.entropy_coef != 0:
        # The entropy-quantile mask acts on the bonus too (the same tokens as the policy term).
        entropy = batch.entropy if applied["entropy"] is None else batch.entropy * applied["entropy"]
        loss = loss - cfg.entropy_coef * agg(entropy)
    return PolicyLossOutput(loss, compute_metrics=lambda: _metrics(cfg, batch, term, kl, weights, applied))


def _weighted_policy_term(
    cfg: PolicyLossConfig, batch: _Batch, term, correction
) -> tuple[torch.Tensor, dict]:
    """The policy term times its detached per-token weights: off-policy mask o, entropy mask e,
    rollout weight w (``correction``'s, unless the loss type folded it into its term — vespo —, or
    the given ``rollout_weights``) and the rejection's NaN marker. Returns it with the weights
    applied (None where absent), for the metrics."""
    per_token = term.loss
    applied = {"off_policy": None, "entropy": None, "correction": None, "given": None}
    if cfg.off_policy_mask_threshold is not None:
        sampling = batch.rollout_logp if batch.rollout_logp is not None else batch.old_logp
        applied["off_policy"] = masks.off_policy_weight(
            batch.logp, sampling, batch.adv, batch.mask, cfg.off_policy_mask_threshold, batch.cp
        )
        per_token = per_token * applied["off_policy"]
    if cfg.top_entropy_quantile < 1:
        applied["entropy"] = masks.entropy_weight(
            batch.entropy, batch.mask, cfg.top_entropy_quantile, batch.cp
        )
        per_token = per_token * applied["entropy"]
    if correction is not None:
        applied["correction"] = correction
        if not term.rollout_folded:
            per_token = per_token * correction.weight
    elif batch.rollout_weights is not None:
        given = batch.rollout_weights
        # gmpo: one weight per sequence, as verl's geo_mean folds them
        if cfg.loss_type in objectives.ROLLOUT_PER_SEQUENCE:
            given = rollout.fold_per_sequence(given, batch.mask, batch.cp)
        applied["given"] = given
        per_token = per_token * given
    if batch.rejection is not None:
        per_token = per_token * batch.rejection.weight
    return per_token, applied


def _kl(cfg: PolicyLossConfig, batch: _Batch, logp: torch.Tensor) -> torch.Tensor:
    """``[S, L]``: the configured KL estimator of ``logp`` against ``ref_logp``; with
    ``cfg.kl_ratio_weighted``, times the loss type's importance ratio (differentiable, as TRL's
    ``use_bias_correction_kl``)."""
    kl = kl_terms(logp, batch.ref_logp, canonical_kl_estimator(cfg.kl_estimator, "cfg.kl_estimator"))
    if cfg.kl_ratio_weighted:
        kl = kl * objectives.importance_ratio(cfg, logp, batch.old_logp, batch.mask, batch.cp)
    return kl


@torch.no_grad()
def _metrics(cfg, batch: _Batch, term, kl, weights, applied) -> dict[str, torch.Tensor]:
    m, dtype = batch.mask, batch.logp.dtype
    means = _Means(batch.cp)
    means.add("clip_frac_low", term.clipped_low.to(dtype), term.ratio_mask)
    means.add("clip_frac_high", term.clipped_high.to(dtype), term.ratio_mask)
    means.total("clip_frac", "clip_frac_low", "clip_frac_high")
    if term.clipped_dual is not None:
        means.add("clip_frac_dual", term.clipped_dual.to(dtype), m)
    logp, old = batch.logp.detach(), batch.old_logp
    means.add("approx_kl", kl_terms(logp, old, "k3"), m)
    means.add_extremes("ratio", term.ratio, term.ratio_mask)
    for name, values, valid in term.extra:
        means.add(name, values.to(dtype), valid)
    if batch.ref_logp is not None:
        if kl is None:  # ref_logp given for monitoring only (kl_coef == 0)
            kl = _kl(cfg, batch, logp)
        means.add("kl_ref", kl.detach(), m)
    if batch.entropy is not None:
        means.add("entropy_mean", batch.entropy.detach(), m)
    if weights is not None:
        means.add("rollout_weight_mean", weights.weight, m)
        name = "rollout_frac_truncated" if cfg.rollout_correction.endswith("tis") else "rollout_frac_masked"
        means.add(name, weights.changed.to(dtype), m)
        if weights.norm_factor is not None:  # from reduced sums: the same on every rank already
            means.value("rollout_norm_factor", weights.norm_factor)
    if applied["given"] is not None:
        means.add("rollout_weight_mean", applied["given"], m)
    if batch.rejection is not None:
        means.add("rollout_rs_frac_rejected", batch.rejection.rejected.to(dtype), batch.given_mask)
    for key, name in (("off_policy", "off_policy_frac_masked"), ("entropy", "entropy_frac_masked")):
        if applied[key] is not None:
            means.add(name, (applied[key] == 0).to(dtype), m)
    return means.finish()


class _Means:
    """The metrics as (sum, count) pairs, divided once at the end (in the order they were added).

    With a context-parallel group the per-token pairs (``[S, L]`` values: this rank's slice) are
    summed over the ranks in ONE all-reduce and the ratio's extremes reduced in one more, so every
    rank reports the unsplit batch's metrics; per-sequence values (``[S]``: the gspo family's and
    vespo's ratio, computed from reduced sums, the same on every rank) are not reduced. Without a
    group every mean is bitwise ``masked_mean``'s (the same sum and count, divided alike)."""

    def __init__(self, cp: ContextParallel | None):
        self.cp = cp
        self.order: list[str] = []
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor, bool]] = {}
        self.totals: dict[str, tuple[str, str]] = {}
        self.values: dict[str, torch.Tensor] = {}
        self.extremes: tuple[str, torch.Tensor, torch.Tensor, bool] | None = None

    def add(self, name: str, x: torch.Tensor, valid: torch.Tensor) -> None:
        """The mean of ``x`` over ``valid`` (0 when nothing is valid)."""
        self.order.append(name)
        self.pairs[name] = (masked(x, valid).sum(), valid.sum().to(x.dtype), valid.dim() == 2)

    def total(self, name: str, first: str, second: str) -> None:
        """The sum of two metrics added before."""
        self.order.append(name)
        self.totals[name] = (first, second)

    def value(self, name: str, value: torch.Tensor) -> None:
        """A metric that is final as it is."""
        self.order.append(name)
        self.values[name] = value

    def add_extremes(self, prefix: str, x: torch.Tensor, valid: torch.Tensor) -> None:
        """``<prefix>_mean / _min / _max`` of ``x`` over ``valid`` (all 0 when nothing is valid;
        one pair of extremes per call)."""
        self.add(f"{prefix}_mean", x, valid)
        self.order += [f"{prefix}_min", f"{prefix}_max"]
        inf = torch.full((), float("inf"), dtype=x.dtype, device=x.device)
        smallest = torch.where(valid, x, inf).amin() if x.numel() else inf
        largest = torch.where(valid, x, -inf).amax() if x.numel() else -inf
        self.extremes = (prefix, smallest, largest, valid.dim() == 2)

    def finish(self) -> dict[str, torch.Tensor]:
        pairs, cp = dict(self.pairs), self.cp
        reduced = [name for name, (_, _, per_token) in pairs.items() if per_token]
        if cp is not None and reduced:
            flat = cp.sum(torch.stack([t for name in reduced for t in pairs[name][:2]]))
            for i, name in enumerate(reduced):
                pairs[name] = (flat[2 * i], flat[2 * i + 1], True)
        out = {name: total / count.clamp_min(1) for name, (total, count, _) in pairs.items()}
        out.update(self.values)
        for name, (first, second) in self.totals.items():
            out[name] = out[first] + out[second]
        if self.extremes is not None:
            prefix, smallest, largest, per_token = self.extremes
            if cp is not None and per_token:  # one MAX all-reduce for both: min = -max(-x)
                negated_min, largest = cp.max(torch.stack([-smallest, largest])).unbind()
                smallest = -negated_min
            zero = torch.zeros((), dtype=smallest.dtype, device=smallest.device)
            any_valid = pairs[f"{prefix}_mean"][1] > 0
            out[f"{prefix}_min"] = torch.where(any_valid, smallest, zero)
            out[f"{prefix}_max"] = torch.where(any_valid, largest, zero)
        return {name: out[name] for name in self.order}
