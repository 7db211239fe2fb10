"""On-policy losses: ``old_logp=None`` means old_logp = sg[logp].

The ratio is 1 in value and its gradient is that of logp, for every loss type (sequence-level ones
included: gspo's sequence ratio is 1 with the gradient of the sequence's mean logp). Checked against
(1) the float64 oracle of ``formulas.py`` with old = logp (the oracle detaches it), (2) the closed
forms of each loss type at r = 1 written here, and (3) ``fused_policy_loss``, which must use the
log-probs it computes itself (composed path: the primitive runs once; token-level path: the
kernel's ``HAS_OLD=False`` branch) and equal ``policy_loss(token_logprobs(...), None, ...)``.
"""

import itertools
import math

import pytest
import torch

import rlkernel as rk
from rlkernel.rl import token_loss as tl_mod

from .helpers import (
    AGGREGATIONS,
    LOSS_CONFIGS,
    LOSS_TYPES,
    assert_close,
    config,
    grads,
    make_batch,
    oracle,
    pack,
)
from .mask_helpers import (
    F32_TOL,
    F64_TOL,
    assert_same,
    composed,
    force_passes,
    fused,
    interpreter_quiet,
    on_device,
    problem,
    triton_vs_reference,
)

CONFIG_NAMES = list(LOSS_CONFIGS)


def _on_policy(cfg, batch, **kwargs):
    return rk.policy_loss(
        batch["logp"],
        None,
        batch["advantages"],
        batch["mask"],
        cfg,
        ref_logp=batch["ref_logp"],
        rollout_logp=batch["rollout_logp"],
        entropy=batch["entropy"],
        **kwargs,
    )


def _oracle_on_policy(cfg, batch):
    """The float64 formula with old = logp (formulas.policy_terms detaches old)."""
    return oracle(cfg, {**batch, "old_logp": batch["logp"]})


@pytest.mark.parametrize(("name", "aggregation"), list(itertools.product(CONFIG_NAMES, AGGREGATIONS)))
def test_matches_the_oracle_with_old_equal_to_detached_logp(name, aggregation):
    cfg = config(name, aggregation=aggregation, kl_coef=0.1, entropy_coef=0.03)
    batch = make_batch(seed=3, per_token_adv=name in ("ppo", "gspo_token", "sapo"))
    out = _on_policy(cfg, batch)
    want = _oracle_on_policy(cfg, batch)
    assert_close(out.loss, want)
    for got, exp in zip(grads(out.loss, batch), grads(want, batch), strict=True):
        assert_close(got, exp)
    # the ratio is 1: no clipping, no drift
    assert out.metrics["ratio_mean"] == 1.0 and out.metrics["approx_kl"] == 0.0
    assert out.metrics["clip_frac"] == 0.0


def _closed_form_value(kind, cfg, lp, a):
    """One token's policy term at r = 1, from each loss type's formula: ppo, gspo_token, gspo and
    gmpo −A (s_i = 1; A = A_i per sequence), cispo and reinforce −A·logp, sapo −(4/τ)·σ(0)·A."""
    if kind in ("ppo", "gspo_token", "gspo", "gmpo"):
        return -a
    if kind in ("cispo", "reinforce"):
        return -a * lp
    tau = cfg.sapo_tau_pos if a > 0 else cfg.sapo_tau_neg
    return -(4.0 / tau) * 0.5 * a


@pytest.mark.parametrize("kind", LOSS_TYPES)
def test_value_and_gradient_are_the_policy_gradient_at_ratio_one(kind):
    """token-mean: loss = Σ_t value_t / N and dL/dlogp_t = −A_t / N for every loss type (the policy
    gradient): d r/d logp = 1 at r = 1; sapo's 4σ(0)(1 − σ(0)) = 1; gspo's and gmpo's sequence
    loss, copied on n_i tokens, has d s_i/d logp_t = 1/n_i on each copy."""
    cfg = config(kind, aggregation="token-mean")
    batch = make_batch(batch=5, width=7, seed=11)
    mask, lp, adv = batch["mask"], batch["logp"].detach(), batch["advantages"]
    n_tokens = int(mask.sum())
    value = torch.zeros((), dtype=torch.float64)
    grad = torch.zeros_like(lp)
    for i, t in itertools.product(range(mask.shape[0]), range(mask.shape[1])):
        if mask[i, t]:
            value += _closed_form_value(kind, cfg, lp[i, t], adv[i])
            grad[i, t] = -adv[i] / n_tokens
    out = rk.policy_loss(batch["logp"], None, adv, mask, cfg)
    (got,) = torch.autograd.grad(out.loss, batch["logp"])
    assert_close(out.loss, value / n_tokens)
    assert_close(got, grad)


