"""``rk_<mode>`` policy losses (``rlkernel.integrations.verl``) against verl 0.9.1's own losses.

The reference is verl's code, run from its registry (fixture ``verl``, tests/integrations/conftest.py)
on the same fresh random batches: ragged masks with a full and an empty row and finite garbage at
masked positions, per-token advantages of both signs (GAE-like) and per-sequence ones (GRPO-like),
log-ratios N(0, 0.6²) that straddle every clip, the dual clip and geo_mean's log-space bounds.

* Every registered mode × every ``loss_agg_mode`` rlkernel has × ``global_batch_info`` (none; the
  normalizers of a mini-batch at ``dp_size=1``; ``dp_size=4`` with ``loss_scale_factor`` and a tensor
  normalizer) × advantage layout × 2 seeds: loss and ∂loss/∂log_prob within 1e-6 (float32), the
  same metric names in the same order, values within 1e-6.
* Each mode's settings (clip fallbacks, dual clip, temperatures, recipe bounds), float64, extreme
  ratios (verl's clamps), masks given as int/float, an all-masked micro-batch.
* clip_cov's random cut: torch's default generator seeded alike before both calls (every call of
  :func:`run`); several seeds change the loss and both cut the same tokens each time. The probe leaves
  the caller's generator state alone.
* The registry: names, verl's signature and defaults, ``get_policy_loss_fn``.
* The probe: verl 0.9.1's conventions, and the conventions of older verls (built from verl's own
  functions with the old aggregation) found, an unreproducible loss, a wrong signature and other
  metrics refused.
* ``rollout_is_weights``: random weights, every mode and aggregation, as verl.
* ``dp_size > 1`` without a normalizer raises, as verl does.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools

import pytest
import torch

MODES = (
    "vanilla", "gspo", "sapo", "cispo", "geo_mean", "gpg", "dro", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov"
)  # fmt: skip
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")
INFOS = {
    "local": {},
    "global-dp1": dict(dp_size=1, batch_num_tokens=97, global_batch_size=23),
    "global-dp4": dict(
        dp_size=4, batch_num_tokens=torch.tensor(211.0), global_batch_size=41, loss_scale_factor=16
    ),
}
TOL = {torch.float32: 1e-6, torch.float64: 1e-12}
SETTINGS = dict(
    clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05
)
# verl's policy_loss settings (its PolicyLossConfig): dro's β, and covariance windows and ratios that
# select tokens on these batches (verl's defaults, 2e-4 of the tokens in [1, 5], select none).
POLICY = dict(
    dro_beta=0.1, clip_cov_ratio=0.2, clip_cov_lb=-0.5, clip_cov_ub=0.8, kl_cov_ratio=0.2, ppo_kl_coef=0.7
)


def make_batch(seed: int, *, advantages: str = "token", dtype=torch.float32, B: int = 6, T: int = 11):
    """``(old_log_prob, log_prob, advantages, mask)``, ``[B, T]``; row 0 full, row 1 empty."""
    g = torch.Generator().manual_seed(seed)
    log_prob = -3 * torch.rand(B, T, generator=g, dtype=dtype) - 0.01
    old = log_prob + 0.6 * torch.randn(B, T, generator=g, dtype=dtype)
    if advantages == "token":
        adv = torch.randn(B, T, generator=g, dtype=dtype)
    else:  # one value per sequence, broadcast to its tokens as verl stores GRPO advantages
        adv = torch.randn(B, 1, generator=g, dtype=dtype).expand(B, T).contiguous()
    lengths = torch.randint(1, T, (B,), generator=g)
    lengths[0], lengths[1] = T, 0
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return old, log_prob, adv, mask


def actor_config(verl, info=None, **settings):
    """verl's ActorConfig: the settings of :data:`POLICY` go to its PolicyLossConfig, the others to it."""
    policy = {k: settings.pop(k, v) for k, v in POLICY.items()}
    return verl.ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        global_batch_info=dict(info or {}),
        policy_loss=verl.PolicyLossConfig(**policy),
        **{**SETTINGS, **settings},
    )


