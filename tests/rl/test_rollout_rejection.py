"""Rollout rejection (``cfg.rollout_rs``, verl's ``rollout_rs``): out-of-bounds tokens or sequences
leave the mask.

The keep mask is checked against a float64 oracle written from the definitions (loops over
sequences and tokens) and, bit for bit, against verl's own ``compute_rollout_rejection_mask``; the
loss against the float64 oracle of ``formulas.py`` on the reduced mask, and against verl's pipeline
(IS weights on the given mask, rejection, ``compute_policy_loss_vanilla`` on the reduced mask).
Normalizers count the reduced mask: locally, and through ``rejection_mask`` + ``global_normalizers``.
"""

import dataclasses
import itertools
import math

import pytest
import torch

import rlkernel as rk
from rlkernel.rl import rollout
from rlkernel.rl.config import ROLLOUT_REJECTIONS

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

# Bounds that random drifts (σ ≈ 0.3 per token) cross on both sides: (rollout_rs_min, rollout_rs_max).
BOUNDS = {
    "token_k1": (0.8, 1.3),
    "token_k2": (None, 0.03),
    "token_k3": (None, 0.03),
    "seq_sum_k1": (0.6, 1.8),
    "seq_sum_k2": (None, 0.2),
    "seq_sum_k3": (None, 0.2),
    "seq_mean_k1": (0.85, 1.15),
    "seq_mean_k2": (None, 0.04),
    "seq_mean_k3": (None, 0.04),
    "seq_max_k2": (None, 0.12),
    "seq_max_k3": (None, 0.12),
}


def _cfg(criterion, name="ppo", **overrides):
    low, high = BOUNDS[criterion]
    return config(name, rollout_rs=criterion, rollout_rs_min=low, rollout_rs_max=high, **overrides)


def _keep_oracle(cfg, old, roll, mask):
    """float64 loops: the tokens that stay (bool, the mask's shape)."""
    level, est = cfg.rollout_rs.rsplit("_", 1)
    keep = torch.zeros(mask.shape, dtype=torch.bool)
    for i in range(mask.shape[0]):
        idx = [t for t in range(mask.shape[1]) if mask[i, t]]
        div = {}
        for t in idx:
            lr = min(max(float(old[i, t]) - float(roll[i, t]), -20.0), 20.0)
            div[t] = {"k1": -lr, "k2": 0.5 * lr * lr, "k3": math.exp(lr) - 1.0 - lr}[est]
        if level == "seq_sum":
            div = dict.fromkeys(idx, sum(div.values()))
        elif level == "seq_mean":
            div = dict.fromkeys(idx, sum(div.values()) / max(len(idx), 1))
        elif level == "seq_max":
            div = dict.fromkeys(idx, max(div.values(), default=0.0))
        for t in idx:
            d = div[t]
            if est == "k1":
                ok = (cfg.rollout_rs_min is None or d >= math.log(cfg.rollout_rs_min)) and (
                    cfg.rollout_rs_max is None or d <= math.log(cfg.rollout_rs_max)
                )
            else:
                ok = d <= cfg.rollout_rs_max
            keep[i, t] = ok
    return keep


def _loss_oracle(cfg, batch, keep):
    """The float64 objective on the reduced mask; a correction's weights over the given mask."""
    tensors = dict(
        logp=batch["logp"].double(),
        old=batch["old_logp"].double(),
        adv=batch["advantages"].double(),
        ref=batch["ref_logp"].double(),
        rollout=batch["rollout_logp"].double(),
        entropy=batch["entropy"].double(),
    )
    given = formulas.sequences_from_padded(batch["mask"], **tensors)
    kept = formulas.sequences_from_padded(keep, **tensors)
    losses, entropies = [], []
    for seq, whole in zip(kept, given, strict=True):
        idx, terms = formulas.policy_terms(cfg, seq)
        if cfg.rollout_correction is not None and idx:
            all_idx = [t for t in range(whole["mask"].shape[0]) if bool(whole["mask"][t])]
            weights = dict(zip(all_idx, formulas.rollout_weights(cfg, whole, all_idx), strict=True))
            terms = [x * weights[t] for x, t in zip(terms, idx, strict=True)]
        if cfg.kl_coef > 0:
            terms = [
                x + cfg.kl_coef * formulas.kl_one(seq["logp"][t], seq["ref"][t], cfg.kl_estimator)
                for x, t in zip(terms, idx, strict=True)
            ]
        losses.append(terms)
        entropies.append([seq["entropy"][t] for t in idx])
    width = batch["mask"].shape[1]
    loss = formulas.aggregate(cfg, losses, width)
    if cfg.entropy_coef != 0:
        loss = loss - cfg.entropy_coef * formulas.aggregate(cfg, entropies, width)
    return loss


