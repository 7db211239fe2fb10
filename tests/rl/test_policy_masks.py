"""TRL's masks on the policy term: the off-policy sequence mask (``off_policy_mask_threshold``) and
the top-entropy-quantile mask (``top_entropy_quantile``).

Each is a detached 0/1 weight on the policy term only (the KL term is not masked, the normalizers
still count the tokens); the entropy bonus is weighted by the entropy mask. Checked against float64
oracles written from the definitions, against TRL's own ``GRPOTrainer.get_off_policy_mask`` and
``get_high_entropy_mask`` (bit for bit), and ``fused_policy_loss`` (composed path: the masks need
the call's own log-probs / entropies) against ``policy_loss(token_logprobs(...))``.
"""

import itertools
import math

import pytest
import torch

import rlkernel as rk
from rlkernel.rl import masks
from rlkernel.rl import token_loss as tl_mod

from . import formulas
from .helpers import AGGREGATIONS, LOSS_CONFIGS, add_garbage, assert_close, config, grads, make_batch, pack
from .mask_helpers import (
    F32_TOL,
    F64_TOL,
    OneProcessAccelerator,
    assert_same,
    composed,
    force_passes,
    fused,
    interpreter_quiet,
    on_device,
    problem,
    triton_vs_reference,
    trl_grpo_methods,
)


def _run(cfg, batch, **kwargs):
    kw = {"ref_logp": batch["ref_logp"], "rollout_logp": batch["rollout_logp"], "entropy": batch["entropy"]}
    kw.update(kwargs)
    return rk.policy_loss(batch["logp"], batch["old_logp"], batch["advantages"], batch["mask"], cfg, **kw)


def _opsm_oracle(cfg, seq, idx, sampling):
    """o_t for the active tokens of one sequence: 1 if A_t >= 0 or mean(ŝ − logp) <= δ."""
    if cfg.off_policy_mask_threshold is None or not idx:
        return [1.0] * len(idx)
    drift = sum(float(sampling[t]) - float(seq["logp"][t].detach()) for t in idx) / len(idx)
    return [
        1.0 if (float(seq["adv"][t]) >= 0 or drift <= cfg.off_policy_mask_threshold) else 0.0 for t in idx
    ]