def run(fn, batch, agg, config, weights=None, seed=0):
    """``(loss, metrics, d loss / d log_prob)`` of a verl policy-loss function (called as verl's actor
    calls it: by keyword), torch's default generator seeded with ``seed`` (clip_cov's random draw:
    verl's and ours select the same tokens), in a forked RNG state."""
    old, log_prob, adv, mask = batch
    x = log_prob.clone().requires_grad_(True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        loss, metrics = fn(
            old_log_prob=old,
            log_prob=x,
            advantages=adv,
            response_mask=mask,
            loss_agg_mode=agg,
            config=config,
            rollout_is_weights=weights,
        )
    (grad,) = torch.autograd.grad(loss, x)
    return loss, metrics, grad


def assert_same(ours, theirs, dtype=torch.float32, metric_rel=None):
    """Loss and gradient within TOL[dtype], the same metric names in the same order, each metric a
    float within 1e-6 absolute (and ``metric_rel`` relative, where given)."""
    (loss, metrics, grad), (ref, ref_metrics, ref_grad) = ours, theirs
    tol = TOL[dtype]
    assert torch.isfinite(ref) and torch.isfinite(ref_grad).all()
    assert loss.dtype == ref.dtype and loss.shape == ref.shape == ()
    torch.testing.assert_close(loss, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(grad, ref_grad, atol=tol, rtol=tol)
    assert list(metrics) == list(ref_metrics)  # same names, same order
    for name, value in ref_metrics.items():
        assert type(metrics[name]) is type(value) is float, name
        assert metrics[name] == pytest.approx(value, rel=metric_rel, abs=1e-6), name


def compare(verl, mode, batch, agg, config, dtype=torch.float32, weights=None):
    fn = verl.core_algos.get_policy_loss_fn(f"rk_{mode}")
    ours = run(fn, batch, agg, config, weights)
    theirs = run(verl.core_algos.get_policy_loss_fn(mode), batch, agg, config, weights)
    assert_same(ours, theirs, dtype)
    return ours, theirs


@pytest.mark.parametrize("info", list(INFOS))
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_and_aggregation_matches_verl(verl, mode, agg, info):
    for seed, advantages in itertools.product((0, 1), ("token", "seq")):
        batch = make_batch(seed + 10 * MODES.index(mode), advantages=advantages)
        compare(verl, mode, batch, agg, actor_config(verl, INFOS[info]))


# Each mode's own settings: verl's fallbacks and recipe values.
SWEEP = [
    ("vanilla", dict(clip_ratio=0.25, clip_ratio_low=None, clip_ratio_high=None)),  # both fall back
    ("vanilla", dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0)),  # DAPO
    ("vanilla", dict(clip_ratio_low=0.1, clip_ratio_high=0.5, clip_ratio_c=1.5)),  # the dual clip bites
    ("gspo", dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4)),  # the GSPO recipe
    ("gspo", dict(clip_ratio=0.3, clip_ratio_low=None, clip_ratio_high=0.1)),
    ("sapo", dict(tau_pos=2.0, tau_neg=0.5)),
    ("cispo", dict(clip_ratio_low=1.0, clip_ratio_high=4.0)),  # no effective lower bound, ScaleRL cap
    ("cispo", dict(clip_ratio_low=0.1, clip_ratio_high=0.1)),
    ("geo_mean", dict(clip_ratio_low=0.4, clip_ratio_high=0.4)),  # the GMPO recipe
    ("gpg", dict(clip_ratio_c=7.0)),  # read by nobody
    ("dro", dict(dro_beta=0.01)),
    ("dro", dict(dro_beta=2.5)),
    ("dppo_tv", dict(clip_ratio_low=0.04, clip_ratio_high=0.06, clip_ratio_c=1.3)),  # TV thresholds
    ("dppo_tv", dict(clip_ratio=0.1, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=20.0)),
    ("dppo_kl", dict(clip_ratio_low=0.01, clip_ratio_high=0.015, clip_ratio_c=3.0)),  # KL thresholds
    ("dppo_kl", dict(clip_ratio_low=0.05, clip_ratio_high=0.2, clip_ratio_c=1.1)),
    ("clip_cov", dict(clip_cov_ratio=0.05, clip_cov_lb=-0.2, clip_cov_ub=0.5)),
    ("clip_cov", dict(clip_cov_ratio=1.0, clip_cov_lb=-5.0, clip_cov_ub=5.0, clip_ratio_high=0.1)),
    ("clip_cov", dict(clip_cov_ratio=2e-4, clip_cov_lb=1.0, clip_cov_ub=5.0)),  # verl's defaults
    ("kl_cov", dict(kl_cov_ratio=0.5, ppo_kl_coef=2.0)),
    ("kl_cov", dict(kl_cov_ratio=2e-4, ppo_kl_coef=0.1)),  # verl's defaults: one token
]


@pytest.mark.parametrize("index", range(len(SWEEP)), ids=[f"{m}-{i}" for i, (m, _) in enumerate(SWEEP)])
def test_each_modes_settings_match_verl(verl, index):
    mode, settings = SWEEP[index]
    for agg, info in (("token-mean", "local"), ("seq-mean-token-mean", "global-dp4")):
        config = actor_config(verl, INFOS[info], **settings)
        compare(verl, mode, make_batch(100 + index, advantages="token"), agg, config)


