"""Independent float64 oracles for the RL algebra, written from DESIGN.md one sequence / token at a time.

Nothing here imports ``rlkernel.rl``: every formula is retyped as plain per-token arithmetic on 0-dim
float64 tensors (so autograd gives the oracle's gradient too), with explicit Python loops over
sequences and tokens. The library vectorizes the same math over ``[S, L]``; agreement of the two is
the test. The verl guards that the library documents (log-ratio clamps, k3 clamps) are part of the
specified semantics and appear here as explicit ``clamp`` calls.

A *sequence* is a dict of 1-D tensors over its positions: ``logp``, ``old``, ``adv`` (per token; a
per-sequence advantage is repeated), ``mask`` (bool), and optionally ``ref``, ``rollout``, ``entropy``.
"""

from __future__ import annotations

import math

import torch

# ------------------------------------------------------------------------------------------ layouts


def sequences_from_padded(mask, **tensors):
    """One sequence per row of ``[B, T]`` tensors (per-sequence ``adv`` ``[B]`` is repeated)."""
    seqs = []
    for i in range(mask.shape[0]):
        seq = {"mask": mask[i] != 0}
        for name, x in tensors.items():
            if x is None:
                continue
            seq[name] = x[i].expand(mask.shape[1]) if x.dim() == 1 else x[i]
        seqs.append(seq)
    return seqs


def sequences_from_packed(cu_seqlens, mask, **tensors):
    """One sequence per ``cu_seqlens`` segment of ``[N]`` tensors (``adv`` may be ``[S]``)."""
    cu = [int(c) for c in cu_seqlens]
    n_seqs = len(cu) - 1
    seqs = []
    for i in range(n_seqs):
        lo, hi = cu[i], cu[i + 1]
        seq = {"mask": mask[lo:hi] != 0}
        for name, x in tensors.items():
            if x is None:
                continue
            per_seq = x.shape[0] == n_seqs and x.shape[0] != mask.shape[0]
            seq[name] = x[i].expand(hi - lo) if per_seq else x[lo:hi]
        seqs.append(seq)
    return seqs


# ---------------------------------------------------------------------------------------------- KL


def clamp(x, lo=None, hi=None):
    return torch.clamp(x, min=lo, max=hi)


def k1(lp, ref):
    return lp - ref


def k2(lp, ref):
    return 0.5 * (lp - ref) ** 2


def k3(lp, ref):
    x = clamp(ref - lp, -20.0, 20.0)
    return clamp(torch.exp(x) - 1.0 - x, -10.0, 10.0)


def k3_unclamped(lp, ref):
    x = ref - lp
    return torch.exp(x) - 1.0 - x


def kl_one(lp, ref, estimator):
    """One token's KL estimate; "+" = value of the base estimator with the gradient of k2."""
    ref = ref.detach()
    names = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "kl+": "k1+", "low_var_kl+": "k3+"}
    estimator = names.get(estimator, estimator)
    bases = {"k1": k1, "k2": k2, "k3": k3, "k3_unclamped": k3_unclamped, "abs": lambda a, b: torch.abs(a - b)}
    base = bases[estimator.rstrip("+")]
    if estimator.endswith("+"):
        g = k2(lp, ref)
        return g - g.detach() + base(lp, ref).detach()
    return base(lp, ref)


# ------------------------------------------------------------------------------------ policy terms


def ppo_token(cfg, lp, old, a):
    r = torch.exp(clamp(lp - old, -20.0, 20.0))
    unclipped = r if cfg.delta is None else clamp(r, hi=cfg.delta)
    loss = torch.maximum(-a * unclipped, -a * clamp(r, 1 - cfg.clip_low, 1 + cfg.clip_high))
    if cfg.dual_clip is not None and a < 0:
        loss = torch.minimum(loss, -cfg.dual_clip * a)
    return loss


def clipped(cfg, s, a):
    return torch.maximum(-a * s, -a * clamp(s, 1 - cfg.clip_low, 1 + cfg.clip_high))


