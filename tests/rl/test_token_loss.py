"""Token-level loss plans (``rlkernel.rl.token_loss``) against ``policy_loss`` under autograd.

The plan + the reference kernel must give ``policy_loss``'s loss and, as coefficients, its gradients
dL/dlogp and dL/dentropy, for every eligible config: loss types, aggregations (with and without
global normalizers), KL estimators, rollout corrections, padded and packed. The Triton kernel is
checked against the same reference in ``tests/kernels/test_token_loss_kernel.py``.
"""

import itertools

import pytest
import torch

import rlkernel as rk
from rlkernel.rl import token_loss as tl_mod

from .helpers import AGGREGATIONS, LOSS_CONFIGS, add_garbage, config, grads, make_batch, pack

F32 = torch.float32
TOL = dict(atol=2e-6, rtol=2e-5)
ELIGIBLE = [n for n, c in LOSS_CONFIGS.items() if c["loss_type"] in tl_mod.ELIGIBLE_LOSS_TYPES]
KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "k1+", "k3+", "k3_unclamped")
CORRECTIONS = ("token_tis", "seq_tis", "token_mis", "seq_mis")


def _ids(mask, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, mask.shape, generator=g)


def _check(cfg, batch, *, cu=None, **norms):
    """Plan + reference == policy_loss (loss and gradients wrt logp and entropy)."""
    want_entropy = cfg.entropy_coef != 0
    out = rk.policy_loss(
        batch["logp"],
        batch["old_logp"],
        batch["advantages"],
        batch["mask"],
        cfg,
        ref_logp=batch["ref_logp"],
        rollout_logp=batch["rollout_logp"],
        entropy=batch["entropy"] if want_entropy else None,
        cu_seqlens=cu,
        **norms,
    )
    g_logp, g_entropy = grads(out.loss, batch)
    plan = tl_mod.build_plan(
        cfg,
        token_ids=_ids(batch["mask"]),
        old_logp=batch["old_logp"],
        advantages=batch["advantages"],
        mask=batch["mask"],
        ref_logp=batch["ref_logp"],
        rollout_logp=batch["rollout_logp"],
        cu_seqlens=cu,
        **norms,
    )
    entropy = batch["entropy"].reshape(-1) if want_entropy else None
    terms = tl_mod.token_loss(plan, batch["logp"].reshape(-1), entropy, backend="reference")
    torch.testing.assert_close(terms.loss, out.loss.to(F32), **TOL)
    torch.testing.assert_close(terms.g_logp, g_logp.reshape(-1).to(F32), **TOL)
    if want_entropy:
        torch.testing.assert_close(terms.g_entropy, g_entropy.reshape(-1).to(F32), **TOL)
    else:
        assert terms.g_entropy is None
    return plan, terms


@pytest.mark.parametrize(("name", "aggregation"), list(itertools.product(ELIGIBLE, AGGREGATIONS)))
def test_plan_matches_policy_loss(name, aggregation):
    cfg = config(name, aggregation=aggregation, kl_coef=0.1, entropy_coef=0.03)
    _check(cfg, make_batch(4, 7, seed=len(name), dtype=F32))


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("correction", (None, *CORRECTIONS))
def test_kl_estimators_and_rollout_corrections(estimator, correction):
    cfg = config(
        "ppo",
        kl_coef=0.2,
        kl_estimator=estimator,
        rollout_correction=correction,
        rollout_clip_min=0.8 if correction else None,
        rollout_clip_max=1.2,
    )
    batch = make_batch(4, 6, seed=3, dtype=F32)
    with torch.no_grad():  # far drifts so that the k3 clamps (|d| > 2.6) bite too (not k3_unclamped's)
        batch["ref_logp"][0, :3] = batch["logp"][0, :3] + torch.tensor([-4.0, 12.0, 0.0])
    _check(cfg, batch)