@pytest.mark.parametrize("mode", MODES)
def test_float64_matches_verl(verl, mode):
    batch = make_batch(7, dtype=torch.float64)
    for agg in AGGS:
        compare(verl, mode, batch, agg, actor_config(verl, INFOS["global-dp4"]), dtype=torch.float64)


@pytest.mark.parametrize("mode", MODES)
def test_extreme_ratios_match_verl(verl, mode):
    """Log-ratios of ±25 (beyond verl's ±20 clamp) and sequences whose mean log-ratio exceeds 10
    (gspo's bound): verl's clamps, gradients included (0 beyond a clamp)."""
    old, log_prob, adv, mask = make_batch(3)
    old = old.clone()
    old[0] = log_prob[0] - 25.0  # the full row: every ratio far above e^20, mean log-ratio 25
    old[2] = log_prob[2] + 25.0
    old[3] = log_prob[3] - 12.0
    for agg in ("token-mean", "seq-mean-token-mean"):
        compare(verl, mode, (old, log_prob, adv, mask), agg, actor_config(verl))


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.uint8])
def test_int_and_float_masks_match_verl(verl, dtype):
    old, log_prob, adv, mask = make_batch(5)
    for mode in ("vanilla", "gspo"):
        compare(
            verl,
            mode,
            (old, log_prob, adv, mask.to(dtype)),
            "token-mean",
            actor_config(verl, INFOS["global-dp1"]),
        )


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_micro_batch(verl, mode):
    """With the mini-batch's normalizers (verl's actor always passes them) an all-masked micro-batch
    gives 0 and zero gradients in both; without them verl divides 0 by 0 (NaN, or for geo_mean a
    mean of zeros), rlkernel gives 0 (docs/integrations/verl.md, "Where the numbers differ")."""
    old, log_prob, adv, mask = make_batch(9)
    empty = torch.zeros_like(mask)
    for agg in AGGS:
        ours, theirs = compare(
            verl, mode, (old, log_prob, adv, empty), agg, actor_config(verl, INFOS["global-dp4"])
        )
        assert ours[0].item() == 0.0 and not ours[2].any()
        fn = verl.core_algos.get_policy_loss_fn(f"rk_{mode}")
        loss, metrics, grad = run(fn, (old, log_prob, adv, empty), agg, actor_config(verl))
        assert loss.item() == 0.0 and not grad.any()
        ref = run(
            verl.core_algos.get_policy_loss_fn(mode), (old, log_prob, adv, empty), agg, actor_config(verl)
        )
        assert torch.isnan(ref[0]) or ref[0].item() == 0.0
        assert list(metrics) == list(ref[1])


def test_masked_garbage_is_ignored(verl):
    """NaN/inf at masked positions: the loss and gradient of the clean batch (verl's masked sums drop
    them too, except where it multiplies by the mask first, e.g. gspo's sequence ratio)."""
    old, log_prob, adv, mask = make_batch(11)
    dirty = [t.clone() for t in (old, log_prob, adv)]
    for t, value in zip(dirty, (float("nan"), float("inf"), float("-inf")), strict=True):
        t[~mask] = value
    for mode in MODES:
        fn = verl.core_algos.get_policy_loss_fn(f"rk_{mode}")
        clean = run(fn, (old, log_prob, adv, mask), "token-mean", actor_config(verl))
        noisy = run(fn, (*dirty, mask), "token-mean", actor_config(verl))
        torch.testing.assert_close(noisy[0], clean[0], atol=0, rtol=0)
        torch.testing.assert_close(noisy[2], clean[2], atol=0, rtol=0)


def test_registry_holds_every_mode_with_verls_signature(verl):
    integration, core_algos = verl.integration, verl.core_algos
    # (rk_bypass_mode: tests/integrations/test_verl_bypass.py)
    assert tuple(integration.RK_LOSSES) == (*(f"rk_{m}" for m in MODES), "rk_bypass_mode")
    for mode in MODES:
        ours = core_algos.get_policy_loss_fn(f"rk_{mode}")
        assert ours is integration.RK_LOSSES[f"rk_{mode}"]
        theirs = inspect.signature(core_algos.POLICY_LOSS_REGISTRY[mode]).parameters
        mine = inspect.signature(ours).parameters
        assert list(mine) == list(theirs)
        assert [p.default for p in mine.values()] == [p.default for p in theirs.values()]
        assert [p.kind for p in mine.values()] == [p.kind for p in theirs.values()]


