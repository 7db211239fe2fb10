"""Token-level loss plans: the ``[B, T]`` RL algebra as one fused launch over the flat tokens.

For most objectives, once a few per-token constants are known, the gradient dL/dlogp_t depends only
on token t's own logp_t (and dL/dentropy_t on nothing at all):

    ℓ_t = w_t·(ρ_t·P(logp_t) + kl_coef·K(logp_t) − entropy_coef·H_t)
    w_t = aggregation weight (mask / denominator: 1/Σm, 1/(n_i·#seqs), 1/#seqs, 1/(#seqs·L), or the
          global normalizers), ρ_t = detached rollout-correction weight, A_t = broadcast advantage

That holds for ``ppo`` (with ``delta`` and ``dual_clip``), ``cispo``, ``sapo`` and ``reinforce``,
every aggregation (padded or packed, with or without global normalizers; ``token-sum``: w_t = 1),
every KL estimator and every rollout correction (``token_*`` and ``seq_*``, batch-normalized or not:
their weights are detached functions of ``old_logp``/``rollout_logp`` only), given
``rollout_weights`` (they are ρ_t), rollout rejection (``cfg.rollout_rs``: a function of
``old_logp``/``rollout_logp``; the rejected tokens become ignored ids, leave the aggregation's
counts, and a NaN statistic's NaN marker joins ρ_t) and on-policy calls (``old_logp=None``: the
plan has no ``old`` and the kernel's ``HAS_OLD=False`` branch uses the token's own logp as old,
lr = 0, r = 1 with dr/dlogp = 1 — no second log-prob pass, no copy). Not eligible
(:func:`is_eligible`; ``fused_policy_loss`` takes its fused coefficient path from logits,
:func:`rlkernel.policy_loss`'s autograd path otherwise):

* ``gspo``, ``gspo_token``, ``gmpo`` and ``vespo``: the per-token loss (or its detached weight)
  depends on the whole sequence's current log-probs;
* ``clip_cov`` and ``kl_cov``: which tokens are cut or penalized depends on covariance statistics
  of the whole batch's current log-probs (and a random draw);
* ``dppo_tv``, ``dppo_kl`` and ``dro``: token-local, but the kernel has no branch for their terms
  (a detached trust-region mask on the probabilities; a quadratic log-ratio penalty) yet;
* ``kl_ratio_weighted=True``: the KL term gains the ratio factor r_t, with its own gradient
  (K'·r + K·r), which the kernel's KL branch does not compute;
* TRL's off-policy sequence mask and top-entropy quantile: their 0/1 weights are functions of this
  call's log-probs / entropies (a sequence mean, a batch-wide quantile), which exist only once the
  log-prob kernel has run;
* an on-policy call with a rollout correction or rejection (their weights would read this call's
  log-probs as the old ones).

:func:`build_plan` computes the per-token constants with a handful of torch ops (no host sync);
:func:`rlkernel.ops.token_loss.token_loss` (re-exported here) then runs ONE launch
(:mod:`rlkernel.kernels.token_loss`, or the reference on CPU) over any row range ``[start, stop)``
of the flat tokens and returns that range's loss partial sum and coefficients. A chunked caller (the
fused linear path) calls it once per chunk and adds the partial sums in chunk order
(:func:`as_coef_fn` wraps it in the ``coef_fn`` form of
``rlkernel.ops._linear_function.fused_linear_token_loss``); ``rlkernel.rl.fused`` calls it once over
all tokens.

Caveats:
    * The flat token order is that of ``token_ids`` (``[B, T]`` row-major, or the packed stream).
    * Metrics are not computed here: the caller builds them lazily with :func:`rlkernel.policy_loss`
      on detached log-probs (same numbers as the autograd path).
    * Sequence-level constants of packed input use a gather index built from ``cu_seqlens`` on the
      host (already read there by the validation).
"""

from __future__ import annotations

import math

import torch