@pytest.mark.parametrize("name", ELIGIBLE)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_global_normalizers(name, aggregation):
    cfg = config(name, aggregation=aggregation, norm_length=9)
    batch = make_batch(3, 5, seed=11, dtype=F32)
    _check(cfg, batch, global_tokens=23.0, global_seqs=torch.tensor(7))
    _check(cfg, batch, global_tokens=torch.tensor(17.5), global_seqs=4)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_packed_matches_policy_loss(aggregation, per_token_adv):
    cfg = config("ppo", aggregation=aggregation, kl_coef=0.1, rollout_correction="seq_mis")
    batch = make_batch(3, 6, seed=5, dtype=F32, per_token_adv=per_token_adv)
    packed, cu, _ = pack(batch, [6, 2, 4])
    _check(cfg, packed, cu=cu)


def test_garbage_at_masked_positions_is_ignored():
    cfg = config("ppo", kl_coef=0.1, entropy_coef=0.05, rollout_correction="token_tis")
    batch = add_garbage(make_batch(4, 6, seed=2, dtype=F32, per_token_adv=True))
    _, terms = _check(cfg, batch)
    assert torch.isfinite(terms.loss) and torch.isfinite(terms.g_logp).all()


def test_all_masked_batch_gives_zero():
    batch = make_batch(3, 4, seed=1, dtype=F32)
    batch["mask"] = torch.zeros_like(batch["mask"])
    _, terms = _check(config("sapo", kl_coef=0.1), batch)
    assert terms.loss.item() == 0.0 and torch.equal(terms.g_logp, torch.zeros_like(terms.g_logp))


def test_nan_at_active_token_propagates():
    batch = make_batch(3, 4, seed=1, dtype=F32)
    with torch.no_grad():
        batch["logp"][0, 0] = float("nan")  # (0, 0) is active
    plan = tl_mod.build_plan(
        config("ppo"),
        token_ids=_ids(batch["mask"]),
        old_logp=batch["old_logp"],
        advantages=batch["advantages"],
        mask=batch["mask"],
    )
    assert torch.isnan(tl_mod.token_loss(plan, batch["logp"].reshape(-1), backend="reference").loss)


def test_row_slices_add_up():
    cfg = config("cispo", aggregation="seq-mean-token-mean", entropy_coef=0.1)
    batch = make_batch(4, 6, seed=8, dtype=F32)
    plan, whole = _check(cfg, batch)
    logp, ent = batch["logp"].detach().reshape(-1), batch["entropy"].detach().reshape(-1)
    cuts = [0, 5, 6, 17, 24]
    parts = [
        tl_mod.token_loss(plan, logp[a:b], ent[a:b], start=a, stop=b) for a, b in itertools.pairwise(cuts)
    ]
    torch.testing.assert_close(sum(p.loss for p in parts), whole.loss, **TOL)
    assert torch.equal(torch.cat([p.g_logp for p in parts]), whole.g_logp)
    assert torch.equal(torch.cat([p.g_entropy for p in parts]), whole.g_entropy)


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "gmpo"])
def test_sequence_coupled_losses_are_not_eligible(name):
    cfg = config(name)
    assert not tl_mod.is_eligible(cfg)
    batch = make_batch(2, 3, dtype=F32)
    with pytest.raises(ValueError, match="token-level"):
        tl_mod.build_plan(
            cfg,
            token_ids=_ids(batch["mask"]),
            old_logp=batch["old_logp"],
            advantages=batch["advantages"],
            mask=batch["mask"],
        )


