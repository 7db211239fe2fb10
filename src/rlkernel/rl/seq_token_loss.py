"""Sequence-ratio objectives (``gspo``, ``gspo_token``, ``gmpo``) in closed form: the loss and its
per-token coefficients dL/dlogp_t, dL/dH_t from the forward's statistics, without autograd.

The fused logits path (:mod:`rlkernel.rl.fused`) runs a log-prob kernel, then a function from the
per-token statistics to the loss and its coefficients, then one backward kernel. For these loss
types that function is written out here (a few dozen torch ops on ``[S, L]``) instead of running the
``policy_loss`` algebra under autograd (~100 launches forward and backward, 3–5 ms of host time per
call at N = 8192 on an H100). From a padded batch without rollout corrections (the route
``logits/sequence/device``) even the plan is built on the device: :func:`device_seq_plan` gives the
kernels the batch's tensors as they are, and mask counts, a row kernel (masked ids, id check, log-prob
statistics) and the sequence kernel do the rest (``rlkernel.kernels.seq_plan``; no torch op, no host
sync). Notation as :mod:`rlkernel.rl.objectives`; per token t of sequence i,
m_t the active mask after rollout rejection, n_i = Σ_t m_t, w_t the aggregation weight
(factor_t / D, as the token-level plan's) and ρ_t the detached rollout weight (1 without one):

    log s_i = Σ_t m·lr_t / n_i (``geo_mean``) or Σ_t m·lr_t (``product``), lr_t = logp_t − old_t
    gspo        L = Σ_i W_i·ℓ(s_i, A_i),  W_i = Σ_t m·w_t·ρ_t,  s_i = exp(min(log s_i, 10))
                dL/dlogp_t = m_t·W_i·ℓ'(s_i)·s_i·[log s_i ≤ 10] / n_i   (product: no / n_i)
    gspo_token  L = Σ_t m·w_t·ρ_t·ℓ(s_i, A_t),  dL/dlogp_t = m_t·w_t·ρ_t·ℓ'(s_i, A_t)·s_i·[log s_i ≤ 10]
    gmpo        log s_i = Σ_t m·lr'_t / n_i, lr' = min(lr, ε_high) (A_t > 0), max(lr, −ε_low) (A_t < 0),
                0 (A_t = 0);  L = Σ_i W_i·(−A_i·s_i),  dL/dlogp_t = −m_t·W_i·A_i·s_i·π_t / n_i with
                π_t = 1 where the cap passes the gradient (closed interval, as ``clamp``), else 0

with ℓ(s, A) = max(−A·s, −A·clip(s)) and ℓ' its derivative by torch.maximum's rule (halves on ties,
which sum to −A inside the clip interval). The KL and entropy terms are token-local: they come from
the token-level plan of the same batch without its policy term
(``token_loss.plan_from_batch(..., policy_term=False)``, one token-loss launch) and add to the
above. The result is the loss and gradients of ``policy_loss`` to fp32 rounding (tested against it
for every aggregation, padded and packed, global normalizers, KL, entropy and rollout weights).

Eligible (:func:`is_eligible`): those three loss types with what :func:`token_loss.token_local_rest`
allows (no ratio-weighted KL, no off-policy sequence mask, no entropy quantile, no on-policy rollout
correction or rejection), and for ``gmpo`` no rollout correction or given rollout weights (they fold
into one weight per sequence there). Other calls take the autograd coefficient path.

Caveats:
    * Non-finite inputs at active tokens give NaN, as ``policy_loss`` does: ±inf log-probs, old
      log-probs or advantages become NaN before the sums, and a NaN reaches the loss and every
      coefficient of its sequence.
    * A global normalizer that is 0, negative or not finite gives NaN at active tokens, as the
      token-level plan's kernel does.
"""

from __future__ import annotations

import math

import torch

from rlkernel import _dispatch
from rlkernel._memo import memoized
from rlkernel._token_loss_plan import DeviceSeqPlan
from rlkernel.ops.seq_token_loss import seq_token_loss_triton
from rlkernel.ops.token_loss import TokenLossTerms, token_loss
from rlkernel.rl import objectives
from rlkernel.rl import token_loss as token_plans
from rlkernel.rl.aggregate import finite_or_nan
from rlkernel.rl.batch import LossBatch
from rlkernel.rl.config import PolicyLossConfig
from rlkernel.rl.loss import padded_advantages

SEQ_LOSS_TYPES: tuple[str, ...] = ("gspo", "gspo_token", "gmpo")


def is_eligible(cfg: PolicyLossConfig, *, on_policy: bool, has_rollout_weights: bool) -> bool:
    """Whether a call with ``cfg`` has the closed form of this module (see the module docstring)."""
    if cfg.loss_type not in SEQ_LOSS_TYPES or not token_plans.token_local_rest(cfg, on_policy=on_policy):
        return False
    return not (cfg.loss_type == "gmpo" and (cfg.rollout_correction is not None or has_rollout_weights))