def _batch(seed, **kw):
    return make_batch(batch=6, width=7, seed=seed, **kw)


@pytest.mark.parametrize("criterion", ROLLOUT_REJECTIONS)
def test_keep_mask_matches_the_oracle(criterion):
    cfg = _cfg(criterion)
    batch = _batch(seed=1)
    keep = rollout.rejection_mask(cfg, batch["old_logp"], batch["rollout_logp"], batch["mask"])
    want = _keep_oracle(cfg, batch["old_logp"], batch["rollout_logp"], batch["mask"])
    assert torch.equal(keep, want)
    active = batch["mask"].sum()
    assert 0 < keep.sum() < active, "the bounds must reject some tokens and keep others"


@pytest.mark.parametrize(
    ("name", "criterion"), list(itertools.product(LOSS_CONFIGS, ["token_k3", "seq_mean_k1"]))
)
def test_loss_matches_the_oracle_on_the_reduced_mask(name, criterion):
    cfg = _cfg(criterion, name, kl_coef=0.1, entropy_coef=0.02, aggregation="seq-mean-token-mean")
    batch = _batch(seed=len(name), per_token_adv=name == "ppo")
    keep = _keep_oracle(cfg, batch["old_logp"], batch["rollout_logp"], batch["mask"])
    out = run(cfg, batch)
    want = _loss_oracle(cfg, batch, keep)
    assert_close(out.loss, want)
    for got, exp in zip(grads(out.loss, batch), grads(want, batch), strict=True):
        assert_close(got, exp)
    rejected = (batch["mask"] & ~keep).sum().double() / batch["mask"].sum()
    assert_close(out.metrics["rollout_rs_frac_rejected"], rejected.double())


@pytest.mark.parametrize(
    ("aggregation", "correction"), list(itertools.product(AGGREGATIONS, ["seq_tis", "token_mis"]))
)
def test_with_a_correction_computed_on_the_given_mask(aggregation, correction):
    cfg = _cfg(
        "token_k1", "ppo", aggregation=aggregation, rollout_correction=correction, rollout_clip_min=0.5
    )
    batch = _batch(seed=9)
    keep = _keep_oracle(cfg, batch["old_logp"], batch["rollout_logp"], batch["mask"])
    out = run(cfg, batch)
    want = _loss_oracle(cfg, batch, keep)
    assert_close(out.loss, want)
    assert_close(grads(out.loss, batch)[0], grads(want, batch)[0])


def test_rejected_tokens_leave_the_normalizers():
    """token-mean divides by the kept tokens; a sequence rejected whole leaves the sequence count;
    global normalizers from rejection_mask reproduce the whole step from its micro-batches."""
    cfg = config("reinforce", rollout_rs="seq_max_k2", rollout_rs_max=0.05)
    batch = _batch(seed=2)
    keep = rollout.rejection_mask(cfg, batch["old_logp"], batch["rollout_logp"], batch["mask"])
    whole_rows = (batch["mask"].any(-1) & ~keep.any(-1)).sum()
    assert whole_rows > 0, "some sequence must be rejected whole"
    lp, adv = batch["logp"].detach(), batch["advantages"]
    out = run(cfg, batch)
    expected = -(adv[:, None] * lp)[keep].sum() / keep.sum()
    assert_close(out.loss, expected)
    seq_cfg = dataclasses.replace(cfg, aggregation="seq-mean-token-sum")
    expected = -(adv[:, None] * lp)[keep].sum() / keep.any(-1).sum()
    assert_close(run(seq_cfg, batch).loss, expected)
    # two micro-batches with the step's normalizers (counted on the reduced masks) add up to the step
    for c in (cfg, seq_cfg):
        parts = [{k: v[rows] for k, v in batch.items()} for rows in (slice(0, 3), slice(3, 6))]
        masks = [rollout.rejection_mask(c, q["old_logp"], q["rollout_logp"], q["mask"]) for q in parts]
        tokens, seqs = rk.global_normalizers(masks)
        total = sum(run(c, q, global_tokens=tokens, global_seqs=seqs).loss for q in parts)
        torch.testing.assert_close(total, run(c, batch).loss, **F64_TOL)


def test_packed_equals_padded_and_garbage_is_ignored():
    cfg = _cfg("seq_sum_k3", "cispo", aggregation="seq-mean-token-mean", rollout_correction="seq_tis")
    packed, cu, padded = pack(_batch(seed=3), [7, 2, 5, 1, 6, 3])
    a = run(cfg, packed, cu_seqlens=cu)
    b = run(cfg, add_garbage(padded))
    torch.testing.assert_close(a.loss, b.loss, **F64_TOL)
    keep_packed = rollout.rejection_mask(
        cfg, packed["old_logp"], packed["rollout_logp"], packed["mask"], cu_seqlens=cu
    )
    keep_padded = rollout.rejection_mask(cfg, padded["old_logp"], padded["rollout_logp"], padded["mask"])
    assert torch.equal(keep_packed, torch.cat([keep_padded[i, :n] for i, n in enumerate([7, 2, 5, 1, 6, 3])]))


