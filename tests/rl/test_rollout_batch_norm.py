"""``PolicyLossConfig.rollout_batch_normalize`` (verl's ``rollout_is_batch_normalize``).

The correction's weights divided by their mean over the call — over the active tokens (``token_*``)
or over the sequences with an active token (``seq_*``), unless that mean is ≤ 1e-8 — before gmpo
folds them. Checked against the float64 loop oracle (``formulas.batch_rollout_weights``), against
verl 0.9.1's own ``compute_rollout_correction_weights(rollout_is_batch_normalize=True)`` in its
vanilla loss, on the fused token-level plan and kernel path, and for its guard, NaN and config
errors.
"""

import itertools
import math

import pytest
import torch

import rlkernel as rk
from rlkernel.rl import rollout
from rlkernel.rl import token_loss as tl_mod

from . import formulas
from .helpers import assert_close, config, grads, make_batch, run
from .mask_helpers import (
    F32_TOL,
    F64_TOL,
    VerlActorConfig,
    force_passes,
    interpreter_quiet,
    on_device,
    problem,
    triton_vs_reference,
    verl_modules,
)

CORRECTIONS = ("token_tis", "seq_tis", "token_mis", "seq_mis")
AGGS = ("token-mean", "seq-mean-token-sum")


def _cfg(name, correction, **overrides):
    bounds = dict(rollout_clip_min=0.7 if correction.endswith("mis") else None, rollout_clip_max=1.6)
    fields = dict(rollout_correction=correction, rollout_batch_normalize=True, **bounds)
    return config(name, **{**fields, **overrides})


def _oracle(cfg, batch):
    seqs = formulas.sequences_from_padded(
        batch["mask"],
        logp=batch["logp"].double(),
        old=batch["old_logp"].double(),
        adv=batch["advantages"].double(),
        ref=batch["ref_logp"].double(),
        rollout=batch["rollout_logp"].double(),
        entropy=batch["entropy"].double(),
    )
    return formulas.policy_loss(cfg, seqs, batch["mask"].shape[1])


@pytest.mark.parametrize(
    ("name", "correction", "aggregation"),
    list(itertools.product(("ppo", "reinforce", "cispo", "gmpo"), CORRECTIONS, AGGS)),
)
def test_matches_the_float64_oracle(name, correction, aggregation):
    cfg = _cfg(name, correction, aggregation=aggregation, kl_coef=0.1, entropy_coef=0.02)
    batch = make_batch(5, 7, seed=len(name) + CORRECTIONS.index(correction), per_token_adv=name == "ppo")
    out = run(cfg, batch)
    want = _oracle(cfg, batch)
    assert_close(out.loss, want)
    for got, exp in zip(grads(out.loss, batch), grads(want, batch), strict=True):
        assert_close(got, exp)
    # Not vacuous: the normalization changes the loss (the mean is not 1 on this batch).
    plain = run(rk.PolicyLossConfig(**{**vars(cfg), "rollout_batch_normalize": False}), batch)
    assert abs(plain.loss.item() - out.loss.item()) > 1e-4
    factor = out.metrics["rollout_norm_factor"]
    assert factor.dtype == out.loss.dtype and abs(factor.item() - 1.0) > 1e-3


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_the_factor_is_the_mean_and_the_mean_becomes_one(correction):
    cfg = _cfg("reinforce", correction)
    batch = make_batch(6, 8, seed=3)
    m = batch["mask"]
    raw = rollout.rollout_weights(
        batch["old_logp"], batch["rollout_logp"], m, correction, cfg.rollout_clip_min, cfg.rollout_clip_max
    ).weight
    if correction.startswith("token"):
        mean = raw[m].mean()
    else:
        mean = torch.stack([raw[i][m[i]][0] for i in range(m.shape[0]) if m[i].any()]).mean()
    out = run(cfg, batch)
    torch.testing.assert_close(out.metrics["rollout_norm_factor"], mean, **F64_TOL)
    if correction.startswith("token"):  # the applied weights average 1 over the active tokens
        torch.testing.assert_close(out.metrics["rollout_weight_mean"], torch.ones((), dtype=mean.dtype))


def test_mean_at_most_1e_8_or_nan_leaves_the_weights_alone():
    batch = make_batch(4, 6, seed=5)
    far = dict(batch, rollout_logp=batch["old_logp"] + 25.0)  # ρ = e^−25: mean ≈ 1.4e-11 < 1e-8
    for correction in ("token_tis", "seq_tis"):
        cfg = _cfg("ppo", correction)
        plain = rk.PolicyLossConfig(**{**vars(cfg), "rollout_batch_normalize": False})
        out = run(cfg, far)
        torch.testing.assert_close(out.loss, run(plain, far).loss, atol=0, rtol=0)
        assert out.metrics["rollout_norm_factor"].item() == 1.0
    rejected = _cfg("ppo", "token_mis", rollout_clip_min=50.0, rollout_clip_max=60.0)  # every w = 0
    out = run(rejected, batch)
    assert out.metrics["rollout_norm_factor"].item() == 1.0 and math.isfinite(out.loss.item())
    nan = dict(batch, rollout_logp=batch["rollout_logp"].clone())
    nan["rollout_logp"][0, 0] = float("nan")  # (0, 0) is active
    out = run(_cfg("ppo", "token_tis"), nan)
    assert math.isnan(out.loss.item()) and out.metrics["rollout_norm_factor"].item() == 1.0