def test_probe_finds_verl_0_9_1s_conventions(verl):
    from rlkernel.integrations.verl import losses

    expected = {mode: {agg: losses.AS_GIVEN for agg in AGGS} for mode in MODES}
    expected["sapo"] = {agg: losses.SEQ_MEAN for agg in AGGS}
    expected["sapo"]["seq-mean-token-mean"] = losses.AS_GIVEN  # the same loss: the first one wins
    expected["geo_mean"] = {agg: losses.ROWS for agg in AGGS}
    for mode in MODES:
        plan = verl.integration.PLANS[f"rk_{mode}"]
        assert plan.unavailable is None and not plan.refused
        assert dict(plan.conventions) == expected[mode], mode


def test_the_new_modes_select_tokens_as_verl(verl):
    """The comparisons above are not vacuous: clip_cov cuts tokens (a fraction in (0, 1)) and which ones
    depends on the seed, identically in verl and rk_clip_cov; kl_cov's penalty changes the loss;
    dppo's trust region masks tokens and its cap truncates ratios."""
    batch = make_batch(61)
    config = actor_config(verl, INFOS["global-dp1"])
    losses = []
    for seed in range(4):
        fn = verl.core_algos.get_policy_loss_fn("rk_clip_cov")
        ours = run(fn, batch, "token-mean", config, seed=seed)
        theirs = run(verl.core_algos.get_policy_loss_fn("clip_cov"), batch, "token-mean", config, seed=seed)
        assert_same(ours, theirs)
        assert 0 < theirs[1]["actor/pg_clipfrac"] < 1
        losses.append(theirs[0].item())
    assert len(set(losses)) > 1  # the draw matters, and both drew the same tokens each time
    kl_cov = verl.core_algos.get_policy_loss_fn("rk_kl_cov")
    no_penalty = run(kl_cov, batch, "token-mean", actor_config(verl, ppo_kl_coef=0.0))[0]
    assert not torch.isclose(run(kl_cov, batch, "token-mean", actor_config(verl))[0], no_penalty)
    for mode in ("dppo_tv", "dppo_kl"):
        config = actor_config(verl, clip_ratio_low=0.02, clip_ratio_high=0.03, clip_ratio_c=1.3)
        metrics = compare(verl, mode, batch, "token-mean", config)[1][1]
        assert 0 < metrics["actor/pg_clipfrac"] < 1 and metrics["actor/pg_clipfrac_lower"] > 0, mode


def test_the_probe_leaves_the_default_generator_alone(verl):
    """clip_cov's probe seeds torch's default generator before each call, in a forked RNG state."""
    from rlkernel.integrations.verl import losses, probe

    row = next(r for r in losses.LOSS_MODES if r.verl_name == "clip_cov")
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    plan = probe.plan_mode(row, verl.core_algos.POLICY_LOSS_REGISTRY["clip_cov"], _make_config(verl), "test")
    assert plan.unavailable is None and set(plan.conventions) == set(AGGS)
    assert torch.equal(torch.get_rng_state(), before)


# --- the probe on the conventions of older verls, built from verl 0.9.1's own functions ---


def _make_config(verl):
    from rlkernel.integrations.verl import probe

    return lambda info: verl.ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        global_batch_info=dict(info),
        policy_loss=verl.PolicyLossConfig(**probe.PROBE_POLICY_LOSS),
        **probe.PROBE_SETTINGS,
    )


def _plan(verl, mode, fn):
    from rlkernel.integrations.verl import losses, probe

    row = next(r for r in losses.LOSS_MODES if r.verl_name == mode)
    plan = probe.plan_mode(row, fn, _make_config(verl), "test")
    return plan, losses.make_policy_loss_fn(plan)


def test_probe_finds_gspo_forced_to_seq_mean_token_mean(verl):
    """verl 0.7's gspo aggregated seq-mean-token-mean whatever loss_agg_mode said."""
    real = verl.core_algos.POLICY_LOSS_REGISTRY["gspo"]

    @functools.wraps(real)
    def legacy(*args, loss_agg_mode, **kwargs):
        return real(*args, loss_agg_mode="seq-mean-token-mean", **kwargs)

    from rlkernel.integrations.verl import losses

    plan, fn = _plan(verl, "gspo", legacy)
    assert plan.conventions["token-mean"] is losses.SEQ_MEAN and not plan.refused
    for agg in AGGS:  # and what it registers reproduces that verl on other batches
        assert_same(run(fn, make_batch(21), agg, actor_config(verl, INFOS["global-dp4"])),
                    run(legacy, make_batch(21), agg, actor_config(verl, INFOS["global-dp4"])))  # fmt: skip