def _quantile(values, q):
    """Linear-interpolation quantile of a Python list (the definition torch.quantile implements)."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _oracle(cfg, batch, *, sampling_name="rollout_logp"):
    """float64 loops: ℓ_t = o_t·e_t·policy_t + kl_coef·KL_t, loss = agg(ℓ) − entropy_coef·agg(e·H)."""
    tensors = dict(
        logp=batch["logp"].double(),
        old=batch["old_logp"].double(),
        adv=batch["advantages"].double(),
        ref=batch["ref_logp"].double(),
        entropy=batch["entropy"].double(),
        sampling=batch[sampling_name].double(),
    )
    seqs = formulas.sequences_from_padded(batch["mask"], **tensors)
    all_h = [float(s["entropy"][t].detach()) for s in seqs for t in range(s["mask"].shape[0]) if s["mask"][t]]
    q = cfg.top_entropy_quantile
    tau = _quantile(all_h, 1.0 - q) if q < 1 and all_h else -math.inf
    losses, entropies = [], []
    for seq in seqs:
        idx, terms = formulas.policy_terms(cfg, seq)
        o = _opsm_oracle(cfg, seq, idx, seq["sampling"])
        e = [1.0 if float(seq["entropy"][t].detach()) >= tau else 0.0 for t in idx]
        terms = [x * ot * et for x, ot, et in zip(terms, o, e, strict=True)]
        if cfg.kl_coef > 0:
            terms = [
                x + cfg.kl_coef * formulas.kl_one(seq["logp"][t], seq["ref"][t], cfg.kl_estimator)
                for x, t in zip(terms, idx, strict=True)
            ]
        losses.append(terms)
        entropies.append([seq["entropy"][t] * et for t, et in zip(idx, e, strict=True)])
    width = batch["mask"].shape[1]
    loss = formulas.aggregate(cfg, losses, width)
    if cfg.entropy_coef != 0:
        loss = loss - cfg.entropy_coef * formulas.aggregate(cfg, entropies, width)
    return loss


def _batch(seed, **kw):
    """Entropies on a 0.25 grid (ties at the quantile) and wider drifts (OPSM masks something)."""
    b = make_batch(batch=6, width=7, seed=seed, **kw)
    b["entropy"] = (b["entropy"].detach() * 4).round() / 4
    b["rollout_logp"] = b["logp"].detach() + 3 * (b["rollout_logp"] - b["old_logp"]) + 0.2
    return {**b, "entropy": b["entropy"].clone().requires_grad_(True)}


@pytest.mark.parametrize(
    ("name", "aggregation"), list(itertools.product(LOSS_CONFIGS, ["token-mean", "seq-mean-token-mean"]))
)
@pytest.mark.parametrize(("delta", "quantile"), [(0.1, 1.0), (None, 0.3), (0.05, 0.5)])
def test_matches_the_oracle(name, aggregation, delta, quantile):
    cfg = config(
        name,
        aggregation=aggregation,
        kl_coef=0.1,
        entropy_coef=0.05,
        off_policy_mask_threshold=delta,
        top_entropy_quantile=quantile,
    )
    batch = _batch(seed=len(name), per_token_adv=name in ("ppo", "cispo"))
    out = _run(cfg, batch)
    want = _oracle(cfg, batch)
    assert_close(out.loss, want)
    for got, exp in zip(grads(out.loss, batch), grads(want, batch), strict=True):
        assert_close(got, exp)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_masks_keep_the_normalizers_and_the_kl(aggregation):
    """A masked policy term is a 0 weight: the loss equals the oracle whose normalizers count every
    active token; the KL term is not masked (its gradient reaches every active token)."""
    cfg = config("reinforce", aggregation=aggregation, kl_coef=0.5, top_entropy_quantile=0.0)
    batch = _batch(seed=3)
    out = _run(cfg, batch)
    assert_close(out.loss, _oracle(cfg, batch))
    g_logp, _ = grads(out.loss, batch)
    assert (g_logp[batch["mask"]] != 0).all()
    assert out.metrics["entropy_frac_masked"] > 0.5


def test_without_rollout_logp_opsm_reads_old_logp_and_on_policy_keeps_everything():
    cfg = config("ppo", off_policy_mask_threshold=0.0)
    batch = _batch(seed=4)
    out = _run(cfg, batch, rollout_logp=None)
    assert_close(out.loss, _oracle(cfg, batch, sampling_name="old_logp"))
    assert out.metrics["off_policy_frac_masked"] > 0
    # on-policy without rollout_logp: ŝ = sg[logp], D = 0 <= δ: the mask is off
    a = rk.policy_loss(batch["logp"], None, batch["advantages"], batch["mask"], cfg)
    b = rk.policy_loss(batch["logp"], None, batch["advantages"], batch["mask"], config("ppo"))
    assert torch.equal(a.loss, b.loss) and a.metrics["off_policy_frac_masked"] == 0


def test_packed_equals_padded_and_garbage_is_ignored():
    cfg = config("sapo", off_policy_mask_threshold=0.1, top_entropy_quantile=0.4, entropy_coef=0.1)
    packed, cu, padded = pack(_batch(seed=5), [7, 3, 5, 1, 6, 2])
    a = _run(cfg, packed, cu_seqlens=cu)
    b = _run(cfg, add_garbage(padded))
    torch.testing.assert_close(a.loss, b.loss, **F64_TOL)


def test_non_finite_inputs_give_nan():
    """NaN or ±inf in what a mask reads at an active token is a NaN loss, not a silently dropped or
    kept token (TRL zeroes NaN drift: see rlkernel.rl.masks)."""
    for name in ("rollout_logp", "entropy"):
        for value in (float("nan"), float("inf")):
            batch = _batch(seed=6)
            x = batch[name].detach().clone()
            x[0, 0] = value  # active
            batch[name] = x.requires_grad_(name == "entropy")
            cfg = config("ppo", off_policy_mask_threshold=0.1, top_entropy_quantile=0.5)
            assert math.isnan(_run(cfg, batch).loss.item()), (name, value)


# ------------------------------------------------------------------------------ TRL's own code
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_trl_off_policy_mask_bit_for_bit(per_token_adv):
    get_off_policy_mask = trl_grpo_methods()["get_off_policy_mask"]
    batch = _batch(seed=7, dtype=torch.float32, per_token_adv=per_token_adv, empty_row=False)
    adv = batch["advantages"] if per_token_adv else batch["advantages"][:, None]
    m = batch["mask"]
    for delta in (0.0, 0.05, 0.3):
        trl = get_off_policy_mask(adv, batch["logp"], batch["rollout_logp"], m.float(), delta)
        ours = masks.off_policy_weight(batch["logp"], batch["rollout_logp"], adv.expand(m.shape), m, delta)
        assert torch.equal(ours[m], trl.expand(m.shape)[m]), delta
    assert 0 < ours[m].sum() < m.sum()


@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5, 0.73, 0.999, 1.0])
def test_trl_high_entropy_mask_bit_for_bit(quantile):
    """Ties (entropies on a 0.25 grid) are kept on both sides; masked positions never are."""
    get_high_entropy_mask = trl_grpo_methods()["get_high_entropy_mask"]
    trainer = type("Trainer", (), {"accelerator": OneProcessAccelerator()})()
    batch = _batch(seed=8, dtype=torch.float32)
    h, m = batch["entropy"].detach(), batch["mask"]
    trl = get_high_entropy_mask(trainer, h, m.float(), 1.0 - quantile)
    ours = masks.entropy_weight(h, m, quantile)
    assert torch.equal(ours == 1, trl)
    assert torch.equal(ours[~m], torch.zeros_like(ours[~m]))


@pytest.mark.parametrize("n", [1, 2, 7, 50])
def test_quantile_threshold_is_torch_quantile(n):
    g = torch.Generator().manual_seed(n)
    for dtype in (torch.float32, torch.float64):
        values = torch.rand(4, 13, generator=g).to(dtype)
        mask = torch.zeros(4 * 13, dtype=torch.bool)
        mask[torch.randperm(4 * 13, generator=g)[:n]] = True
        mask = mask.reshape(4, 13)
        for q in (0.0, 0.1, 1 / 3, 0.5, 0.8, 1.0):
            want = torch.quantile(values[mask], q)
            assert torch.equal(masks.quantile_threshold(values, mask, q), want), (n, dtype, q)
    assert masks.quantile_threshold(values, torch.zeros_like(mask), 0.5) == math.inf


def test_trl_shaped_loss():
    """TRL's ``_compute_loss`` for loss_type="grpo" (retyped: −min(rA, clip(r)A), ·opsm, ·entropy
    mask, per-sequence token mean, mean over sequences), with TRL's own two masks."""
    methods = trl_grpo_methods()
    trainer = type("Trainer", (), {"accelerator": OneProcessAccelerator()})()
    batch = _batch(seed=9, dtype=torch.float32, empty_row=False)
    m, lp, old, roll = batch["mask"], batch["logp"], batch["old_logp"], batch["rollout_logp"]
    adv = batch["advantages"][:, None]
    emask = methods["get_high_entropy_mask"](trainer, batch["entropy"].detach(), m.float(), 1 - 0.3)
    opsm = methods["get_off_policy_mask"](adv, lp, roll, m.float(), 0.1)
    r = torch.exp(lp - old)
    per_token = -torch.min(r * adv, r.clamp(1 - 0.2, 1 + 0.28) * adv) * opsm * emask
    trl = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    cfg = config(
        "ppo",
        clip_high=0.28,
        dual_clip=None,
        aggregation="seq-mean-token-mean",
        off_policy_mask_threshold=0.1,
        top_entropy_quantile=0.3,
    )
    ours = _run(cfg, batch)
    torch.testing.assert_close(ours.loss, trl, **F32_TOL)
    g_ours, _ = grads(ours.loss, batch)
    (g_trl,) = torch.autograd.grad(trl, batch["logp"])
    torch.testing.assert_close(g_ours, g_trl, **F32_TOL)