@pytest.mark.parametrize("criterion", ["token_k1", "seq_sum_k2", "seq_max_k3"])
def test_non_finite_log_probs_at_an_active_token_give_nan(criterion):
    """A NaN statistic keeps the token (its sequence, for seq_*) with a NaN weight: the loss is NaN,
    also for reinforce, which reads neither log-prob otherwise."""
    for name, value in (
        ("rollout_logp", float("nan")),
        ("rollout_logp", float("inf")),
        ("old_logp", -float("inf")),
    ):
        batch = _batch(seed=4)
        batch[name] = batch[name].clone()
        batch[name][0, 0] = value  # (0, 0) is active
        assert math.isnan(run(_cfg(criterion, "reinforce"), batch).loss.item()), (name, value)


# ------------------------------------------------------------------------------ verl's own code
VERL_SPECS = {
    "token_k1": "0.8_1.3",
    "seq_sum_k1": "0.6_1.8",
    "seq_mean_k1": "0.85_1.15",
}


@pytest.mark.parametrize("criterion", ROLLOUT_REJECTIONS)
def test_verl_rejection_mask_bit_for_bit(criterion):
    helper, _ = verl_modules()
    cfg = _cfg(criterion)
    batch = _batch(seed=5, dtype=torch.float32, empty_row=False)
    m, old, roll = batch["mask"], batch["old_logp"], batch["rollout_logp"]
    spec = VERL_SPECS.get(criterion, BOUNDS[criterion][1])
    verl_mask, _ = helper.compute_rollout_rejection_mask(
        log_ratio=old - roll, response_mask=m.float(), rollout_rs=criterion, rollout_rs_threshold=spec
    )
    ours = rollout.rejection_mask(cfg, old, roll, m)
    assert torch.equal(ours, verl_mask.bool())
    assert 0 < ours.sum() < m.sum()


@pytest.mark.parametrize(("criterion", "level"), [("token_k3", "token"), ("seq_mean_k1", "sequence")])
def test_verl_pipeline_weights_rejection_and_vanilla_loss(criterion, level):
    """verl: IS weights (TIS 2.0) on the given mask, rejection, then the loss on the reduced mask."""
    helper, core = verl_modules()
    batch = _batch(seed=6, dtype=torch.float32, empty_row=False)
    m, old, roll = batch["mask"], batch["old_logp"], batch["rollout_logp"]
    adv = batch["advantages"][:, None].expand(m.shape).contiguous()
    w, _ = helper.compute_rollout_correction_weights(
        log_ratio=old - roll, response_mask=m.float(), rollout_is=level, rollout_is_threshold=2.0
    )
    reduced, _ = helper.compute_rollout_rejection_mask(
        log_ratio=old - roll,
        response_mask=m.float(),
        rollout_rs=criterion,
        rollout_rs_threshold=VERL_SPECS.get(criterion, BOUNDS[criterion][1]),
    )
    logp_verl = batch["logp"].detach().clone().requires_grad_(True)
    verl_loss, _ = core.compute_policy_loss_vanilla(
        old, logp_verl, adv, reduced, "token-mean", VerlActorConfig(0.2, 0.28, 3.0), rollout_is_weights=w
    )
    (verl_grad,) = torch.autograd.grad(verl_loss, logp_verl)
    correction = "token_tis" if level == "token" else "seq_tis"
    cfg = _cfg(criterion, "ppo", clip_high=0.28, dual_clip=3.0, rollout_correction=correction)
    out = rk.policy_loss(batch["logp"], old, adv, m, cfg, rollout_logp=roll)
    (grad,) = torch.autograd.grad(out.loss, batch["logp"])
    torch.testing.assert_close(out.loss, verl_loss, **F32_TOL)
    torch.testing.assert_close(grad, verl_grad, **F32_TOL)
    # the same with verl's weights passed in
    given = rk.policy_loss(batch["logp"], old, adv, m, _cfg(criterion, "ppo", clip_high=0.28, dual_clip=3.0),
                           rollout_logp=roll, rollout_weights=w)  # fmt: skip
    torch.testing.assert_close(given.loss, verl_loss, **F32_TOL)