def policy_terms(cfg, seq):
    """Per-active-token policy loss of one sequence (list of 0-dim tensors, in order)."""
    idx = [t for t in range(seq["mask"].shape[0]) if bool(seq["mask"][t])]
    lp, old, adv = seq["logp"], seq["old"].detach(), seq["adv"].detach()
    n = len(idx)
    if n == 0:
        return idx, []
    mean_adv = sum(adv[t] for t in idx) / n
    kind = cfg.loss_type
    if kind == "ppo":
        return idx, [ppo_token(cfg, lp[t], old[t], adv[t]) for t in idx]
    if kind == "gspo":
        s = torch.exp(clamp(sum(lp[t] - old[t] for t in idx) / n, hi=10.0))
        loss = clipped(cfg, s, mean_adv)
        return idx, [loss for _ in idx]
    if kind == "gspo_token":
        log_s = sum(lp[t].detach() - old[t] for t in idx) / n
        out = []
        for t in idx:
            s_t = torch.exp(clamp(log_s + lp[t] - lp[t].detach(), hi=10.0))
            out.append(clipped(cfg, s_t, adv[t]))
        return idx, out
    if kind == "cispo":
        out = []
        for t in idx:
            r = torch.exp(clamp(lp[t] - old[t], -20.0, 20.0)).detach()
            low = None if cfg.clip_low is None else 1 - cfg.clip_low
            out.append(-clamp(r, low, 1 + cfg.clip_high) * adv[t] * lp[t])
        return idx, out
    if kind == "sapo":
        out = []
        for t in idx:
            r = torch.exp(clamp(lp[t] - old[t], -20.0, 20.0))
            tau = cfg.sapo_tau_pos if adv[t] > 0 else cfg.sapo_tau_neg
            out.append(-(4.0 / tau) * torch.sigmoid(tau * (r - 1.0)) * adv[t])
        return idx, out
    if kind == "gmpo":
        total = torch.zeros((), dtype=torch.float64)
        for t in idx:
            lr = lp[t] - old[t]
            if adv[t] > 0:
                total = total + clamp(lr, hi=cfg.clip_high)
            elif adv[t] < 0:
                total = total + clamp(lr, lo=-cfg.clip_low)
        loss = -mean_adv * torch.exp(total / n)
        return idx, [loss for _ in idx]
    if kind == "reinforce":
        return idx, [-adv[t] * lp[t] for t in idx]
    raise AssertionError(kind)


def rollout_weights(cfg, seq, idx, *, fold=True):
    """Per-active-token detached weights (sequence modes: the same weight on every token); ``fold``:
    gmpo's geometric mean per sequence of token weights."""
    old, roll = seq["old"].detach(), seq["rollout"].detach()
    level, kind = cfg.rollout_correction.split("_")
    lo, hi = cfg.rollout_clip_min, cfg.rollout_clip_max
    if level == "seq":
        rho = [torch.exp(sum(old[t] - roll[t] for t in idx))] * len(idx)
    else:
        rho = [torch.exp(old[t] - roll[t]) for t in idx]
    weights = []
    for p in rho:
        if kind == "tis":
            weights.append(clamp(p, lo, hi))
        else:
            inside = (lo is None or p >= lo) and (hi is None or p <= hi)
            weights.append(p if inside else torch.zeros_like(p))
    if fold:
        weights = fold_gmpo(cfg, weights)
    return weights


def fold_gmpo(cfg, weights):
    if cfg.loss_type == "gmpo" and cfg.rollout_correction.startswith("token") and weights:
        geo = torch.exp(sum(torch.log(w) for w in weights) / len(weights))
        return [geo] * len(weights)
    return weights


def batch_rollout_weights(cfg, seqs):
    """Each sequence's weights (a list per sequence, [] without active tokens), batch-normalized
    when ``cfg.rollout_batch_normalize``: divided by their mean over the active tokens (token level)
    or over the sequences with an active token (sequence level), unless that mean is ≤ 1e-8; then
    gmpo's fold."""
    per_seq = []
    for seq in seqs:
        idx = [t for t in range(seq["mask"].shape[0]) if bool(seq["mask"][t])]
        per_seq.append(rollout_weights(cfg, seq, idx, fold=False) if idx else [])
    if cfg.rollout_batch_normalize:
        if cfg.rollout_correction.startswith("token"):
            values = [w for ws in per_seq for w in ws]
        else:
            values = [ws[0] for ws in per_seq if ws]
        if values:
            mean = sum(values) / len(values)
            if mean > 1e-8:
                per_seq = [[w / mean for w in ws] for ws in per_seq]
    return [fold_gmpo(cfg, ws) for ws in per_seq]