def test_equals_passing_the_detached_logp_explicitly():
    """None is old_logp = logp.detach(), bitwise, for a loss with every term."""
    cfg = config("ppo", kl_coef=0.2, entropy_coef=0.01, rollout_correction="seq_tis", rollout_clip_min=0.5)
    batch = make_batch(seed=4)
    a = _on_policy(cfg, batch)
    b = rk.policy_loss(
        batch["logp"],
        batch["logp"].detach(),
        batch["advantages"],
        batch["mask"],
        cfg,
        ref_logp=batch["ref_logp"],
        rollout_logp=batch["rollout_logp"],
        entropy=batch["entropy"],
    )
    assert torch.equal(a.loss, b.loss)
    for x, y in zip(grads(a.loss, batch), grads(b.loss, batch), strict=True):
        assert torch.equal(x, y)
    assert all(torch.equal(a.metrics[k], b.metrics[k]) for k in b.metrics)


def test_rollout_correction_reads_the_current_logp_as_old():
    """On-policy token TIS: w = clamp(exp(sg[logp] − rollout_logp), max), from the formula."""
    cfg = config("reinforce", rollout_correction="token_tis", rollout_clip_max=1.2)
    batch = make_batch(seed=5)
    out = _on_policy(cfg, batch)
    lp, roll, m, adv = batch["logp"].detach(), batch["rollout_logp"], batch["mask"], batch["advantages"]
    total, count = torch.zeros((), dtype=torch.float64), 0
    for i, t in itertools.product(range(m.shape[0]), range(m.shape[1])):
        if m[i, t]:
            w = min(math.exp(float(lp[i, t] - roll[i, t])), 1.2)
            total += -w * adv[i] * lp[i, t]
            count += 1
    assert_close(out.loss, total / count)


def test_all_masked_and_packed():
    cfg = config("gspo", aggregation="seq-mean-token-sum", kl_coef=0.1)
    batch = make_batch(seed=6)
    batch["mask"] = torch.zeros_like(batch["mask"])
    out = _on_policy(cfg, batch)
    assert out.loss.item() == 0.0
    assert torch.count_nonzero(grads(out.loss, batch)[0]) == 0
    packed, cu, padded = pack(make_batch(seed=7), [6, 2, 5, 3])
    a = _on_policy(cfg, packed, cu_seqlens=cu)
    b = _on_policy(cfg, padded)
    torch.testing.assert_close(a.loss, b.loss, **F64_TOL)


# -------------------------------------------------------------------------------- fused
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("source", ["logits", "hidden"])
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_fused_equals_composition(name, source, packed):
    cfg = config(name, kl_coef=0.1, entropy_coef=0.02, rollout_correction="token_tis")
    p = problem(seed=len(name), packed=packed)
    assert_same(
        fused(cfg, p, source, old_logp=None), composed(cfg, p, source, old_logp=None), p, source, F64_TOL
    )


def test_fused_computes_the_log_probs_once(monkeypatch):
    """No second log-prob pass for the old log-probs: one primitive call on the composed path."""
    import rlkernel.rl.fused as fused_mod

    calls = []
    real = fused_mod.token_logprobs_checked

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_mod, "token_logprobs_checked", spy)  # seam: count the primitive's calls
    p = problem(seed=2)
    out = fused(config("gspo"), p, old_logp=None)
    torch.autograd.grad(out.loss, p["logits"])
    assert len(calls) == 1


def test_plan_has_no_old_and_matches_policy_loss():
    """The token-level plan of an on-policy call: no ``old`` tensor, HAS_OLD off, and the reference
    kernel gives policy_loss's loss and coefficients."""
    cfg = config("sapo", kl_coef=0.1, entropy_coef=0.05, aggregation="seq-mean-token-mean")
    batch = make_batch(seed=8, dtype=torch.float32)
    ids = torch.randint(0, 50, batch["mask"].shape, generator=torch.Generator().manual_seed(0))
    plan = tl_mod.build_plan(
        cfg,
        token_ids=ids,
        old_logp=None,
        advantages=batch["advantages"],
        mask=batch["mask"],
        ref_logp=batch["ref_logp"],
    )
    assert plan.old is None and plan.kernel_branches().HAS_OLD is False
    out = _on_policy(cfg, batch)
    g_logp, g_entropy = grads(out.loss, batch)
    for backend in ("reference", "triton"):
        terms = tl_mod.token_loss(
            plan, batch["logp"].reshape(-1), batch["entropy"].reshape(-1), backend=backend
        )
        torch.testing.assert_close(terms.loss, out.loss, **F32_TOL)
        torch.testing.assert_close(terms.g_logp, g_logp.reshape(-1), **F32_TOL)
        torch.testing.assert_close(terms.g_entropy, g_entropy.reshape(-1), **F32_TOL)


