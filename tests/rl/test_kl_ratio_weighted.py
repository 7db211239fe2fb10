"""``kl_ratio_weighted`` (TRL ``use_bias_correction_kl``): the per-token KL times the importance
ratio (r_t; gspo: s_i; gspo_token: s_it), not detached, as TRL's ``per_token_kl * coef_1``.

Against the float64 oracle for every loss type and two estimators, padded and packed; the on-policy
property that pins the gradient of the ratio factor; the metric; and the fused path, which must
keep the composed algebra (the kernel's KL branch has no ratio factor).
"""

import pytest
import torch

import rlkernel as rk
from rlkernel.rl import token_loss as tl_mod

from .formulas_more import MORE_LOSS_CONFIGS
from .formulas_more import oracle as oracle_more
from .helpers import LOSS_CONFIGS, assert_close, grads, make_batch, pack, run

ALL = {**LOSS_CONFIGS, **MORE_LOSS_CONFIGS}


def cfg_of(name, **overrides):
    return rk.PolicyLossConfig(**{**ALL[name], **overrides})


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("estimator", ["k3", "k1+"])
@pytest.mark.parametrize("name", list(ALL))
def test_matches_formula(name, estimator, layout):
    cfg = cfg_of(name, kl_coef=0.3, kl_estimator=estimator, kl_ratio_weighted=True)
    batch = make_batch(4, 6, seed=len(name) + len(estimator))
    kwargs = {}
    if layout == "packed":
        batch, kwargs["cu_seqlens"], _ = pack(batch, [6, 0, 2, 5])
    torch.manual_seed(0)
    out = run(cfg, batch, **kwargs)
    torch.manual_seed(0)
    expected = oracle_more(cfg, batch, kwargs.get("cu_seqlens"))
    assert_close(out.loss, expected)
    for got, want in zip(grads(out.loss, batch), grads(expected, batch), strict=True):
        assert_close(got, want)
    # ... and the weighting changes the loss (the test could fail).
    torch.manual_seed(0)
    plain = run(cfg_of(name, kl_coef=0.3, kl_estimator=estimator), batch, **kwargs)
    assert not torch.allclose(plain.loss, out.loss)


def test_on_policy_value_is_unchanged_but_the_ratio_carries_a_gradient():
    """r = 1 at logp = old: the same value, and d(K·r)/dlogp = K' + K (TRL's coef_1 is not detached)."""
    batch = make_batch(3, 5, seed=4)
    batch = dict(batch, old_logp=batch["logp"].detach().clone())
    cfg = rk.PolicyLossConfig(loss_type="reinforce", kl_coef=1.0, aggregation="token-sum")
    weighted = run(rk.PolicyLossConfig(**{**vars(cfg), "kl_ratio_weighted": True}), batch)
    plain = run(cfg, batch)
    assert_close(weighted.loss, plain.loss)
    kl = rk.kl_penalty(batch["logp"].detach(), batch["ref_logp"], "k3")
    extra = torch.where(batch["mask"], kl, 0.0)
    assert_close(grads(weighted.loss, batch)[0], grads(plain.loss, batch)[0] + extra)


def test_kl_ref_metric_is_the_weighted_kl():
    batch = make_batch(4, 6, seed=5)
    cfg = rk.PolicyLossConfig(kl_coef=0.0, kl_ratio_weighted=True)  # monitoring only
    out = run(cfg, batch)
    lr = (batch["logp"] - batch["old_logp"]).detach().clamp(-20, 20)
    kl = rk.kl_penalty(batch["logp"].detach(), batch["ref_logp"], "k3") * torch.exp(lr)
    m = batch["mask"]
    assert_close(out.metrics["kl_ref"], torch.where(m, kl, 0.0).sum() / m.sum())


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_not_eligible_and_the_fused_call_takes_the_coefficient_path(monkeypatch):
    """No token-level plan (the kernel's KL branch has no ratio factor): the fused call takes the
    coefficient path (the algebra differentiated inside the forward) and equals the composition."""
    cfg = rk.PolicyLossConfig(kl_coef=0.2, kl_ratio_weighted=True)
    assert not tl_mod.is_eligible(cfg) and tl_mod.is_eligible(rk.PolicyLossConfig(kl_coef=0.2))
    calls = []
    monkeypatch.setattr(tl_mod, "plan_from_batch", lambda *a, **k: calls.append(1))  # seam: never called
    g = torch.Generator().manual_seed(1)
    batch = make_batch(2, 4, seed=6, dtype=torch.float32)
    ids = torch.randint(0, 7, (2, 4), generator=g)
    logits = torch.randn(2, 4, 7, generator=g).requires_grad_(True)
    kw = dict(
        token_ids=ids,
        old_logp=batch["old_logp"],
        advantages=batch["advantages"],
        mask=batch["mask"],
        ref_logp=batch["ref_logp"],
    )
    with rk.use_backend("triton"):
        fused = rk.fused_policy_loss(cfg, logits=logits, **kw)
    assert not calls
    logp = rk.token_logprobs(logits, torch.where(batch["mask"], ids, -100))
    composed = rk.policy_loss(
        logp, batch["old_logp"], batch["advantages"], batch["mask"], cfg, ref_logp=batch["ref_logp"]
    )
    torch.testing.assert_close(fused.loss, composed.loss, atol=2e-6, rtol=2e-5)
