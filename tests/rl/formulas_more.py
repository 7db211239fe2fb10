"""Float64 oracles for the issue-14 additions, retyped from their formulas one token at a time.

Covers the loss types ``vespo``, ``dppo_tv``, ``dppo_kl``, ``clip_cov``, ``kl_cov``, ``dro``, the
``seq_ratio`` conventions of ``gspo``/``gspo_token``, the ``token-sum`` aggregation and the
ratio-weighted KL, on top of :mod:`tests.rl.formulas` (the KL estimators, the rollout weights, the
other loss types and aggregations). Nothing here imports ``rlkernel.rl``: each formula is written
from the docs (docs/api/policy_loss.md), as plain arithmetic on 0-dim float64 tensors with Python
loops, so autograd gives the oracle's gradient too.

The two covariance losses select tokens over the whole batch: ``clip_cov`` draws its tokens with one
``torch.randperm(n_candidates)`` from torch's default generator (the draw verl makes); a test seeds
that generator identically before the library call and before the oracle call. ``kl_cov``'s top-k
is a Python sort here.
"""

from __future__ import annotations

import math

import torch

from . import formulas
from .formulas import clamp

# One config per new loss type, with parameters that random test batches cross on both sides.
MORE_LOSS_CONFIGS = {
    "vespo": dict(loss_type="vespo", vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                  vespo_lambda_neg=2.0),
    "vespo_geo": dict(loss_type="vespo", seq_ratio="geo_mean", vespo_k_pos=1.5, vespo_lambda_neg=0.0),
    "dppo_tv": dict(loss_type="dppo_tv", clip_low=0.05, clip_high=0.08, dppo_ratio_cap=1.6),
    "dppo_kl": dict(loss_type="dppo_kl", clip_low=0.02, clip_high=0.03, dppo_ratio_cap=None),
    "clip_cov": dict(loss_type="clip_cov", clip_low=0.2, clip_high=0.28, clip_cov_ratio=0.3, clip_cov_lb=-0.5,
                     clip_cov_ub=0.8),
    "kl_cov": dict(loss_type="kl_cov", kl_cov_ratio=0.25, kl_cov_coef=0.7),
    "dro": dict(loss_type="dro", dro_beta=0.6),
    "gspo_product": dict(loss_type="gspo", seq_ratio="product", clip_low=0.3, clip_high=0.4),
    "gspo_token_product": dict(loss_type="gspo_token", seq_ratio="product", clip_low=0.3, clip_high=0.4),
}  # fmt: skip
NEW_LOSS_TYPES = ("vespo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov", "dro")

LOG_1E8 = math.log(1e-8)


def _active(seq):
    return [t for t in range(seq["mask"].shape[0]) if bool(seq["mask"][t])]


def _convention(cfg):
    if cfg.seq_ratio is not None:
        return cfg.seq_ratio
    return "product" if cfg.loss_type == "vespo" else "geo_mean"


def seq_log_ratio(cfg, seq, idx, *, detach=False):
    """log s_i: Σ lr (product) or Σ lr / n (geo_mean), clamped above at 10."""
    lp = seq["logp"].detach() if detach else seq["logp"]
    total = sum((lp[t] - seq["old"][t].detach() for t in idx), torch.zeros((), dtype=torch.float64))
    if _convention(cfg) == "geo_mean":
        total = total / len(idx)
    return clamp(total, hi=10.0)


# ------------------------------------------------------------------------------------ the new terms


def vespo_log_w(cfg, seq, idx):
    """log w_i = clamp(Σ_t clamp(lr_t, ±20) + (rollout share), log 1e-8, 20) (geo_mean: the sum / n)."""
    lp, old = seq["logp"].detach(), seq["old"].detach()
    parts = [clamp(lp[t] - old[t], -20.0, 20.0) for t in idx]
    if cfg.rollout_correction is not None:
        weights = formulas.rollout_weights(cfg, seq, idx)
        logs = [clamp(torch.log(w), LOG_1E8, 20.0) for w in weights]
        if cfg.rollout_correction.startswith("token"):
            parts += logs
        else:  # one weight for the sequence, counted once
            parts.append(logs[0])
    total = sum(parts, torch.zeros((), dtype=torch.float64))
    if _convention(cfg) == "geo_mean":
        total = total / len(idx)
    return clamp(total, LOG_1E8, 20.0)


