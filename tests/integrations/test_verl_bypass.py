"""``rk_bypass_mode`` against verl 0.9.1's own ``compute_policy_loss_bypass_mode``.

verl's function runs from its registry (fixture ``verl``), on the batches of ``test_verl.py``
(ragged masks with a full and an empty row, advantages of both signs, log-ratios N(0, 0.6²)), with
the rollout-correction settings in ``config.policy_loss.rollout_correction`` as verl's trainer sets
them in bypass mode:

* loss_type (ppo_clip | reinforce) × rollout_is (none | token | sequence; TIS or IcePop thresholds;
  batch-normalized or not) × rollout_rs (none, single criteria, a chain) × every ``loss_agg_mode``
  × ``global_batch_info`` (none; ``dp_size=4`` with every normalizer): loss and ∂loss/∂log_prob
  within 1e-6, the same metric names in the same order (verl's ``actor/*`` then ``rollout_corr/*``),
  values within 1e-6 (relative for the large ones, χ² and perplexities).
* Every rejection criterion (k1 as a ``lower_upper`` window and as one number), verl's bypass
  presets, float64, log-ratios beyond ±20, int/float masks, garbage at masked positions.
* ``rollout_is_batch_normalize`` across two ranks (gloo, forked processes): verl all-reduces the
  weights' mean, and so does rk_bypass_mode.
* Bad settings raise ``ValueError``/``TypeError`` naming the setting; an all-masked micro-batch
  raises as verl's does; the registry holds rk_bypass_mode with verl's signature; the probe found
  verl's aggregation for it.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os

import pytest
import torch

from .test_verl import AGGS, INFOS, POLICY, SETTINGS, make_batch, run
from .test_verl import assert_same as _assert_same


def with_rollout_correction(verl, info=None, correction=None, **settings):
    """verl's ActorConfig (``test_verl``'s settings) whose ``policy_loss.rollout_correction`` is
    ``correction``."""
    return verl.ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        global_batch_info=dict(info or {}),
        policy_loss=verl.PolicyLossConfig(**POLICY, rollout_correction=correction),
        **{**SETTINGS, **settings},
    )


def bypass_config(verl, info=None, **rollout_correction):
    """The actor config as verl's ``apply_bypass_mode`` leaves it: a ``RolloutCorrectionConfig``
    (verl's defaults for what is not given) in ``policy_loss.rollout_correction``."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    correction = RolloutCorrectionConfig(bypass_mode=True, **rollout_correction)
    return with_rollout_correction(verl, info, correction)


def assert_same(ours, theirs, dtype=torch.float32):
    _assert_same(ours, theirs, dtype, metric_rel=1e-6)


def compare(verl, batch, agg, config, dtype=torch.float32):
    ours = run(verl.core_algos.get_policy_loss_fn("rk_bypass_mode"), batch, agg, config)
    theirs = run(verl.core_algos.get_policy_loss_fn("bypass_mode"), batch, agg, config)
    assert_same(ours, theirs, dtype)
    return ours, theirs


# rollout_correction settings: loss type × IS weights × rejection (thresholds that reject some of
# the tokens / sequences of these batches, and keep some).
CASES = {
    "ppo_clip": dict(loss_type="ppo_clip", rollout_is=None),
    "ppo_clip, seq TIS (metrics only)": dict(loss_type="ppo_clip", rollout_is="sequence"),
    "ppo_clip, token TIS normalized, seq_mean_k1": dict(
        loss_type="ppo_clip", rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True,
        rollout_rs="seq_mean_k1", rollout_rs_threshold="0.8_1.2",
    ),  # fmt: skip
    "ppo_clip, token IcePop, token_k3": dict(
        loss_type="ppo_clip", rollout_is="token", rollout_is_threshold="0.6_1.8", rollout_rs="token_k3",
        rollout_rs_threshold=0.1,
    ),  # fmt: skip
    "reinforce": dict(loss_type="reinforce", rollout_is=None),
    "reinforce, token TIS": dict(loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.4),
    "reinforce, seq TIS": dict(loss_type="reinforce", rollout_is="sequence", rollout_is_threshold=2.0),
    "reinforce, token IcePop": dict(
        loss_type="reinforce", rollout_is="token", rollout_is_threshold="0.7_1.5"
    ),
    "reinforce, seq IcePop normalized": dict(
        loss_type="reinforce", rollout_is="sequence", rollout_is_threshold="0.3_3.0",
        rollout_is_batch_normalize=True,
    ),  # fmt: skip
    "reinforce, token TIS normalized, token_k1": dict(
        loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.6, rollout_is_batch_normalize=True,
        rollout_rs="token_k1", rollout_rs_threshold="0.5_1.8",
    ),  # fmt: skip
    "reinforce, seq TIS normalized, seq_sum_k2": dict(
        loss_type="reinforce", rollout_is="sequence", rollout_is_threshold=3.0,
        rollout_is_batch_normalize=True, rollout_rs="seq_sum_k2", rollout_rs_threshold=0.6,
    ),  # fmt: skip
    "reinforce, token TIS, chain seq_max_k3 + token_k2": dict(
        loss_type="reinforce", rollout_is="token", rollout_is_threshold=2.0,
        rollout_rs="seq_max_k3, token_k2", rollout_rs_threshold="0.9,0.12",
    ),  # fmt: skip
}


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_every_setting_and_aggregation_matches_verl(verl, case, agg):
    for info, seed in itertools.product(("local", "global-dp4"), (0, 1)):
        batch = make_batch(seed + 3 * list(CASES).index(case), advantages="seq" if seed else "token")
        compare(verl, batch, agg, bypass_config(verl, INFOS[info], **CASES[case]))


def test_the_settings_matter(verl):
    """The comparisons above are not vacuous: the IS weights change reinforce's loss (not
    ppo_clip's), batch normalization changes it again, and rejection removes some tokens (not all)."""
    batch = make_batch(5)
    fn = verl.core_algos.get_policy_loss_fn("rk_bypass_mode")

    def loss(**settings):
        return run(fn, batch, "token-mean", bypass_config(verl, INFOS["global-dp1"], **settings))

    plain = loss(loss_type="reinforce", rollout_is=None)[0]
    weighted = loss(loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.4)
    normalized = loss(loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.4,
                      rollout_is_batch_normalize=True)  # fmt: skip
    assert len({plain.item(), weighted[0].item(), normalized[0].item()}) == 3
    assert normalized[1]["rollout_corr/rollout_is_batch_norm_factor"] != 1.0
    ppo = loss(loss_type="ppo_clip", rollout_is=None)[0]
    assert loss(loss_type="ppo_clip", rollout_is="token", rollout_is_threshold=1.4)[0] == ppo
    rejected = loss(loss_type="ppo_clip", rollout_is=None, rollout_rs="token_k3", rollout_rs_threshold=0.1)
    assert 0 < rejected[1]["rollout_corr/rollout_rs_masked_fraction"] < 1 and rejected[0] != ppo


# Each criterion with a threshold that rejects part of these batches; k1 also as one number u
# (verl's window [1/u, u]).
CRITERIA = {
    "token_k1": "0.6_1.5",
    "token_k1 (one number)": 1.7,
    "token_k2": 0.1,
    "token_k3": 0.12,
    "seq_sum_k1": "0.4_2.5",
    "seq_sum_k2": 0.8,
    "seq_sum_k3": 0.9,
    "seq_mean_k1": 1.25,
    "seq_mean_k2": 0.15,
    "seq_mean_k3": 0.18,
    "seq_max_k2": 0.4,
    "seq_max_k3": 0.5,
}


@pytest.mark.parametrize("criterion", list(CRITERIA))
def test_each_rejection_criterion_matches_verl(verl, criterion):
    name = criterion.split(" ")[0]
    batch = make_batch(60 + list(CRITERIA).index(criterion))
    for loss_type, agg in (("ppo_clip", "token-mean"), ("reinforce", "seq-mean-token-sum")):
        config = bypass_config(
            verl, INFOS["global-dp4"], loss_type=loss_type, rollout_is="token",
            rollout_rs=name, rollout_rs_threshold=CRITERIA[criterion],
        )  # fmt: skip
        _, (_, metrics, _) = compare(verl, batch, agg, config)
        assert 0 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 1, criterion


@pytest.mark.parametrize(
    "preset, kwargs",
    [("bypass_ppo_clip", {}), ("bypass_ppo_clip_geo_rs", dict(rs_threshold="0.8_1.25")),
     ("bypass_ppo_clip_k3_rs", dict(rs_threshold=0.2)), ("bypass_pg_is", {}),
     ("bypass_pg_token_icepop", {}), ("bypass_pg_geo_rs", dict(rs_threshold="0.8_1.25")),
     ("bypass_pg_geo_rs_seq_tis", dict(rs_threshold="0.8_1.25")),
     ("bypass_pg_geo_rs_token_tis", dict(rs_threshold="0.8_1.25"))],
)  # fmt: skip
def test_verls_bypass_presets_match_verl(verl, preset, kwargs):
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    correction = getattr(RolloutCorrectionConfig, preset)(**kwargs)
    config = with_rollout_correction(verl, INFOS["global-dp4"], correction)
    for agg in ("token-mean", "seq-mean-token-mean"):
        compare(verl, make_batch(70, advantages="seq"), agg, config)


def test_float64_matches_verl(verl):
    batch = make_batch(7, dtype=torch.float64)
    for case, agg in itertools.product(("ppo_clip, token TIS normalized, seq_mean_k1",
                                        "reinforce, seq TIS normalized, seq_sum_k2"), AGGS):  # fmt: skip
        compare(verl, batch, agg, bypass_config(verl, INFOS["global-dp4"], **CASES[case]), torch.float64)


def test_extreme_ratios_match_verl(verl):
    """Log-ratios of ±25 (beyond verl's ±20 clamps of the ratio, the IS weights, the rejection
    statistics and χ²): rows 0 (ρ = e^25) and 2 (ρ = e^−25) are rejected by the k1 windows, so the IS
    weights that verl rounds up to e^−20 (row 2) reach only the batch mean, a relative 1e-9 of it."""
    old, log_prob, adv, mask = make_batch(3)
    old = old.clone()
    old[0] = log_prob[0] - 25.0
    old[2] = log_prob[2] + 25.0
    for case in ("ppo_clip, token TIS normalized, seq_mean_k1", "reinforce, token TIS normalized, token_k1"):
        config = bypass_config(verl, INFOS["global-dp4"], **CASES[case])
        compare(verl, (old, log_prob, adv, mask), "token-mean", config)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_int_and_float_masks_match_verl(verl, dtype):
    old, log_prob, adv, mask = make_batch(5)
    config = bypass_config(verl, INFOS["global-dp1"], **CASES["reinforce, token TIS normalized, token_k1"])
    compare(verl, (old, log_prob, adv, mask.to(dtype)), "token-mean", config)


def test_masked_garbage_is_ignored(verl):
    old, log_prob, adv, mask = make_batch(11)
    dirty = [t.clone() for t in (old, log_prob, adv)]
    for t, value in zip(dirty, (float("nan"), float("inf"), float("-inf")), strict=True):
        t[~mask] = value
    fn = verl.core_algos.get_policy_loss_fn("rk_bypass_mode")
    for case in ("ppo_clip, token IcePop, token_k3", "reinforce, seq TIS normalized, seq_sum_k2"):
        config = bypass_config(verl, INFOS["global-dp1"], **CASES[case])
        clean = run(fn, (old, log_prob, adv, mask), "seq-mean-token-mean", config)
        noisy = run(fn, (*dirty, mask), "seq-mean-token-mean", config)
        torch.testing.assert_close(noisy[0], clean[0], atol=0, rtol=0)
        torch.testing.assert_close(noisy[2], clean[2], atol=0, rtol=0)


def test_nonfinite_active_log_prob_gives_nan(verl):
    """rlkernel's rule: NaN/±inf at an active token makes the loss NaN (verl's comparisons would
    reject such a token instead)."""
    old, log_prob, adv, mask = make_batch(12)
    fn = verl.core_algos.get_policy_loss_fn("rk_bypass_mode")
    for value, case in itertools.product(
        (float("nan"), float("inf")), ("ppo_clip, token IcePop, token_k3", "reinforce, token TIS")
    ):
        bad = old.clone()
        bad[0, 0] = value  # (0, 0) is active
        loss, _, _ = run(fn, (bad, log_prob, adv, mask), "token-mean", bypass_config(verl, **CASES[case]))
        assert torch.isnan(loss), (value, case)


def test_all_masked_micro_batch_raises_as_verl_does(verl):
    old, log_prob, adv, mask = make_batch(9)
    batch = (old, log_prob, adv, torch.zeros_like(mask))
    config = bypass_config(verl, INFOS["global-dp4"], loss_type="reinforce", rollout_is="token")
    for name in ("bypass_mode", "rk_bypass_mode"):
        with pytest.raises(ValueError, match="response_mask"):
            run(verl.core_algos.get_policy_loss_fn(name), batch, "token-mean", config)


BAD = [
    (dict(loss_type="ppo"), ValueError, "loss_type must be one of"),
    (dict(rollout_is="tokens"), ValueError, "rollout_is must be one of"),
    (dict(rollout_is="token", rollout_is_threshold="abc"), ValueError, "rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_threshold=""), ValueError, "rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_threshold=-1.0), ValueError, "rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_threshold="2.0_1.0"), ValueError, "rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_threshold="0_1.0"), ValueError, "rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_threshold=float("nan")), ValueError, "rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_threshold=True), TypeError, "rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_batch_normalize="yes"), TypeError, "rollout_is_batch_normalize"),
    (dict(rollout_rs="token_k4", rollout_rs_threshold=0.1), ValueError, "rollout_rs must name"),
    (dict(rollout_rs=" , ", rollout_rs_threshold=0.1), ValueError, "rollout_rs must name"),
    (dict(rollout_rs="token_k3"), ValueError, "rollout_rs_threshold is required"),
    (dict(rollout_rs="token_k3,seq_max_k2", rollout_rs_threshold="0.1,0.2,0.3"), ValueError, "one per"),
    (dict(rollout_rs="token_k3", rollout_rs_threshold="0.1_0.2"), ValueError, "upper bound only"),
    (dict(rollout_rs="token_k1", rollout_rs_threshold="1.5_0.5"), ValueError, "lower <= upper"),
    (dict(rollout_rs="seq_max_k3", rollout_rs_threshold=-0.1), ValueError, "must be > 0"),
    (dict(rollout_rs="seq_max_k3", rollout_rs_threshold=[0.1]), TypeError, "rollout_rs_threshold"),
]


