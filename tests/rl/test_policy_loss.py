"""policy_loss against the independent float64 formulas: every loss type × aggregation × layout,
rollout corrections, KL estimators, gradcheck, masking, NaN propagation and metrics."""

import pytest
import torch

import rlkernel as rk

from .helpers import (
    AGGREGATIONS,
    LOSS_CONFIGS,
    add_garbage,
    assert_close,
    config,
    grads,
    make_batch,
    oracle,
    pack,
    run,
)

LOSS_NAMES = tuple(LOSS_CONFIGS)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_matches_formula(name, aggregation, layout):
    cfg = config(name, aggregation=aggregation, kl_coef=0.05, entropy_coef=0.01)
    batch = make_batch(5, 7, seed=10 * LOSS_NAMES.index(name) + AGGREGATIONS.index(aggregation))
    kwargs = {}
    if layout == "packed":
        batch, cu, _ = pack(batch, [7, 0, 3, 5, 1])
        kwargs["cu_seqlens"] = cu
    out = run(cfg, batch, **kwargs)
    expected = oracle(cfg, batch, kwargs.get("cu_seqlens"))
    assert out.loss.dtype == torch.float64 and out.loss.dim() == 0
    assert_close(out.loss, expected)
    for got, want in zip(grads(out.loss, batch), grads(expected, batch), strict=True):
        assert_close(got, want)


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_per_token_advantages_match_formula(name):
    cfg = config(name, aggregation="seq-mean-token-mean")
    batch = make_batch(4, 6, seed=7, per_token_adv=True)
    out = run(cfg, batch)
    expected = oracle(cfg, batch)
    assert_close(out.loss, expected)
    assert_close(grads(out.loss, batch)[0], grads(expected, batch)[0])


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_exact_zero_advantages_match_formula(name):
    # A = 0 is a branch of its own: gmpo's sign-aware clip contributes lr' = 0 (verl's geo_mean),
    # sapo picks tau_neg, the clip flags need a strict sign.
    batch = make_batch(4, 6, seed=12, per_token_adv=True)
    batch["advantages"][:, ::2] = 0.0
    batch["advantages"][3] = 0.0
    cfg = config(name, aggregation="seq-mean-token-mean")
    out = run(cfg, batch)
    expected = oracle(cfg, batch)
    assert_close(out.loss, expected)
    assert_close(grads(out.loss, batch)[0], grads(expected, batch)[0])


@pytest.mark.parametrize("mode", ["token_tis", "seq_tis", "token_mis", "seq_mis"])
@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo", "sapo", "gmpo", "reinforce"])
@pytest.mark.parametrize("bounds", [(None, 1.3), (0.7, 1.4)])
def test_rollout_correction_matches_formula(name, mode, bounds):
    cfg = config(name, rollout_correction=mode, rollout_clip_min=bounds[0], rollout_clip_max=bounds[1])
    batch = make_batch(5, 6, seed=3)
    out = run(cfg, batch)
    expected = oracle(cfg, batch)
    assert_close(out.loss, expected)
    assert_close(grads(out.loss, batch)[0], grads(expected, batch)[0])
    assert "rollout_weight_mean" in out.metrics
    assert ("rollout_frac_truncated" if mode.endswith("tis") else "rollout_frac_masked") in out.metrics


@pytest.mark.parametrize(
    "estimator", ["k1", "k2", "k3", "abs", "k1+", "k3+", "k3_unclamped", "low_var_kl", "mse"]
)
def test_kl_term_matches_formula(estimator):
    cfg = config("ppo", kl_coef=0.3, kl_estimator=estimator)
    batch = make_batch(4, 6, seed=11)
    out = run(cfg, batch)
    expected = oracle(cfg, batch)
    assert_close(out.loss, expected)
    assert_close(grads(out.loss, batch)[0], grads(expected, batch)[0])


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_float32_matches_float64_formula(name):
    cfg = config(name, aggregation="token-mean", kl_coef=0.1, entropy_coef=0.02)
    batch = make_batch(4, 6, seed=5, dtype=torch.float32)
    out = run(cfg, batch)
    assert out.loss.dtype == torch.float32
    assert all(v.dtype == torch.float32 for v in out.metrics.values())
    expected = oracle(cfg, batch)
    assert_close(out.loss, expected, torch.float32)
    assert_close(grads(out.loss, batch)[0], grads(expected, batch)[0], torch.float32)


def test_bf16_inputs_give_float32_loss():
    batch = make_batch(3, 5, seed=2, dtype=torch.bfloat16)
    out = run(config("ppo"), batch)
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)


# ------------------------------------------------------------------------------------------ gradcheck