def test_sums_over_micro_batches_give_the_whole_batchs_normalization():
    """batch_mean_terms adds across micro-batches (what an all-reduce does): normalizing each part
    with the summed terms equals normalizing the whole."""
    batch = make_batch(6, 7, seed=8)
    m, old, roll = batch["mask"], batch["old_logp"], batch["rollout_logp"]
    for level, mode in (("token", "token_tis"), ("seq", "seq_mis")):
        w = rollout.rollout_weights(old, roll, m, mode, 0.8, 1.5).weight
        whole, _ = rollout.batch_normalized(w, *rollout.batch_mean_terms(w, m, level))
        parts = [(w[:2], m[:2]), (w[2:], m[2:])]
        terms = [rollout.batch_mean_terms(x, mk, level) for x, mk in parts]
        total, count = (sum(t[i] for t in terms) for i in range(2))
        pieces = [rollout.batch_normalized(x, total, count)[0] for x, _ in parts]
        torch.testing.assert_close(torch.cat(pieces), whole, **F64_TOL)


@pytest.mark.parametrize(("level", "threshold"), [("token", 2.0), ("sequence", 1.5), ("token", "0.7_1.6")])
def test_verl_batch_normalized_weights_in_verl_vanilla_loss(level, threshold):
    """verl 0.9.1's pipeline (weights from ``compute_rollout_correction_weights`` with
    ``rollout_is_batch_normalize=True``, no process group: the local mean) in its vanilla loss, and
    ``cfg.rollout_correction`` + ``rollout_batch_normalize`` computing the same weights itself."""
    helper, core = verl_modules()
    batch = make_batch(batch=6, width=8, seed=5, dtype=torch.float32, empty_row=False)
    m, old, roll = batch["mask"], batch["old_logp"], batch["rollout_logp"]
    adv = batch["advantages"][:, None].expand(m.shape).contiguous()
    w, metrics = helper.compute_rollout_correction_weights(
        log_ratio=old - roll, response_mask=m.float(), rollout_is=level, rollout_is_threshold=threshold,
        rollout_is_batch_normalize=True,
    )  # fmt: skip
    logp_verl = batch["logp"].detach().clone().requires_grad_(True)
    verl_loss, _ = core.compute_policy_loss_vanilla(
        old, logp_verl, adv, m.float(), "token-mean", VerlActorConfig(0.2, 0.28, 3.0), rollout_is_weights=w
    )
    (verl_grad,) = torch.autograd.grad(verl_loss, logp_verl)
    if isinstance(threshold, str):
        low, high = (float(x) for x in threshold.split("_"))
        mode = "token_mis"
    else:
        low, high, mode = None, threshold, "token_tis" if level == "token" else "seq_tis"
    cfg = config(
        "ppo", clip_low=0.2, clip_high=0.28, dual_clip=3.0, rollout_correction=mode, rollout_clip_min=low,
        rollout_clip_max=high, rollout_batch_normalize=True,
    )  # fmt: skip
    ours = rk.policy_loss(batch["logp"], old, adv, m, cfg, rollout_logp=roll)
    (grad,) = torch.autograd.grad(ours.loss, batch["logp"])
    torch.testing.assert_close(ours.loss, verl_loss, **F32_TOL)
    torch.testing.assert_close(grad, verl_grad, **F32_TOL)
    factor = ours.metrics["rollout_norm_factor"].item()
    assert factor == pytest.approx(metrics["rollout_is_batch_norm_factor"], rel=1e-6)


@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("name", ["ppo", "reinforce"])
def test_the_token_level_plan_takes_it(name, correction):
    """The fused token-level plan computes the same normalized weights (plan + reference kernel ==
    policy_loss, loss and dL/dlogp)."""
    cfg = _cfg(name, correction, kl_coef=0.1)
    batch = make_batch(4, 6, seed=9, dtype=torch.float32)
    out = run(cfg, batch)
    (g_logp,) = torch.autograd.grad(out.loss, batch["logp"])
    plan = tl_mod.build_plan(
        cfg,
        token_ids=torch.zeros(batch["mask"].shape, dtype=torch.long),
        old_logp=batch["old_logp"],
        advantages=batch["advantages"],
        mask=batch["mask"],
        ref_logp=batch["ref_logp"],
        rollout_logp=batch["rollout_logp"],
    )
    terms = tl_mod.token_loss(plan, batch["logp"].reshape(-1), backend="reference")
    torch.testing.assert_close(terms.loss, out.loss, **F32_TOL)
    torch.testing.assert_close(terms.g_logp, g_logp.reshape(-1), **F32_TOL)


@interpreter_quiet
@pytest.mark.parametrize("correction", ["token_tis", "seq_mis"])
def test_the_fused_kernel_path_takes_it(correction, set_options):
    passes = force_passes(set_options)
    cfg = _cfg("ppo", correction, kl_coef=0.1, aggregation="seq-mean-token-mean")
    a, b, ga, gb = triton_vs_reference(cfg, on_device(problem(seed=4)))
    assert (a.route.objective, a.route.passes, a.route.plan) == ("token", passes, "host"), str(a.route)
    torch.testing.assert_close(a.loss, b.loss, **F32_TOL)
    torch.testing.assert_close(ga, gb, **F32_TOL)
    assert a.metrics["rollout_norm_factor"] == pytest.approx(b.metrics["rollout_norm_factor"].item())


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="rollout_batch_normalize=True needs rollout_correction"):
        rk.PolicyLossConfig(rollout_batch_normalize=True)
    with pytest.raises(TypeError, match="rollout_batch_normalize must be a bool"):
        rk.PolicyLossConfig(rollout_correction="token_tis", rollout_batch_normalize="yes")