def test_probe_finds_sum_norm_over_the_horizon(verl):
    """verl 0.7's seq-mean-token-sum-norm: Σ mℓ / loss_scale_factor, no sequence count, no dp_size
    (verl 0.9.1's agg_loss with global_batch_size=1 and dp_size=1 computes exactly that)."""
    real = verl.core_algos.POLICY_LOSS_REGISTRY["vanilla"]

    @functools.wraps(real)
    def legacy(*args, loss_agg_mode, config, **kwargs):
        if loss_agg_mode == "seq-mean-token-sum-norm":
            info = {
                "global_batch_size": 1,
                "loss_scale_factor": config.global_batch_info.get("loss_scale_factor"),
            }
            config = dataclasses.replace(config, global_batch_info=info)
        return real(*args, loss_agg_mode=loss_agg_mode, config=config, **kwargs)

    from rlkernel.integrations.verl import losses

    plan, fn = _plan(verl, "vanilla", legacy)
    assert plan.conventions["seq-mean-token-sum-norm"] is losses.HORIZON
    assert plan.conventions["token-mean"] is losses.AS_GIVEN and not plan.refused
    for info in INFOS.values():
        config = actor_config(verl, info)
        assert_same(run(fn, make_batch(22), "seq-mean-token-sum-norm", config),
                    run(legacy, make_batch(22), "seq-mean-token-sum-norm", config))  # fmt: skip


def test_probe_refuses_a_loss_it_cannot_reproduce(verl):
    real = verl.core_algos.POLICY_LOSS_REGISTRY["vanilla"]

    @functools.wraps(real)
    def scaled(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return 1.5 * loss, metrics

    plan, fn = _plan(verl, "vanilla", scaled)
    assert set(plan.refused) == set(AGGS) and not plan.conventions
    with pytest.raises(
        RuntimeError, match="loss_agg_mode='token-mean' computes a loss rlkernel does not reproduce"
    ):
        run(fn, make_batch(0), "token-mean", actor_config(verl))


def test_probe_refuses_other_signatures_metrics_and_missing_modes(verl):
    real = verl.core_algos.POLICY_LOSS_REGISTRY["vanilla"]

    def old_signature(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None
    ):
        return real(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, None)

    @functools.wraps(real)
    def other_metrics(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss, {"actor/clipfrac": metrics["actor/pg_clipfrac"]}

    for fn, match in ((old_signature, "signature"), (other_metrics, "metrics"), (None, "no loss_mode")):
        plan, registered = _plan(verl, "vanilla", fn)
        assert plan.unavailable is not None and match in plan.unavailable
        with pytest.raises(RuntimeError, match=match):
            run(registered, make_batch(0), "token-mean", actor_config(verl))


# --- what is not supported ---


@pytest.mark.parametrize("mode", MODES)
def test_rollout_is_weights_match_verl(verl, mode):
    """verl's ``rollout_is_weights`` (random in [0, 2), garbage at masked positions) multiply the
    policy term as in verl (geo_mean: folded per sequence by the geometric mean)."""
    g = torch.Generator().manual_seed(40 + MODES.index(mode))
    for agg, info in itertools.product(AGGS, ("local", "global-dp4")):
        batch = make_batch(50 + AGGS.index(agg), advantages="seq" if agg == "token-sum" else "token")
        weights = 2 * torch.rand(6, 11, generator=g)
        weights[~batch[3]] = 7.0
        ours, theirs = compare(verl, mode, batch, agg, actor_config(verl, INFOS[info]), weights=weights)
        config = actor_config(verl, INFOS[info])
        plain = run(verl.core_algos.get_policy_loss_fn(f"rk_{mode}"), batch, agg, config)
        assert not torch.allclose(plain[2], ours[2])  # the weights do change the gradient




@pytest.mark.parametrize(
    "agg, missing",
    [("token-mean", "batch_num_tokens"), ("seq-mean-token-mean", "global_batch_size"),
     ("seq-mean-token-sum-norm", "global_batch_size")],
)  # fmt: skip
def test_dp_size_without_a_normalizer_is_refused_as_verl_does(verl, agg, missing):
    config = actor_config(verl, dict(dp_size=2, batch_num_tokens=50, global_batch_size=9) | {missing: None})
    with pytest.raises(ValueError, match=missing):
        run(verl.core_algos.get_policy_loss_fn("vanilla"), make_batch(0), agg, config)
    with pytest.raises(ValueError, match=missing):
        run(verl.core_algos.get_policy_loss_fn("rk_vanilla"), make_batch(0), agg, config)