def _kink_free_batch(name):
    """float64 inputs whose ratios sit well inside or well outside every clip bound and kink.

    gradcheck differentiates the loss *value*, which for the stop-gradient objectives is not what
    the objective's gradient is by design; there the inputs are chosen where the two coincide:
    cispo with every ratio above the clip (a constant weight), gspo_token with one active token per
    sequence (s_it = s_i). Their general gradients are checked against the formula instead.
    """
    torch.manual_seed(0)
    logp = -torch.rand(3, 4, dtype=torch.float64) * 2 - 0.1
    token_offsets = torch.tensor([[0.05, -0.6, 0.6, 1.5], [-0.05, 0.6, -0.6, 0.05], [0.6, 0.05, -0.05, -0.6]])
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2, 3] = False
    if name.startswith("gspo"):
        token_offsets = torch.tensor([[0.03] * 4, [0.6] * 4, [-0.6] * 4])
    if name == "gspo_token":
        mask = torch.eye(3, 4, dtype=torch.bool)
    if name.startswith("cispo"):
        token_offsets = torch.tensor([[0.6, 1.5, 0.6, 1.5], [1.5, 0.6, 0.6, 1.5], [0.6, 0.6, 1.5, 1.5]])
    return {
        "logp": logp,
        "old_logp": logp - token_offsets.double(),
        "ref_logp": logp + 0.3 * torch.randn(3, 4, dtype=torch.float64),
        "rollout_logp": logp - token_offsets.double() + 0.1 * torch.randn(3, 4, dtype=torch.float64),
        "entropy": torch.rand(3, 4, dtype=torch.float64) + 0.1,
        "advantages": torch.tensor([0.7, -1.3, 0.9], dtype=torch.float64),
        "mask": mask,
    }


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_gradcheck(name):
    batch = _kink_free_batch(name)
    cfg = config(name, kl_coef=0.2, entropy_coef=0.05, aggregation="seq-mean-token-mean")

    def loss(logp, entropy):
        return run(cfg, {**batch, "logp": logp, "entropy": entropy}).loss

    logp = batch["logp"].clone().requires_grad_(True)
    entropy = batch["entropy"].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(loss, (logp, entropy), eps=1e-6, atol=1e-8)


# ------------------------------------------------------------------------------------------- masking


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_garbage_at_masked_positions_is_ignored(name, aggregation):
    cfg = config(
        name, aggregation=aggregation, kl_coef=0.1, entropy_coef=0.01, rollout_correction="token_tis"
    )
    clean = make_batch(4, 6, seed=13, per_token_adv=True)
    dirty = add_garbage(clean)
    out_clean, out_dirty = run(cfg, clean), run(cfg, dirty)
    assert torch.isfinite(out_dirty.loss)
    assert torch.equal(out_clean.loss, out_dirty.loss)
    off = clean["mask"] == 0
    for g_clean, g_dirty in zip(grads(out_clean.loss, clean), grads(out_dirty.loss, dirty), strict=True):
        assert torch.equal(g_dirty[off], torch.zeros_like(g_dirty[off]))
        assert torch.equal(g_clean, g_dirty)
    for key, value in out_dirty.metrics.items():
        assert torch.isfinite(value), key


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_all_masked_batch_is_exactly_zero(name, aggregation):
    cfg = config(name, aggregation=aggregation, kl_coef=0.1, entropy_coef=0.01, rollout_correction="seq_mis")
    batch = add_garbage({**make_batch(3, 5, seed=1), "mask": torch.zeros(3, 5, dtype=torch.bool)})
    out = run(cfg, batch)
    assert out.loss.item() == 0.0 and not torch.isnan(out.loss)
    for g in grads(out.loss, batch):
        assert torch.equal(g, torch.zeros_like(g))
    assert all(v.item() == 0.0 for v in out.metrics.values())


@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("where", ["logp", "old_logp", "advantages"])
def test_nan_at_active_position_propagates(name, where):
    batch = make_batch(3, 5, seed=4, per_token_adv=True)
    poisoned = dict(batch)
    poisoned[where] = batch[where].detach().clone()
    poisoned[where][0, 0] = float("nan")  # row 0, position 0 is always active
    out = run(config(name), poisoned)
    if name == "reinforce" and where == "old_logp":  # −A·logp does not read old_logp; the metrics do
        assert torch.isnan(out.metrics["approx_kl"]) and torch.isfinite(out.loss)
    else:
        assert torch.isnan(out.loss)


def test_empty_tensors():
    empty = {k: v[:0] for k, v in make_batch(3, 4).items()}
    out = run(config("ppo"), empty)
    assert out.loss.item() == 0.0


def test_mask_dtypes_are_equivalent():
    batch = make_batch(3, 5, seed=8)
    cfg = config("ppo")
    reference = run(cfg, batch).loss
    for mask in (batch["mask"].int(), batch["mask"].float(), batch["mask"].to(torch.uint8) * 3):
        assert torch.equal(run(cfg, {**batch, "mask": mask}).loss, reference)


# ------------------------------------------------------------------------------------------- metrics