# ----------------------------------------------------------------------------------- aggregation


def aggregate(cfg, per_seq_terms, width, global_tokens=None, global_seqs=None):
    """per_seq_terms: for each sequence, the list of its active tokens' losses."""
    nonempty = [terms for terms in per_seq_terms if terms]
    total = sum((x for terms in nonempty for x in terms), torch.zeros((), dtype=torch.float64))
    n_tokens = sum(len(terms) for terms in nonempty)
    n_seqs = global_seqs if global_seqs is not None else len(nonempty)
    mode = cfg.aggregation
    if mode == "token-mean":
        denom = global_tokens if global_tokens is not None else n_tokens
        return total / denom if denom else total
    if mode == "seq-mean-token-mean":
        means = sum((sum(terms) / len(terms) for terms in nonempty), torch.zeros((), dtype=torch.float64))
        return means / n_seqs if n_seqs else means
    if mode == "seq-mean-token-sum":
        return total / n_seqs if n_seqs else total
    if mode == "seq-mean-token-sum-norm":
        length = cfg.norm_length if cfg.norm_length is not None else width
        return total / (n_seqs * length) if n_seqs else total
    raise AssertionError(mode)


def policy_loss(cfg, seqs, width, *, global_tokens=None, global_seqs=None):
    """The whole objective: agg(w·policy + kl_coef·KL) − entropy_coef·agg(H), float64."""
    losses, entropies = [], []
    weights = batch_rollout_weights(cfg, seqs) if cfg.rollout_correction is not None else None
    for i, seq in enumerate(seqs):
        idx, terms = policy_terms(cfg, seq)
        if weights is not None and idx:
            terms = [x * w for x, w in zip(terms, weights[i], strict=True)]
        if cfg.kl_coef > 0:
            terms = [
                x + cfg.kl_coef * kl_one(seq["logp"][t], seq["ref"][t], cfg.kl_estimator)
                for x, t in zip(terms, idx, strict=True)
            ]
        losses.append(terms)
        if cfg.entropy_coef != 0:
            entropies.append([seq["entropy"][t] for t in idx])
    loss = aggregate(cfg, losses, width, global_tokens, global_seqs)
    if cfg.entropy_coef != 0:
        loss = loss - cfg.entropy_coef * aggregate(cfg, entropies, width, global_tokens, global_seqs)
    return loss


# ------------------------------------------------------------------------------------- advantages


def group_advantages(rewards, groups, estimator, eps=1e-6, token_counts=None):
    """``groups``: list of lists of indices. Loops over groups and members in float64."""
    r = [float(x) for x in rewards]
    out = [0.0] * len(r)
    for members in groups:
        n = len(members)
        vals = [r[i] for i in members]
        mean = sum(vals) / n if n > 1 else 0.0
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else 1.0
        for i in members:
            if estimator == "grpo":
                out[i] = (r[i] - mean) / (std + eps)
            elif estimator in ("dr_grpo", "reinforce_pp_baseline"):
                out[i] = r[i] - mean
            elif estimator == "rloo":
                out[i] = r[i] - (sum(vals) - r[i]) / (n - 1) if n > 1 else r[i]
    if estimator == "reinforce_pp_baseline":
        c = [1.0] * len(r) if token_counts is None else [float(x) for x in token_counts]
        total = sum(c)
        mu = sum(ci * x for ci, x in zip(c, out, strict=True)) / total
        var = (
            sum(ci * (x - mu) ** 2 for ci, x in zip(c, out, strict=True)) / (total - 1) if total > 1 else 0.0
        )
        out = [(x - mu) / math.sqrt(var + eps) for x in out]
    return torch.tensor(out, dtype=torch.float64)
