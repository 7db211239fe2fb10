"""Precomputed rollout importance weights (``rollout_weights=``, verl's ``rollout_is_weights``).

ℓ_t = w_t·policy_t + kl_coef·KL_t with w detached (``gmpo``: the geometric mean of the sequence's
weights, as verl's ``geo_mean``). Checked against a float64 oracle built from ``formulas.py``,
against ``cfg.rollout_correction`` computing the same weights, and against verl's own
``compute_rollout_correction_weights`` + ``compute_policy_loss_vanilla``.
"""

import itertools
import math

import pytest
import torch

import rlkernel as rk
from rlkernel.rl import token_loss as tl_mod

from . import formulas
from .helpers import (
    AGGREGATIONS,
    LOSS_CONFIGS,
    add_garbage,
    assert_close,
    config,
    grads,
    make_batch,
    pack,
    run,
)
from .mask_helpers import (
    F32_TOL,
    F64_TOL,
    VerlActorConfig,
    assert_same,
    composed,
    force_passes,
    fused,
    interpreter_quiet,
    on_device,
    problem,
    triton_vs_reference,
    verl_modules,
)


def _weights(batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(batch["mask"].shape, generator=g, dtype=batch["logp"].dtype) * 1.8 + 0.05


def _run(cfg, batch, weights, **kwargs):
    return run(cfg, batch, rollout_weights=weights, **kwargs)


def _oracle(cfg, batch, weights, cu=None):
    """float64 loops: per sequence, the policy terms times their weights (gmpo: times the geometric
    mean of the weights), plus the KL, aggregated; minus the entropy bonus."""
    tensors = dict(
        logp=batch["logp"].double(),
        old=batch["old_logp"].double(),
        adv=batch["advantages"].double(),
        ref=batch["ref_logp"].double(),
        entropy=batch["entropy"].double(),
        w=weights.double(),
    )
    if cu is None:
        seqs, width = formulas.sequences_from_padded(batch["mask"], **tensors), batch["mask"].shape[1]
    else:
        seqs = formulas.sequences_from_packed(cu, batch["mask"], **tensors)
        width = max(int(b - a) for a, b in zip(cu[:-1], cu[1:], strict=True))
    losses, entropies = [], []
    for seq in seqs:
        idx, terms = formulas.policy_terms(cfg, seq)
        w = [seq["w"][t] for t in idx]
        if cfg.loss_type == "gmpo" and idx:
            w = [torch.exp(sum(torch.log(x) for x in w) / len(w))] * len(idx)
        terms = [x * wt for x, wt in zip(terms, w, strict=True)]
        if cfg.kl_coef > 0:
            terms = [
                x + cfg.kl_coef * formulas.kl_one(seq["logp"][t], seq["ref"][t], cfg.kl_estimator)
                for x, t in zip(terms, idx, strict=True)
            ]
        losses.append(terms)
        entropies.append([seq["entropy"][t] for t in idx])
    loss = formulas.aggregate(cfg, losses, width)
    if cfg.entropy_coef != 0:
        loss = loss - cfg.entropy_coef * formulas.aggregate(cfg, entropies, width)
    return loss


@pytest.mark.parametrize(("name", "aggregation"), list(itertools.product(LOSS_CONFIGS, AGGREGATIONS)))
def test_matches_the_oracle(name, aggregation):
    cfg = config(name, aggregation=aggregation, kl_coef=0.1, entropy_coef=0.02)
    batch = make_batch(seed=len(name), per_token_adv=name == "ppo")
    weights = _weights(batch, seed=1)
    out = _run(cfg, batch, weights)
    want = _oracle(cfg, batch, weights)
    assert_close(out.loss, want)
    for got, exp in zip(grads(out.loss, batch), grads(want, batch), strict=True):
        assert_close(got, exp)
    if name != "gmpo":  # (gmpo reports the folded weight it applies)
        assert_close(out.metrics["rollout_weight_mean"], weights[batch["mask"]].mean())


def test_packed_equals_padded_and_garbage_is_ignored():
    cfg = config("cispo", aggregation="seq-mean-token-mean")
    packed, cu, padded = pack(make_batch(seed=3), [6, 1, 4, 2])
    w_packed = torch.rand(packed["logp"].shape, dtype=torch.float64) + 0.2
    w_padded = torch.full(padded["mask"].shape, float("nan"), dtype=torch.float64)
    starts = [0, 6, 7, 11]
    for i, (s, n) in enumerate(zip(starts, [6, 1, 4, 2], strict=True)):
        w_padded[i, :n] = w_packed[s : s + n]
    a = _run(cfg, packed, w_packed, cu_seqlens=cu)
    assert_close(a.loss, _oracle(cfg, packed, w_packed, cu=cu))
    b = _run(cfg, add_garbage(padded), w_padded)  # NaN weights (and inputs) at masked positions
    torch.testing.assert_close(a.loss, b.loss, **F64_TOL)


@pytest.mark.parametrize("level", ["token", "seq"])
@pytest.mark.parametrize("kind", ["tis", "mis"])
def test_equal_to_the_correction_that_computes_the_same_weights(level, kind):
    """w = the correction's formula, computed here from old/rollout log-probs and passed in."""
    lo, hi = 0.6, 1.5
    batch = make_batch(batch=5, width=7, seed=4)
    m, old, roll = batch["mask"], batch["old_logp"], batch["rollout_logp"]
    log_rho = torch.where(m, old - roll, 0.0)
    if level == "seq":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    rho = torch.exp(log_rho)
    w = rho.clamp(lo, hi) if kind == "tis" else torch.where((rho >= lo) & (rho <= hi), rho, 0.0)
    corrected = config("ppo", rollout_correction=f"{level}_{kind}", rollout_clip_min=lo, rollout_clip_max=hi)
    a = _run(config("ppo"), batch, w)
    b = _run(corrected, batch, None)
    torch.testing.assert_close(a.loss, b.loss, **F64_TOL)
    for x, y in zip(grads(a.loss, batch), grads(b.loss, batch), strict=True):
        torch.testing.assert_close(x, y, **F64_TOL)


@pytest.mark.parametrize(("level", "threshold"), [("token", 2.0), ("sequence", 2.0), ("token", "0.7_1.6")])
def test_verl_rollout_is_weights_in_verl_vanilla_loss(level, threshold):
    """verl's pipeline: IS weights from rollout_corr_helper, the PPO loss from core_algos with
    ``rollout_is_weights``; ours with the same weights as ``rollout_weights`` (and, for TIS, with
    ``cfg.rollout_correction`` computing them itself)."""
    helper, core = verl_modules()
    batch = make_batch(batch=6, width=8, seed=5, dtype=torch.float32, empty_row=False)
    m, old, roll = batch["mask"], batch["old_logp"], batch["rollout_logp"]
    adv = batch["advantages"][:, None].expand(m.shape).contiguous()
    w, _ = helper.compute_rollout_correction_weights(
        log_ratio=old - roll, response_mask=m.float(), rollout_is=level, rollout_is_threshold=threshold
    )
    logp_verl = batch["logp"].detach().clone().requires_grad_(True)
    verl_loss, _ = core.compute_policy_loss_vanilla(
        old, logp_verl, adv, m.float(), "token-mean", VerlActorConfig(0.2, 0.28, 3.0), rollout_is_weights=w
    )
    (verl_grad,) = torch.autograd.grad(verl_loss, logp_verl)
    cfg = config("ppo", clip_low=0.2, clip_high=0.28, dual_clip=3.0, aggregation="token-mean")
    ours = rk.policy_loss(batch["logp"], old, adv, m, cfg, rollout_weights=w)
    (grad,) = torch.autograd.grad(ours.loss, batch["logp"])
    torch.testing.assert_close(ours.loss, verl_loss, **F32_TOL)
    torch.testing.assert_close(grad, verl_grad, **F32_TOL)
    if threshold == 2.0:  # TIS: the built-in correction gives the same weights (no ρ beyond e^20 here)
        mode = "token_tis" if level == "token" else "seq_tis"
        own = rk.policy_loss(
            batch["logp"], old, adv, m, rk.PolicyLossConfig(**{**cfg.__dict__, "rollout_correction": mode}),
            rollout_logp=roll,
        )  # fmt: skip
        torch.testing.assert_close(own.loss, verl_loss, **F32_TOL)


def test_non_finite_weight_at_an_active_token_gives_nan():
    batch = make_batch(seed=6)
    for bad in (float("nan"), float("inf"), -float("inf")):
        w = _weights(batch)
        w[0, 0] = bad  # (0, 0) is active
        assert math.isnan(_run(config("ppo"), batch, w).loss.item())


def test_the_plan_carries_the_weights():
    cfg = config("ppo", aggregation="seq-mean-token-sum")
    batch = make_batch(seed=7, dtype=torch.float32)
    w = _weights(batch)
    plan = tl_mod.build_plan(
        cfg,
        token_ids=torch.zeros(batch["mask"].shape, dtype=torch.long),
        old_logp=batch["old_logp"],
        advantages=batch["advantages"],
        mask=batch["mask"],
        rollout_weights=w,
    )
    assert torch.equal(plan.rollout_w, torch.where(batch["mask"], w, 0.0).reshape(-1))
    out = _run(cfg, batch, w)
    g_logp, _ = grads(out.loss, batch)
    terms = tl_mod.token_loss(plan, batch["logp"].reshape(-1), backend="reference")
    torch.testing.assert_close(terms.loss, out.loss, **F32_TOL)
    torch.testing.assert_close(terms.g_logp, g_logp.reshape(-1), **F32_TOL)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("source", ["logits", "hidden"])
@pytest.mark.parametrize("name", list(LOSS_CONFIGS))
def test_fused_equals_composition(name, source, packed):
    cfg = config(name, kl_coef=0.1, entropy_coef=0.02)
    p = problem(seed=len(name) + 2, packed=packed)
    w = p["batch"]["rollout_weights"]
    a = fused(cfg, p, source, rollout_weights=w)
    b = composed(cfg, p, source, rollout_weights=w)
    assert_same(a, b, p, source, F64_TOL)


@interpreter_quiet
@pytest.mark.parametrize("two_pass", [False, True])
@pytest.mark.parametrize("name", ["ppo", "sapo"])
def test_token_level_kernel_path(name, two_pass, set_options):
    passes = force_passes(set_options, two_pass)
    cfg = config(name, kl_coef=0.1, aggregation="seq-mean-token-mean")
    p = on_device(problem(seed=3, packed=name == "sapo"))
    a, b, ga, gb = triton_vs_reference(cfg, p, rollout_weights=p["batch"]["rollout_weights"])
    assert (a.route.objective, a.route.passes, a.route.plan) == ("token", passes, "host"), str(a.route)
    torch.testing.assert_close(a.loss, b.loss, **F32_TOL)
    torch.testing.assert_close(ga, gb, **F32_TOL)


def test_bad_inputs_name_the_argument():
    batch = make_batch(seed=8)
    w = _weights(batch)
    with pytest.raises(ValueError, match="rollout_weights or set cfg.rollout_correction"):
        _run(config("ppo", rollout_correction="token_tis"), batch, w)
    with pytest.raises(ValueError, match="rollout_weights"):
        _run(config("ppo"), batch, w[:, :3])
    with pytest.raises(TypeError, match="rollout_weights"):
        _run(config("ppo"), batch, (w > 1).long())
    with pytest.raises(TypeError, match="rollout_weights"):
        _run(config("ppo"), batch, w.tolist())
    with pytest.raises(ValueError, match="rollout_weights"):
        _run(config("ppo"), batch, w.to("meta"))
    p = problem(seed=1)
    with pytest.raises(ValueError, match="rollout_weights"):
        fused(config("ppo"), p, rollout_weights=w[:3, :2])