from rlkernel import _validate as check
from rlkernel._memo import memoized
from rlkernel._token_loss_plan import COUNT_NONE, COUNT_SEQS, COUNT_TOKENS, DevicePlan
from rlkernel.ops.token_loss import (  # noqa: F401 - re-exported: the plan and its launcher
    IGNORE_INDEX,
    TokenLossPlan,
    TokenLossScalars,
    TokenLossTerms,
    as_coef_fn,
    masked_ids,
    token_loss,
)
from rlkernel.rl import rollout
from rlkernel.rl.aggregate import Segments, finite_or_nan, masked
from rlkernel.rl.batch import LossBatch, validate_batch
from rlkernel.rl.config import PolicyLossConfig
from rlkernel.rl.kl import canonical_kl_estimator
from rlkernel.rl.loss import padded_width

ELIGIBLE_LOSS_TYPES: tuple[str, ...] = ("ppo", "cispo", "sapo", "reinforce")


def is_eligible(cfg: PolicyLossConfig, *, on_policy: bool = False) -> bool:
    """Whether a call with ``cfg`` has a token-level plan (see the module docstring): loss type ppo,
    cispo, sapo or reinforce; no ratio-weighted KL; no off-policy sequence mask and no entropy
    quantile (their masks need the call's own log-probs / entropies, known only inside the kernel);
    and, for an on-policy call (``on_policy``: ``old_logp=None``), no rollout correction or
    rejection (they would read the call's own log-probs as the old ones)."""
    return cfg.loss_type in ELIGIBLE_LOSS_TYPES and token_local_rest(cfg, on_policy=on_policy)


def token_local_rest(cfg: PolicyLossConfig, *, on_policy: bool = False) -> bool:
    """Whether everything of ``cfg`` but its policy term is token-level (:func:`is_eligible` less
    the loss-type condition): the KL term not ratio-weighted, no off-policy sequence mask, no
    entropy quantile, and no rollout correction or rejection on an on-policy call."""
    if cfg.kl_ratio_weighted:
        return False
    if cfg.off_policy_mask_threshold is not None or cfg.top_entropy_quantile < 1:
        return False
    return not (on_policy and (cfg.rollout_correction is not None or cfg.rollout_rs is not None))