def test_bad_inputs_name_the_argument():
    batch = make_batch(2, 3, dtype=F32)
    kw = dict(token_ids=_ids(batch["mask"]), advantages=batch["advantages"], mask=batch["mask"])
    with pytest.raises(ValueError, match="old_logp"):
        tl_mod.build_plan(config("ppo"), old_logp=batch["old_logp"][:, :2], **kw)
    with pytest.raises(ValueError, match="ref_logp"):
        tl_mod.build_plan(config("ppo", kl_coef=0.1), old_logp=batch["old_logp"], **kw)
    with pytest.raises(ValueError, match="advantages"):
        tl_mod.build_plan(config("ppo"), old_logp=batch["old_logp"], **{**kw, "advantages": torch.randn(5)})
    plan = tl_mod.build_plan(config("ppo"), old_logp=batch["old_logp"], **kw)
    with pytest.raises(ValueError, match="row range"):
        tl_mod.token_loss(plan, torch.zeros(3), start=4, stop=7)
    with pytest.raises(ValueError, match="logp"):
        tl_mod.token_loss(plan, torch.zeros(5))


@pytest.mark.parametrize("name", ELIGIBLE)
def test_extreme_ratios_hit_every_clamp(name):
    """Dual clip (A < 0, r > c), the ±20 log-ratio clamp and exact ratio 1 (max ties) all occur."""
    cfg = config(name, kl_coef=0.1, entropy_coef=0.02)
    batch = make_batch(3, 6, seed=4, dtype=F32, per_token_adv=True, empty_row=False)
    with torch.no_grad():
        batch["mask"][:] = True
        batch["old_logp"][0] = batch["logp"][0] - torch.tensor([2.0, 25.0, -25.0, 0.0, 1.5, -1.5])
        batch["advantages"][0] = torch.tensor([-1.0, -2.0, 1.0, 0.5, 0.0, -0.3])
    _check(cfg, batch)


def test_coef_fn_for_chunked_callers():
    cfg = config("sapo", kl_coef=0.1, entropy_coef=0.02)
    batch = make_batch(3, 5, seed=9, dtype=F32)
    plan, whole = _check(cfg, batch)
    fn = tl_mod.as_coef_fn(plan)
    logp, ent = batch["logp"].detach().reshape(-1), batch["entropy"].detach().reshape(-1)
    parts = [fn(slice(a, b), logp[a:b], ent[a:b]) for a, b in [(0, 7), (7, 15)]]
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole.loss, **TOL)
    assert torch.equal(torch.cat([p[1] for p in parts]), whole.g_logp)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("packed", [False, True])
def test_coef_fn_on_compacted_chunks(aggregation, packed):
    """A padding-compacted engine hands ``coef_fn`` the flat positions of its active rows (index
    tensors, in chunks that straddle sequences): the gathered plan (``TokenLossPlan.take``; per-
    sequence advantages and 1/n_i factors read per token) gives each token the same coefficients
    as the whole plan, bitwise, and the chunks' loss parts add up to the loss."""
    cfg = config("ppo", aggregation=aggregation, kl_coef=0.1, entropy_coef=0.02)
    batch = make_batch(4, 6, seed=13, dtype=F32)
    cu = None
    if packed:
        batch, cu, _ = pack(batch, [6, 3, 5, 4])
    plan, whole = _check(cfg, batch, cu=cu)
    assert plan.adv_per_seq == (not packed)
    assert plan.factor_per_seq == (aggregation != "token-mean" and not packed)
    fn = tl_mod.as_coef_fn(plan)
    logp, ent = batch["logp"].detach().reshape(-1), batch["entropy"].detach().reshape(-1)
    active = (plan.ids != plan.ignore_index).nonzero().squeeze(1)
    assert 0 < active.numel() < plan.n_tokens
    total, g_logp, g_ent = torch.zeros(()), torch.zeros(plan.n_tokens), torch.zeros(plan.n_tokens)
    for rows in active.split(5):  # chunks of 5 active rows
        part, gl, ge = fn(rows, logp[rows], ent[rows])
        total += part
        g_logp[rows], g_ent[rows] = gl, ge
    torch.testing.assert_close(total, whole.loss, **TOL)  # the sum's order differs: to rounding
    assert torch.equal(g_logp, whole.g_logp) and torch.equal(g_ent, whole.g_entropy)