def vespo_phi(cfg, log_w, a):
    k, lam = (cfg.vespo_k_pos, cfg.vespo_lambda_pos) if a >= 0 else (cfg.vespo_k_neg, cfg.vespo_lambda_neg)
    lam = max(lam, 1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.zeros_like(phi) if torch.isinf(phi) else phi


def dppo_valid(cfg, lp, old, a):
    """DPPO's trust region for one token (0-dim float64 tensors: a log of a negative number, for an
    ``old`` log-prob > 0, is NaN and every comparison with it false, as in verl)."""
    p, p_old = torch.exp(lp), torch.exp(old)
    if cfg.loss_type == "dppo_tv":
        return bool(p - p_old <= cfg.clip_high) if a > 0 else bool(p - p_old >= -cfg.clip_low)
    bkl = p_old * (old - lp) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    if a > 0:
        return bool(bkl <= cfg.clip_high) or bool(p <= p_old)
    return bool(bkl <= cfg.clip_low) or bool(p >= p_old)


def _token_terms(cfg, seq, idx):
    lp, old, adv = seq["logp"], seq["old"].detach(), seq["adv"].detach()
    kind = cfg.loss_type
    if kind == "vespo":
        log_w = vespo_log_w(cfg, seq, idx)
        return [-vespo_phi(cfg, log_w, adv[t]) * adv[t] * lp[t] for t in idx]
    if kind in ("dppo_tv", "dppo_kl"):
        out = []
        for t in idx:
            r = torch.exp(clamp(lp[t] - old[t], -20.0, 20.0)).detach()
            w = r if cfg.dppo_ratio_cap is None else clamp(r, hi=cfg.dppo_ratio_cap)
            valid = dppo_valid(cfg, lp[t].detach(), old[t], adv[t])
            out.append(-adv[t] * w * lp[t] * (1.0 if valid else 0.0))
        return out
    if kind == "dro":
        return [-(adv[t] * lp[t] - 0.5 * cfg.dro_beta * (lp[t] - old[t]) ** 2) for t in idx]
    if kind == "gspo":
        n = len(idx)
        s = torch.exp(seq_log_ratio(cfg, seq, idx))
        loss = formulas.clipped(cfg, s, sum(adv[t] for t in idx) / n)
        return [loss for _ in idx]
    if kind == "gspo_token":
        log_s = seq_log_ratio(cfg, seq, idx, detach=True)
        return [
            formulas.clipped(cfg, torch.exp(clamp(log_s + lp[t] - lp[t].detach(), hi=10.0)), adv[t])
            for t in idx
        ]
    return formulas.policy_terms(cfg, seq)[1]


def _covariances(seqs, idxs):
    """[(i, t, cov)] over the batch's active tokens in row-major order; means over all of them."""
    flat = [(i, t) for i, idx in enumerate(idxs) for t in idx]
    if not flat:
        return []
    a = [float(seqs[i]["adv"][t].detach()) for i, t in flat]
    lp = [float(seqs[i]["logp"][t].detach()) for i, t in flat]
    mean_a, mean_lp = sum(a) / len(a), sum(lp) / len(lp)
    return [(i, t, (x - mean_a) * (y - mean_lp)) for (i, t), x, y in zip(flat, a, lp, strict=True)]


def clip_cov_terms(cfg, seqs, idxs):
    covs = _covariances(seqs, idxs)
    candidates = []
    for i, t, c in covs:
        s = seqs[i]
        r = torch.exp(s["logp"][t] - s["old"][t]).detach()  # unclamped, as verl
        a = s["adv"][t]
        clipped = -a * clamp(r, 1 - cfg.clip_low, 1 + cfg.clip_high) > -a * r
        if not clipped and cfg.clip_cov_lb < c < cfg.clip_cov_ub:
            candidates.append((i, t))
    cut = set()
    if candidates:
        k = max(int(cfg.clip_cov_ratio * len(covs)), 1)
        perm = torch.randperm(len(candidates))[:k]
        cut = {candidates[int(j)] for j in perm}
    out = []
    for i, idx in enumerate(idxs):
        s = seqs[i]
        terms = []
        for t in idx:
            r = torch.exp(s["logp"][t] - s["old"][t])
            a = s["adv"][t].detach()
            loss = torch.maximum(-a * r, -a * clamp(r, 1 - cfg.clip_low, 1 + cfg.clip_high))
            terms.append(loss * (0.0 if (i, t) in cut else 1.0))
        out.append(terms)
    return out, cut


def kl_cov_terms(cfg, seqs, idxs):
    covs = _covariances(seqs, idxs)
    chosen = set()
    if covs:
        k = max(1, int(len(covs) * cfg.kl_cov_ratio))
        ranked = sorted(range(len(covs)), key=lambda j: -covs[j][2])
        chosen = {covs[j][:2] for j in ranked[:k]}
    out = []
    for i, idx in enumerate(idxs):
        s = seqs[i]
        terms = []
        for t in idx:
            lr = s["logp"][t] - s["old"][t].detach()
            loss = -s["adv"][t].detach() * torch.exp(lr)
            if (i, t) in chosen:
                loss = loss + cfg.kl_cov_coef * torch.abs(lr)
            terms.append(loss)
        out.append(terms)
    return out, chosen


def all_policy_terms(cfg, seqs):
    """(per-sequence active indices, per-sequence lists of token losses) for the whole batch."""
    idxs = [_active(s) for s in seqs]
    if cfg.loss_type == "clip_cov":
        return idxs, clip_cov_terms(cfg, seqs, idxs)[0]
    if cfg.loss_type == "kl_cov":
        return idxs, kl_cov_terms(cfg, seqs, idxs)[0]
    return idxs, [_token_terms(cfg, s, idx) if idx else [] for s, idx in zip(seqs, idxs, strict=True)]


# ------------------------------------------------------------------------------- the whole objective


def kl_ratio(cfg, seq, idx, t):
    """The ratio that weights token t's KL with kl_ratio_weighted (differentiable, as TRL's coef_1)."""
    lp, old = seq["logp"], seq["old"].detach()
    if cfg.loss_type == "gspo":
        return torch.exp(seq_log_ratio(cfg, seq, idx))
    if cfg.loss_type == "gspo_token":
        return torch.exp(clamp(seq_log_ratio(cfg, seq, idx, detach=True) + lp[t] - lp[t].detach(), hi=10.0))
    return torch.exp(clamp(lp[t] - old[t], -20.0, 20.0))


def aggregate(cfg, per_seq_terms, width, global_tokens=None, global_seqs=None):
    if cfg.aggregation == "token-sum":
        return sum((x for terms in per_seq_terms for x in terms), torch.zeros((), dtype=torch.float64))
    return formulas.aggregate(cfg, per_seq_terms, width, global_tokens, global_seqs)


def policy_loss(cfg, seqs, width, *, global_tokens=None, global_seqs=None):
    """agg(w·policy + kl_coef·KL(·r)) − entropy_coef·agg(H), float64 (vespo: w inside φ)."""
    idxs, all_terms = all_policy_terms(cfg, seqs)
    losses, entropies = [], []
    for seq, idx, terms in zip(seqs, idxs, all_terms, strict=True):
        if cfg.rollout_correction is not None and idx and cfg.loss_type != "vespo":
            terms = [x * w for x, w in zip(terms, formulas.rollout_weights(cfg, seq, idx), strict=True)]
        if cfg.kl_coef > 0:
            new = []
            for x, t in zip(terms, idx, strict=True):
                kl = formulas.kl_one(seq["logp"][t], seq["ref"][t], cfg.kl_estimator)
                if cfg.kl_ratio_weighted:
                    kl = kl * kl_ratio(cfg, seq, idx, t)
                new.append(x + cfg.kl_coef * kl)
            terms = new
        losses.append(terms)
        if cfg.entropy_coef != 0:
            entropies.append([seq["entropy"][t] for t in idx])
    loss = aggregate(cfg, losses, width, global_tokens, global_seqs)
    if cfg.entropy_coef != 0:
        loss = loss - cfg.entropy_coef * aggregate(cfg, entropies, width, global_tokens, global_seqs)
    return loss


def oracle(cfg, batch, cu_seqlens=None, **kwargs):
    """:func:`policy_loss` on a test batch (tests.rl.helpers layout), float64, differentiable."""
    tensors = {
        "logp": batch["logp"].double(),
        "old": batch["old_logp"].double(),
        "adv": batch["advantages"].double(),
        "ref": batch["ref_logp"].double(),
        "rollout": batch["rollout_logp"].double(),
        "entropy": batch["entropy"].double(),
    }
    if cu_seqlens is None:
        seqs = formulas.sequences_from_padded(batch["mask"], **tensors)
        width = batch["mask"].shape[1]
    else:
        seqs = formulas.sequences_from_packed(cu_seqlens, batch["mask"], **tensors)
        cu = [int(c) for c in cu_seqlens]
        width = max((b - a for a, b in zip(cu[:-1], cu[1:], strict=True)), default=0)
    return policy_loss(cfg, seqs, width, **kwargs)