def flat_f32(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached, flat, fp32 and contiguous."""
    # No copy (and no launch) when already fp32 contiguous.
    return x.detach().reshape(-1).to(torch.float32).contiguous()


def _to_tokens(x: torch.Tensor, seg: Segments, inverse: torch.Tensor | None) -> torch.Tensor:
    """An ``[S, L]`` (or broadcastable) tensor back to the flat token order."""
    x = x.expand(seg.n_seqs, seg.max_len)
    return x.reshape(-1).contiguous() if inverse is None else x.reshape(-1)[inverse]


def _inverse_index(seg: Segments, n_tokens: int) -> torch.Tensor | None:
    """Packed: int64 ``[N]``, the position of each token in the flattened ``[S, L]`` layout."""
    if not seg.is_packed:
        return None
    gather = seg.gather_index.reshape(-1)
    inv = torch.empty(n_tokens + 1, dtype=torch.int64, device=gather.device)
    # Padding slots all point at the spare entry N (any of them may win: it is dropped).
    inv.scatter_(0, gather, torch.arange(gather.numel(), device=gather.device))
    return inv[:n_tokens]


def tokens_from_padded(x: torch.Tensor, seg: Segments, n_tokens: int) -> torch.Tensor:
    """An ``[S, L]`` tensor back to the ``[N]`` flat token order (contiguous; padding dropped)."""
    return _to_tokens(x, seg, _inverse_index(seg, n_tokens))


def _normalizer(value, device) -> tuple[float, torch.Tensor | None]:
    """A global normalizer as (multiplier, device tensor or None); a CPU tensor is read on the host
    (no device sync)."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and device.type != "cpu":
            return float(value.item()), None
        return 1.0, value
    return float(value), None


def build_plan(
    cfg: PolicyLossConfig,
    *,
    token_ids: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    rollout_weights: torch.Tensor | None = None,
    global_tokens: float | torch.Tensor | None = None,
    global_seqs: float | torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> TokenLossPlan:
    """The per-token constants of ``policy_loss(logp, old_logp, advantages, mask, cfg, ...)``.

    Args:
        cfg: an eligible config (:func:`is_eligible`, with ``on_policy=old_logp is None``);
            ValueError otherwise.
        token_ids: int ``[B, T]`` or packed ``[N]``; only its shape and the mask matter here, plus
            the ids themselves, which the plan keeps (``IGNORE_INDEX`` at masked positions) for the
            kernels.
        old_logp, advantages, mask, ref_logp, rollout_logp, rollout_weights, global_tokens,
            global_seqs, cu_seqlens: as in :func:`rlkernel.policy_loss`, over the shape of
            ``token_ids`` (``old_logp=None``: on-policy, the kernel uses its own log-probs).

    Returns:
        :class:`TokenLossPlan`. No host sync (except reading ``cu_seqlens`` for packed input and a
        CPU-tensor normalizer).

    Raises:
        TypeError / ValueError: what ``policy_loss`` raises for the same inputs.
    """
    ids = check.int_tensor("token_ids", token_ids)
    batch = validate_batch(
        cfg,
        ids,
        old_logp=old_logp,
        advantages=advantages,
        mask=mask,
        ref_logp=ref_logp,
        rollout_logp=rollout_logp,
        rollout_weights=rollout_weights,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        cu_seqlens=cu_seqlens,
        like_name="token_ids",
    )
    return plan_from_batch(batch, masked_token_ids(ids, batch.mask))


def masked_token_ids(token_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, active)``: int64 ``token_ids`` with ``IGNORE_INDEX`` at masked positions (so they cost
    no softmax gradient and need no valid id), and the bool mask of active positions (``mask != 0``).
    int64 first: ``IGNORE_INDEX`` does not fit unsigned id dtypes (uint8 would wrap it to 156).
    Negative active ids become -1: an active id equal to ``IGNORE_INDEX`` must reach the kernels as
    out of range (a NaN log-prob) rather than as a position to skip (an id check raises for both).
    On CUDA one launch (``ops.token_loss.masked_ids``)."""
    return masked_ids(token_ids, mask, IGNORE_INDEX)


def _rollout_terms(batch: LossBatch, act2: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(rollout_w, mask)`` on ``[S, L]``: the detached weight of the policy term — the correction's
    (over the given mask ``act2``, as ``policy_loss``), or the given ``rollout_weights``, times the
    rejection's NaN marker — or None; and the mask after rollout rejection (``act2`` without it)."""
    cfg, seg, cp = batch.cfg, batch.segments, batch.cp

    def padded(x: torch.Tensor) -> torch.Tensor:
        # ±inf becomes NaN (a truncated or rejected weight would hide it), as in policy_loss.
        return finite_or_nan(seg.to_padded(x.detach().to(torch.float32)))

    weight, keep = None, act2
    if cfg.rollout_correction is not None or cfg.rollout_rs is not None:
        old2, roll2 = padded(batch.old_logp), padded(batch.rollout_logp)
    if cfg.rollout_correction is not None:
        weight = rollout.rollout_weights(
            old2,
            roll2,
            act2,
            cfg.rollout_correction,
            cfg.rollout_clip_min,
            cfg.rollout_clip_max,
            batch_normalize=cfg.rollout_batch_normalize,
            cp=cp,
        ).weight
    elif batch.rollout_weights is not None:
        weight = masked(padded(batch.rollout_weights), act2)
    if cfg.rollout_rs is not None:
        rejected = rollout.rejection(
            old2, roll2, act2, cfg.rollout_rs, cfg.rollout_rs_min, cfg.rollout_rs_max, cp
        )
        keep = rejected.keep
        weight = rejected.weight if weight is None else weight * rejected.weight
    return weight, keep


def plan_from_batch(
    batch: LossBatch, masked_ids: tuple[torch.Tensor, torch.Tensor], *, policy_term: bool = True
) -> TokenLossPlan:
    """:func:`build_plan` of inputs already validated into ``batch`` (checks nothing again).

    Args:
        batch: from :func:`rlkernel.rl.batch.validate_batch`, of an eligible config.
        masked_ids: ``(ids, active)``: int64 ids with ``IGNORE_INDEX`` at masked positions and the
            bool mask of active positions, the per-token shape.
        policy_term: False: a plan without the policy term (``reinforce`` with zero advantages: its
            term and gradient are 0) for any loss type — the KL and entropy terms, the aggregation
            weights, the rollout weights and the rejection of ``batch``, for a caller that adds a
            policy term of its own (:mod:`rlkernel.rl.seq_token_loss`). The other conditions of
            :func:`is_eligible` still apply.
    """
    cfg, seg, device = batch.cfg, batch.segments, batch.device
    on_policy = batch.old_logp is None
    if policy_term:
        eligible = is_eligible(cfg, on_policy=on_policy)
    else:
        eligible = token_local_rest(cfg, on_policy=on_policy)
    if not eligible:
        raise ValueError(
            f"this call has no token-level plan: loss_type must be one of {ELIGIBLE_LOSS_TYPES} (got "
            f"{cfg.loss_type!r}), without kl_ratio_weighted, off_policy_mask_threshold or "
            "top_entropy_quantile < 1, and an on-policy call (old_logp=None) without rollout_correction "
            "or rollout_rs"
        )
    old_logp, ref_logp = batch.old_logp, batch.ref_logp
    flat_ids, active = masked_ids[0].reshape(-1), masked_ids[1]
    n = flat_ids.numel()
    g_tokens, g_seqs = batch.global_tokens, batch.global_seqs
    inverse = _inverse_index(seg, n)
    act2 = seg.to_padded(active, fill=False)
    # Rollout weights and rejection first: the rejection changes the mask the aggregation counts.
    rollout_w, act2 = _rollout_terms(batch, act2)
    if cfg.rollout_rs is not None:  # rejected tokens leave the mask: ignored ids, not counted
        active = _to_tokens(act2, seg, inverse)
        flat_ids = torch.where(active, flat_ids, IGNORE_INDEX)

    # Per-sequence values of a padded batch stay [S]: the kernel reads sequence token // T.
    adv = batch.advantages.detach()
    adv_per_seq = batch.advantages_per_seq and not seg.is_packed
    if not policy_term:  # reinforce's −A·logp with A = 0: no policy term, no gradient from it
        adv_per_seq = not seg.is_packed
        adv_t = torch.zeros(seg.n_seqs if adv_per_seq else n, dtype=torch.float32, device=device)
    elif not batch.advantages_per_seq or adv_per_seq:
        adv_t = flat_f32(adv)
    else:
        adv_t = _to_tokens(adv.to(torch.float32)[:, None], seg, inverse)

    # Aggregation: w_t = factor_t / (norm_mult · max(denom, floor)). With a context-parallel group
    # the counts are those of every rank (the unsplit batch's).
    cp = batch.cp
    factor, denom, norm_mult, floor = None, None, 1.0, -math.inf
    if cfg.aggregation == "token-sum":
        pass  # w_t = 1: no denominator (and no global normalizer read)
    elif cfg.aggregation == "token-mean":
        if g_tokens is None:
            denom, floor = active.sum() if cp is None else cp.sum(active.sum()), 1.0
        else:
            norm_mult, denom = _normalizer(g_tokens, device)
    else:
        counts = act2.sum(-1) if cp is None else cp.seq_count(act2)
        if g_seqs is None:
            denom, floor = (counts > 0).sum(), 1.0
        else:
            norm_mult, denom = _normalizer(g_seqs, device)
        if cfg.aggregation == "seq-mean-token-mean":
            factor = counts.clamp_min(1).to(torch.float32).reciprocal()
            if seg.is_packed:
                factor = _to_tokens(factor[:, None], seg, inverse)
        elif cfg.aggregation == "seq-mean-token-sum-norm":
            length = cfg.norm_length if cfg.norm_length is not None else max(padded_width(batch), 1)
            norm_mult *= float(length)

    if rollout_w is not None:
        rollout_w = _to_tokens(rollout_w, seg, inverse)

    use_kl = cfg.kl_coef > 0
    scalars = _scalars(cfg, norm_mult, floor, policy_term)
    return TokenLossPlan(
        ids=flat_ids,
        old=flat_f32(old_logp) if old_logp is not None and policy_term else None,
        adv=adv_t,
        ref=flat_f32(ref_logp) if use_kl else None,
        rollout_w=rollout_w,
        factor=factor,
        denom=denom,
        scalars=scalars,
        seq_len=max(seg.max_len, 1),  # only a divisor: an empty batch has no sequence to index
        adv_per_seq=adv_per_seq,
        factor_per_seq=factor is not None and not seg.is_packed,
        ignore_index=IGNORE_INDEX,
    )


_SCALARS: dict[tuple, TokenLossScalars] = {}


def _scalars(
    cfg: PolicyLossConfig, norm_mult: float, floor: float, policy_term: bool = True
) -> TokenLossScalars:
    """The :class:`TokenLossScalars` of ``cfg`` with the aggregation's ``norm_mult`` and ``floor``
    (memoized: a function of the frozen config and three numbers, asked for on every call)."""
    key = (cfg, norm_mult, floor, policy_term)
    return memoized(_SCALARS, key, lambda: _make_scalars(cfg, norm_mult, floor, policy_term))


def _make_scalars(
    cfg: PolicyLossConfig, norm_mult: float, floor: float, policy_term: bool
) -> TokenLossScalars:
    kl = None
    straight = False
    if cfg.kl_coef > 0:
        name = canonical_kl_estimator(cfg.kl_estimator, "cfg.kl_estimator")
        kl, straight = name.rstrip("+"), name.endswith("+")
    inf = math.inf
    if cfg.loss_type == "cispo":
        clip_lo = -inf if cfg.clip_low is None else 1.0 - cfg.clip_low
    else:
        clip_lo = 1.0 - cfg.clip_low if cfg.clip_low is not None else -inf
    return TokenLossScalars(
        loss=cfg.loss_type if policy_term else "reinforce",
        clip_lo=clip_lo,
        clip_hi=1.0 + cfg.clip_high,
        delta=cfg.delta if cfg.delta is not None else inf,
        dual_clip=cfg.dual_clip if policy_term else None,
        tau_pos=cfg.sapo_tau_pos,
        tau_neg=cfg.sapo_tau_neg,
        kl=kl,
        kl_straight=straight,
        kl_coef=cfg.kl_coef,
        entropy_coef=cfg.entropy_coef,
        norm_mult=norm_mult,
        denom_floor=floor,
    )


def device_plan_from_batch(
    batch: LossBatch, token_ids: torch.Tensor, *, check_ids: bool, policy_term: bool = True
) -> DevicePlan:
    """The :class:`DevicePlan` of a checked call whose route builds its constants on the device
    (``rlkernel.rl.routes.device_plan_supported``: padded ``[S, T]``, no rollout correction,
    rejection or given weights, contiguous per-token tensors): the same scalars, aggregation and
    per-token inputs :func:`plan_from_batch` gives, with the counts left to the kernels.

    Args:
        batch: from :func:`rlkernel.rl.batch.validate_batch`, of an eligible config.
        token_ids: the call's int ``[S, T]`` ids as given (contiguous; masked by the kernels).
        check_ids: the kernels count the active ids outside ``[0, V)`` (``validate=True``).
        policy_term: False: the scalars of ``plan_from_batch(..., policy_term=False)`` (no policy
            term: the sequence-ratio kernels add their own, :mod:`rlkernel.rl.seq_token_loss`);
            ``old``/``adv`` stay the call's, for that caller.
    """
    cfg, seg, device = batch.cfg, batch.segments, batch.device
    g_tokens, g_seqs = batch.global_tokens, batch.global_seqs
    count, denom, norm_mult, floor = COUNT_NONE, None, 1.0, -math.inf
    if cfg.aggregation == "token-mean":
        if g_tokens is None:
            count, floor = COUNT_TOKENS, 1.0
        else:
            norm_mult, denom = _normalizer(g_tokens, device)
    elif cfg.aggregation != "token-sum":
        if g_seqs is None:
            count, floor = COUNT_SEQS, 1.0
        else:
            norm_mult, denom = _normalizer(g_seqs, device)
        if cfg.aggregation == "seq-mean-token-sum-norm":
            norm_mult *= float(cfg.norm_length if cfg.norm_length is not None else max(seg.max_len, 1))
    # The tensors as given: the kernels read them flat (contiguous, checked by the route) and never
    # write them, so neither a flattening view nor a detached alias is needed (host time).
    return DevicePlan(
        token_ids,
        batch.mask,
        batch.old_logp,
        batch.advantages,
        batch.ref_logp if cfg.kl_coef > 0 else None,
        _scalars(cfg, norm_mult, floor, policy_term),
        max(seg.max_len, 1),
        seg.n_seqs,
        batch.advantages_per_seq,
        count,
        denom,
        cfg.aggregation == "seq-mean-token-mean",
        check_ids,
    )