_SEQ_CONSTANTS: dict[PolicyLossConfig, tuple] = {}


def _seq_constants(cfg: PolicyLossConfig) -> tuple:
    """``(kind, geo_mean, clip_lo, clip_hi, eps_low, eps_high, log_ratio_max)`` of ``cfg`` for the
    sequence kernel (memoized: a function of the frozen config, asked for on every call)."""

    def make() -> tuple:
        geo_mean = objectives.seq_ratio_convention(cfg) == "geo_mean"
        return (cfg.loss_type, geo_mean, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high, cfg.clip_low, cfg.clip_high,
                objectives.GSPO_LOG_RATIO_MAX)  # fmt: skip

    return memoized(_SEQ_CONSTANTS, cfg, make)


def device_seq_plan(batch: LossBatch, token_ids: torch.Tensor, *, check_ids: bool) -> DeviceSeqPlan:
    """The :class:`DeviceSeqPlan` of an eligible call (:func:`is_eligible`) whose counts, masked ids
    and id check the kernels compute (``rlkernel.rl.routes.device_plan_supported``: padded
    ``[S, T]``, no rollout correction, rejection or given weights, contiguous per-token tensors):
    the policy-free token-level plan's scalars and aggregation (``token_loss.device_plan_from_batch
    (..., policy_term=False)``) and the sequence kernel's constants. Nothing is launched.

    Args:
        batch: from :func:`rlkernel.rl.batch.validate_batch`.
        token_ids: the call's int ``[S, T]`` ids as given (contiguous; masked by the kernels).
        check_ids: the kernels count the active ids outside ``[0, V)`` (``validate=True``).
    """
    tokens = token_plans.device_plan_from_batch(batch, token_ids, check_ids=check_ids, policy_term=False)
    return DeviceSeqPlan(tokens, *_seq_constants(batch.cfg))


def _surrogate(
    s: torch.Tensor, adv: torch.Tensor, cfg: PolicyLossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ℓ, dℓ/ds) of ℓ = max(−A·s, −A·clip(s)) with torch's gradient rules: ``clamp`` passes the
    gradient on the closed interval, ``maximum`` splits it in halves on ties."""
    lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    plain, clipped = -adv * s, -adv * s.clamp(lo, hi)
    d_clipped = torch.where((s >= lo) & (s <= hi), -adv, 0.0)
    grad = torch.where(
        plain > clipped, -adv, torch.where(plain < clipped, d_clipped, 0.5 * (d_clipped - adv))
    )
    return torch.maximum(plain, clipped), grad


def _aggregation_weights(plan, seg, act2: torch.Tensor) -> torch.Tensor:
    """fp32 ``[S, L]``: w_t·ρ_t at active tokens (0 elsewhere; NaN where ρ_t or D is NaN), the
    token-level plan's aggregation weight w_t = factor_t / D and rollout weight ρ_t."""
    s = plan.scalars
    weights = act2.to(torch.float32)
    if plan.rollout_w is not None:
        weights = torch.where(act2, seg.to_padded(plan.rollout_w).reshape(act2.shape), 0.0)
    if plan.factor is not None:
        factor = (
            plan.factor[:, None] if plan.factor_per_seq else seg.to_padded(plan.factor).reshape(act2.shape)
        )
        weights = weights * factor
    if plan.denom is None:
        den = s.norm_mult
        weights = weights * (1.0 / den if 0 < den < math.inf else math.nan)
    else:
        den = s.norm_mult * plan.denom.to(torch.float32).clamp_min(s.denom_floor)
        weights = weights / torch.where((den > 0) & (den < math.inf), den, math.nan)
    # Inactive tokens weigh exactly 0 whatever D is (an all-masked call with a normalizer of 0: 0).
    return torch.where(act2, weights, 0.0)


def _terms_triton(batch: LossBatch, plan, logp: torch.Tensor, entropy) -> TokenLossTerms:
    """:func:`seq_terms` in one Triton launch (:mod:`rlkernel.kernels.seq_token_loss`)."""
    cfg, seg = batch.cfg, batch.segments
    cu = batch.cu_seqlens
    return seq_token_loss_triton(
        plan,
        token_plans.flat_f32(logp),
        token_plans.flat_f32(entropy) if plan.want_entropy else None,
        kind=cfg.loss_type,
        geo_mean=objectives.seq_ratio_convention(cfg) == "geo_mean",
        old=None if batch.old_logp is None else token_plans.flat_f32(batch.old_logp),
        adv=token_plans.flat_f32(batch.advantages),
        adv_per_seq=batch.advantages_per_seq,
        cu_seqlens=None if cu is None else cu.to(device=logp.device, dtype=torch.int64),
        n_seqs=seg.n_seqs,
        clip_lo=1.0 - cfg.clip_low,
        clip_hi=1.0 + cfg.clip_high,
        eps_low=cfg.clip_low,
        eps_high=cfg.clip_high,
        log_ratio_max=objectives.GSPO_LOG_RATIO_MAX,
    )