@pytest.mark.parametrize("settings, error, match", BAD)
def test_bad_settings_raise_naming_the_setting(verl, settings, error, match):
    fn = verl.core_algos.get_policy_loss_fn("rk_bypass_mode")
    config = with_rollout_correction(verl, correction={"loss_type": "ppo_clip", **settings})  # a dict
    with pytest.raises(error, match=match) as caught:
        run(fn, make_batch(0), "token-mean", config)
    assert "policy_loss.rollout_correction" in str(caught.value) or "rk_bypass_mode" in str(caught.value)


def test_missing_rollout_correction_and_bad_actor_settings_raise(verl):
    fn = verl.core_algos.get_policy_loss_fn("rk_bypass_mode")
    config = with_rollout_correction(verl, correction=None)
    with pytest.raises(ValueError, match="policy_loss.rollout_correction"):
        run(fn, make_batch(0), "token-mean", config)
    # the vanilla loss's dual clip c must be > 1, as verl asserts
    config = with_rollout_correction(verl, correction=dict(loss_type="ppo_clip"), clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="rk_bypass_mode.*clip_ratio_c"):
        run(fn, make_batch(0), "token-mean", config)


def test_registered_with_verls_signature_and_probed(verl):
    import inspect

    from rlkernel.integrations.verl import losses

    integration, core_algos = verl.integration, verl.core_algos
    ours = core_algos.get_policy_loss_fn("rk_bypass_mode")
    assert ours is integration.RK_LOSSES["rk_bypass_mode"]
    theirs = inspect.signature(core_algos.POLICY_LOSS_REGISTRY["bypass_mode"]).parameters
    mine = inspect.signature(ours).parameters
    assert list(mine) == list(theirs)
    assert [p.default for p in mine.values()] == [p.default for p in theirs.values()]
    plan = integration.PLANS["rk_bypass_mode"]
    assert plan.unavailable is None and not plan.refused
    assert dict(plan.conventions) == {agg: losses.AS_GIVEN for agg in AGGS}