# ------------------------------------------------------------------------------------- fused
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("source", ["logits", "hidden"])
@pytest.mark.parametrize(
    ("delta", "quantile", "entropy_coef"), [(0.05, 1.0, 0.0), (None, 0.4, 0.0), (0.1, 0.5, 0.02)]
)
def test_fused_equals_composition(delta, quantile, entropy_coef, source, packed):
    cfg = config(
        "ppo",
        kl_coef=0.1,
        entropy_coef=entropy_coef,
        off_policy_mask_threshold=delta,
        top_entropy_quantile=quantile,
    )
    p = problem(seed=11, packed=packed)
    assert_same(fused(cfg, p, source), composed(cfg, p, source), p, source, F64_TOL)
    if quantile < 1:  # the entropy is computed for the mask even without an entropy term
        assert "entropy_mean" in fused(cfg, p, source).metrics


@interpreter_quiet
@pytest.mark.parametrize("fields", [dict(off_policy_mask_threshold=0.05), dict(top_entropy_quantile=0.4)])
def test_not_eligible_for_the_token_level_path(fields, set_options):
    force_passes(set_options)
    cfg = config("ppo", **fields)
    assert not tl_mod.is_eligible(cfg)
    p = on_device(problem(seed=12))
    a, b, ga, gb = triton_vs_reference(cfg, p)
    assert a.route.objective == "autograd", str(a.route)
    torch.testing.assert_close(a.loss, b.loss, **F32_TOL)
    torch.testing.assert_close(ga, gb, **F32_TOL)


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        (dict(off_policy_mask_threshold=-0.1), ValueError, "off_policy_mask_threshold"),
        (dict(off_policy_mask_threshold=float("nan")), ValueError, "off_policy_mask_threshold"),
        (dict(off_policy_mask_threshold=1e39), ValueError, "off_policy_mask_threshold"),
        (dict(off_policy_mask_threshold="0.5"), TypeError, "off_policy_mask_threshold"),
        (dict(top_entropy_quantile=1.5), ValueError, "top_entropy_quantile"),
        (dict(top_entropy_quantile=-0.1), ValueError, "top_entropy_quantile"),
        (dict(top_entropy_quantile=float("nan")), ValueError, "top_entropy_quantile"),
        (dict(top_entropy_quantile=None), TypeError, "top_entropy_quantile"),
        (dict(top_entropy_quantile=True), TypeError, "top_entropy_quantile"),
    ],
)
def test_config_errors_name_the_field(fields, error, match):
    with pytest.raises(error, match=match):
        rk.PolicyLossConfig(**fields)


def test_entropy_is_required_for_the_quantile():
    batch = _batch(seed=13)
    with pytest.raises(ValueError, match="entropy is required when cfg.top_entropy_quantile < 1"):
        _run(config("ppo", top_entropy_quantile=0.5), batch, entropy=None)