def test_ppo_metrics_by_hand():
    #             r = e^0   e^0.5 (high)  e^-0.5 (low)  e^1.2 (dual, A<0)  masked
    lr = torch.tensor([[0.0, 0.5, -0.5, 1.2, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    old = torch.full((1, 5), -1.0, dtype=torch.float64)
    logp = (old + lr).requires_grad_(True)
    cfg = rk.PolicyLossConfig(loss_type="ppo", clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    metrics = rk.policy_loss(logp, old, adv, mask, cfg).metrics
    assert metrics["clip_frac_high"].item() == 0.25
    assert metrics["clip_frac_low"].item() == 0.25
    assert metrics["clip_frac"].item() == 0.5
    assert metrics["clip_frac_dual"].item() == 0.25
    r = torch.exp(lr[0, :4])
    torch.testing.assert_close(metrics["ratio_mean"], r.mean())
    torch.testing.assert_close(metrics["ratio_min"], r.min())
    torch.testing.assert_close(metrics["ratio_max"], r.max())
    torch.testing.assert_close(metrics["approx_kl"], (torch.exp(-lr[0, :4]) - 1 + lr[0, :4]).mean())
    assert all(not v.requires_grad and v.dim() == 0 for v in metrics.values())


def test_gspo_metrics_are_about_sequences():
    lr = torch.tensor([[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    old = torch.full((3, 3), -2.0, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 5.0], dtype=torch.float64)
    cfg = rk.PolicyLossConfig(loss_type="gspo", clip_low=0.1, clip_high=0.1)
    metrics = rk.policy_loss(old + lr, old, adv, mask, cfg).metrics
    assert metrics["clip_frac_high"].item() == 0.5 and metrics["clip_frac_low"].item() == 0.5
    torch.testing.assert_close(metrics["ratio_mean"], torch.tensor([0.5, -0.5]).exp().mean().double())


def test_rollout_metrics_by_hand():
    old = torch.zeros(1, 4, dtype=torch.float64)
    rollout = -torch.log(torch.tensor([[0.5, 1.0, 1.5, 3.0]], dtype=torch.float64))  # rho = 0.5, 1, 1.5, 3
    batch = dict(logp=old.clone().requires_grad_(True), old=old, adv=torch.ones(1, dtype=torch.float64))
    mask = torch.ones(1, 4)
    cfg = rk.PolicyLossConfig(rollout_correction="token_tis", rollout_clip_max=2.0)
    metrics = rk.policy_loss(batch["logp"], old, batch["adv"], mask, cfg, rollout_logp=rollout).metrics
    assert metrics["rollout_frac_truncated"].item() == 0.25
    torch.testing.assert_close(metrics["rollout_weight_mean"], torch.tensor(5.0 / 4, dtype=torch.float64))
    cfg = rk.PolicyLossConfig(rollout_correction="token_mis", rollout_clip_min=0.6, rollout_clip_max=2.0)
    metrics = rk.policy_loss(batch["logp"], old, batch["adv"], mask, cfg, rollout_logp=rollout).metrics
    assert metrics["rollout_frac_masked"].item() == 0.5
    torch.testing.assert_close(metrics["rollout_weight_mean"], torch.tensor(2.5 / 4, dtype=torch.float64))


def test_optional_metrics_appear_with_their_inputs():
    batch = make_batch(3, 4, seed=6)
    plain = rk.policy_loss(
        batch["logp"], batch["old_logp"], batch["advantages"], batch["mask"], config("ppo")
    )
    assert set(plain.metrics) == {
        "clip_frac_low",
        "clip_frac_high",
        "clip_frac",
        "clip_frac_dual",
        "approx_kl",
        "ratio_mean",
        "ratio_min",
        "ratio_max",
    }
    full = run(config("ppo"), batch)
    assert {"kl_ref", "entropy_mean"} <= set(full.metrics)
    assert "rollout_weight_mean" not in full.metrics  # rollout_logp is ignored without a correction


def test_gspo_and_gspo_token_agree_under_seq_mean_token_mean():
    batch = make_batch(4, 6, seed=21)
    a = run(config("gspo", aggregation="seq-mean-token-mean"), batch)
    b = run(config("gspo_token", aggregation="seq-mean-token-mean"), batch)
    assert_close(a.loss, b.loss)
    assert_close(grads(a.loss, batch)[0], grads(b.loss, batch)[0])


def test_global_normalizers_accept_int_float_and_tensors():
    batch = make_batch(4, 6, seed=9)
    for aggregation, key in (("token-mean", "global_tokens"), ("seq-mean-token-sum", "global_seqs")):
        cfg = config("ppo", aggregation=aggregation)
        values = [run(cfg, batch, **{key: v}).loss for v in (7, 7.0, torch.tensor(7), torch.tensor(7.0))]
        assert all(torch.equal(v, values[0]) for v in values)


def test_metrics_are_computed_once_on_first_access():
    import rlkernel as rk

    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 6, generator=g).requires_grad_(True)
    cfg = rk.PolicyLossConfig.preset("dapo")
    out = rk.policy_loss(logp, logp.detach() + 0.1, torch.randn(3, generator=g), torch.ones(3, 6), cfg)
    first = out.metrics
    assert first is out.metrics and set(first) >= {"clip_frac", "approx_kl", "ratio_mean"}
    assert all(not v.requires_grad for v in first.values())
    assert "PolicyLossOutput(loss=" in repr(out)