def seq_terms(
    batch: LossBatch, masked_ids: tuple[torch.Tensor, torch.Tensor], logp: torch.Tensor, entropy
) -> TokenLossTerms:
    """The loss and its per-token coefficients of an eligible call (:func:`is_eligible`).

    Args:
        batch: from :func:`rlkernel.rl.batch.validate_batch`.
        masked_ids: ``(ids, active)`` as :func:`rlkernel.rl.token_loss.masked_token_ids` gives them.
        logp: fp32, the token shape (any value at masked positions): the forward's log-probs.
        entropy: fp32, the token shape, or None; read only when ``cfg.entropy_coef != 0``.

    Returns:
        :class:`TokenLossTerms` over the flat tokens: the loss (0-dim fp32), ``g_logp`` ``[N]`` and
        ``g_entropy`` ``[N]`` (None without an entropy term). No host sync (except what the plan
        reads for packed input).
    """
    cfg, seg = batch.cfg, batch.segments
    plan = token_plans.plan_from_batch(batch, masked_ids, policy_term=False)
    if _dispatch.resolve_backend(logp.device, has_kernel=logp.dtype != torch.float64) == "triton":
        return _terms_triton(batch, plan, logp, entropy)
    shape = (seg.n_seqs, seg.max_len)
    ignore = token_plans.IGNORE_INDEX
    act2 = seg.to_padded(plan.ids != ignore, fill=False).reshape(shape)
    n_seq = act2.sum(-1).to(torch.float32)
    flat_logp = token_plans.flat_f32(logp)
    logp2 = seg.to_padded(flat_logp).reshape(shape)
    if batch.old_logp is None:  # on-policy: lr = logp − sg[logp] = 0 in value
        lr = torch.zeros_like(logp2)
    else:
        lr = logp2 - seg.to_padded(token_plans.flat_f32(batch.old_logp)).reshape(shape)
    lr = torch.where(act2, finite_or_nan(lr), 0.0)
    adv_t, adv_i = padded_advantages(batch, act2, torch.float32)
    weights = _aggregation_weights(plan, seg, act2)
    per_token_len = n_seq.clamp_min(1)[:, None]

    if cfg.loss_type == "gmpo":
        pos, neg = adv_t > 0, adv_t < 0
        capped = torch.where(
            pos, lr.clamp(max=cfg.clip_high), torch.where(neg, lr.clamp(min=-cfg.clip_low), 0.0)
        )
        passes = (pos & (lr <= cfg.clip_high)) | (neg & (lr >= -cfg.clip_low))
        s = torch.exp(capped.sum(-1) / n_seq.clamp_min(1))
        seq_weight = weights.sum(-1)
        loss = (seq_weight * (-adv_i * s)).sum()
        coef = torch.where(passes, (seq_weight * -adv_i * s)[:, None] / per_token_len, 0.0)
    else:
        log_s = lr.sum(-1)
        geo_mean = objectives.seq_ratio_convention(cfg) == "geo_mean"
        if geo_mean:
            log_s = log_s / n_seq.clamp_min(1)
        gate = log_s <= objectives.GSPO_LOG_RATIO_MAX
        s = torch.exp(log_s.clamp(max=objectives.GSPO_LOG_RATIO_MAX))
        if cfg.loss_type == "gspo":
            value, slope = _surrogate(s, adv_i, cfg)
            seq_weight = weights.sum(-1)
            loss = (seq_weight * value).sum()
            per_seq = torch.where(gate, seq_weight * slope * s, 0.0)[:, None]
            coef = torch.where(act2, per_seq / per_token_len if geo_mean else per_seq, 0.0)
        else:  # gspo_token: s_it = sg[s_i]·exp(logp − sg[logp]), token-local given s_i
            value, slope = _surrogate(s[:, None], adv_t, cfg)
            loss = torch.where(act2, weights * value, 0.0).sum()
            coef = torch.where(act2 & gate[:, None], weights * slope * s[:, None], 0.0)

    g_logp = token_plans.tokens_from_padded(coef, seg, plan.n_tokens)
    if cfg.kl_coef > 0 or plan.want_entropy:
        ent = entropy.reshape(-1) if plan.want_entropy else None
        local = token_loss(plan, flat_logp, ent)
        return TokenLossTerms(loss + local.loss, g_logp + local.g_logp, local.g_entropy)
    return TokenLossTerms(loss, g_logp, None)