# --- rollout_is_batch_normalize over two ranks: verl all-reduces the mean of the weights ---------


def _rank(rank: int, path: str, queue) -> None:
    """One rank of a 2-process gloo group: its half of a batch, verl's and rlkernel's bypass loss."""
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
        verl = _VERL[0]
        old, log_prob, adv, mask = (t[3 * rank : 3 * rank + 3] for t in make_batch(31))
        out = []
        for case in ("reinforce, token TIS normalized, token_k1", "reinforce, seq IcePop normalized"):
            config = bypass_config(verl, **CASES[case])
            ours = run(verl.core_algos.get_policy_loss_fn("rk_bypass_mode"), (old, log_prob, adv, mask),
                       "token-mean", config)  # fmt: skip
            theirs = run(verl.core_algos.get_policy_loss_fn("bypass_mode"), (old, log_prob, adv, mask),
                         "token-mean", config)  # fmt: skip
            assert_same(ours, theirs)
            out.append((ours[0].item(), ours[1]["rollout_corr/rollout_is_batch_norm_factor"]))
        dist.destroy_process_group()
        queue.put((rank, out))
    except BaseException as error:  # report it to the parent (a forked child's traceback is lost)
        queue.put((rank, repr(error)))


_VERL: list = []


@pytest.mark.skipif(
    not hasattr(os, "fork") or not torch.distributed.is_available(), reason="needs fork and torch.distributed"
)
def test_batch_normalization_over_two_ranks_matches_verl(verl, tmp_path):
    """Two forked ranks (gloo): on each, verl's bypass loss and rk_bypass_mode agree (loss, gradient,
    metrics); the normalization factor is the mean over both ranks' weights, not the rank's own."""
    from rlkernel.rl import rollout

    _VERL[:] = [verl]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():  # a hung rank: end it (the assertion below fails)
                p.kill()
    assert all(isinstance(results[r], list) for r in range(2)), results
    old, log_prob, _, mask = make_batch(31)
    windows = (("token", "token_tis", None, 1.6), ("seq", "seq_mis", 0.3, 3.0))  # the two CASES'
    for i, (level, mode, lo, hi) in enumerate(windows):
        w = rollout.rollout_weights(log_prob, old, mask, mode, lo, hi).weight
        total, count = rollout.batch_mean_terms(w, mask, level)
        whole = (total / count).item()
        local = [(lambda t, c: (t / c).item())(*rollout.batch_mean_terms(w[s], mask[s], level))
                 for s in (slice(0, 3), slice(3, 6))]  # fmt: skip
        for r in range(2):
            assert results[r][i][1] == pytest.approx(whole, rel=1e-6)
            assert abs(results[r][i][1] - local[r]) > 1e-3