# ------------------------------------------------------------------------------------- fused
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("source", ["logits", "hidden"])
@pytest.mark.parametrize("name", list(LOSS_CONFIGS))
def test_fused_equals_composition(name, source, packed):
    criterion = "seq_mean_k2" if name in ("gspo", "gmpo") else "token_k1"
    cfg = _cfg(criterion, name, kl_coef=0.1, entropy_coef=0.02, rollout_correction="token_tis")
    p = problem(seed=len(name), packed=packed)
    assert_same(fused(cfg, p, source), composed(cfg, p, source), p, source, F64_TOL)


@interpreter_quiet
@pytest.mark.parametrize("two_pass", [False, True])
@pytest.mark.parametrize(
    ("name", "criterion"), [("ppo", "token_k1"), ("cispo", "seq_sum_k3"), ("sapo", "seq_max_k2")]
)
def test_token_level_kernel_path(name, criterion, two_pass, set_options):
    passes = force_passes(set_options, two_pass)
    cfg = _cfg(criterion, name, kl_coef=0.1, entropy_coef=0.02, aggregation="seq-mean-token-mean")
    p = on_device(problem(seed=5, packed=name == "cispo"))
    a, b, ga, gb = triton_vs_reference(cfg, p)
    assert (a.route.objective, a.route.passes, a.route.plan) == ("token", passes, "host"), str(a.route)
    torch.testing.assert_close(a.loss, b.loss, **F32_TOL)
    torch.testing.assert_close(ga, gb, **F32_TOL)
    for key in b.metrics:
        torch.testing.assert_close(a.metrics[key], b.metrics[key], atol=1e-5, rtol=1e-5)
    # rejected tokens cost no softmax gradient: their logits rows get exactly 0
    b_ = p["batch"]
    keep = rollout.rejection_mask(cfg, b_["old_logp"], b_["rollout_logp"], b_["mask"], cu_seqlens=p["cu"])
    rejected = (b_["mask"] != 0) & ~keep
    assert rejected.any() and torch.count_nonzero(ga[rejected]) == 0


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        (dict(rollout_rs="token_k4", rollout_rs_max=1.0), ValueError, "rollout_rs must be one of"),
        (dict(rollout_rs="seq_max_k1", rollout_rs_max=1.0), ValueError, "rollout_rs must be one of"),
        (dict(rollout_rs="token_k2"), ValueError, "needs rollout_rs_max"),
        (dict(rollout_rs="token_k1"), ValueError, "needs rollout_rs_min or rollout_rs_max"),
        (
            dict(rollout_rs="token_k3", rollout_rs_min=0.5, rollout_rs_max=1.0),
            ValueError,
            "rollout_rs_min applies",
        ),
        (dict(rollout_rs="seq_sum_k1", rollout_rs_min=2.0, rollout_rs_max=1.0), ValueError, "rollout_rs_min"),
        (dict(rollout_rs_max=2.0), ValueError, "need rollout_rs"),
        (dict(rollout_rs="token_k2", rollout_rs_max=0.0), ValueError, "rollout_rs_max"),
        (dict(rollout_rs="token_k2", rollout_rs_max=float("nan")), ValueError, "rollout_rs_max"),
        (dict(rollout_rs="token_k2", rollout_rs_max=1e39), ValueError, "rollout_rs_max"),
        (dict(rollout_rs="token_k1", rollout_rs_min=-1.0), ValueError, "rollout_rs_min"),
        (dict(rollout_rs="token_k2", rollout_rs_max="0.1"), TypeError, "rollout_rs_max"),
        (dict(rollout_rs="token_k2", rollout_rs_max=True), TypeError, "rollout_rs_max"),
    ],
)
def test_config_errors_name_the_field(fields, error, match):
    with pytest.raises(error, match=match):
        rk.PolicyLossConfig(**fields)


def test_missing_rollout_logp_and_bad_rejection_mask_inputs():
    batch = _batch(seed=7)
    cfg = _cfg("token_k2")
    with pytest.raises(ValueError, match="rollout_logp is required when cfg.rollout_rs"):
        rk.policy_loss(batch["logp"], batch["old_logp"], batch["advantages"], batch["mask"], cfg)
    old, roll, m = batch["old_logp"], batch["rollout_logp"], batch["mask"]
    with pytest.raises(TypeError, match="cfg must be a PolicyLossConfig"):
        rollout.rejection_mask("token_k2", old, roll, m)
    with pytest.raises(ValueError, match="rollout_logp"):
        rollout.rejection_mask(cfg, old, roll[:, :2], m)
    with pytest.raises(TypeError, match="old_logp"):
        rollout.rejection_mask(cfg, old.long(), roll, m)
    with pytest.raises(ValueError, match="cu_seqlens is required for packed 1-D mask"):
        rollout.rejection_mask(cfg, old.reshape(-1), roll.reshape(-1), m.reshape(-1))
    # without rollout_rs: the mask itself
    assert torch.equal(rollout.rejection_mask(config("ppo"), old, roll, m.int()), m)