@interpreter_quiet
@pytest.mark.parametrize("two_pass", [False, True])
@pytest.mark.parametrize(
    ("name", "packed"), [("ppo", False), ("cispo", True), ("sapo", False), ("reinforce", True)]
)
def test_token_level_kernel_path(name, packed, two_pass, set_options):
    """Every loss branch of the kernels' on-policy (HAS_OLD off) form, block and row kernels."""
    passes = force_passes(set_options, two_pass)
    cfg = config(name, kl_coef=0.1, entropy_coef=0.02)
    p = on_device(problem(seed=len(name) + 1, packed=packed))
    # given rollout weights need no old log-probs: still eligible (HAS_OLD off, HAS_ROLLOUT on)
    weights = p["batch"]["rollout_weights"] if two_pass else None
    a, b, ga, gb = triton_vs_reference(cfg, p, old_logp=None, rollout_weights=weights)
    plan = "host" if packed or weights is not None else "device"
    assert (a.route.objective, a.route.passes, a.route.plan) == ("token", passes, plan), str(a.route)
    torch.testing.assert_close(a.loss, b.loss, **F32_TOL)
    torch.testing.assert_close(ga, gb, **F32_TOL)
    for key in b.metrics:
        torch.testing.assert_close(a.metrics[key], b.metrics[key], atol=1e-5, rtol=1e-5)


@interpreter_quiet
@pytest.mark.parametrize(
    "extra", [dict(rollout_correction="seq_tis"), dict(rollout_rs="token_k2", rollout_rs_max=0.02)]
)
def test_on_policy_rollout_terms_have_no_token_level_plan(extra, set_options):
    """Rollout weights and rejection of an on-policy call read this call's log-probs: not eligible."""
    force_passes(set_options)
    cfg = config("ppo", **extra)
    assert not tl_mod.is_eligible(cfg, on_policy=True) and tl_mod.is_eligible(cfg)
    p = on_device(problem(seed=9))
    a, b, ga, gb = triton_vs_reference(cfg, p, old_logp=None)
    assert a.route.objective == "autograd", str(a.route)
    torch.testing.assert_close(a.loss, b.loss, **F32_TOL)
    torch.testing.assert_close(ga, gb, **F32_TOL)


def test_bad_old_logp_still_rejected():
    batch = make_batch(seed=1)
    cfg = config("ppo")
    with pytest.raises(TypeError, match="old_logp"):
        rk.policy_loss(batch["logp"], "old", batch["advantages"], batch["mask"], cfg)
    with pytest.raises(ValueError, match="old_logp"):
        rk.policy_loss(batch["logp"], batch["logp"].detach()[:, :3], batch["advantages"], batch["mask"], cfg)
    with pytest.raises(TypeError, match="old_logp"):
        tl_mod.build_plan(cfg, token_ids=torch.zeros(4, 6, dtype=torch.long), old_logp=3.0,
                          advantages=batch["advantages"], mask=batch["mask"])  # fmt: skip


@interpreter_quiet
def test_token_level_linear_path(smallest_linear_chunks):
    """The hidden-state token-level path (chunked LM head, per-chunk plan rows) on-policy."""
    p = problem(seed=21)
    for name in ("hidden", "weight", "bias"):
        p[name] = p[name].detach().float().requires_grad_(True)
    p["batch"] = {k: v.float() if v.is_floating_point() else v for k, v in p["batch"].items()}
    cfg = config("cispo", kl_coef=0.1, entropy_coef=0.02)
    with rk.use_backend("triton"):
        a = fused(cfg, p, "hidden", old_logp=None)
        ga = torch.autograd.grad(a.loss, [p["hidden"], p["weight"], p["bias"]])
    with rk.use_backend("reference"):
        b = composed(cfg, p, "hidden", old_logp=None)
        gb = torch.autograd.grad(b.loss, [p["hidden"], p["weight"], p["bias"]])
    assert (a.route.source, a.route.objective, a.route.passes) == ("hidden", "token", 3), str(a.route)
    torch.testing.assert_close(a.loss, b.loss, **F32_TOL)
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)
