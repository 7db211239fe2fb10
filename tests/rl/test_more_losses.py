"""The issue-14 loss types (vespo, dppo_tv, dppo_kl, clip_cov, kl_cov, dro) and the ``seq_ratio``
conventions of gspo/gspo_token against the float64 oracles of ``formulas_more``: every aggregation ×
layout, per-token advantages, float32, rollout corrections (vespo folds them into its ratio), masking,
NaN propagation, metrics, properties that tie them to the older loss types, and the fused path
(which must keep the composed algebra for them)."""

import pytest
import torch

import rlkernel as rk
from rlkernel.rl import token_loss as tl_mod

from .formulas_more import MORE_LOSS_CONFIGS, NEW_LOSS_TYPES
from .formulas_more import oracle as oracle_more
from .helpers import AGGREGATIONS, add_garbage, assert_close, grads, make_batch, pack, run

NAMES = tuple(MORE_LOSS_CONFIGS)
AGGS = (*AGGREGATIONS, "token-sum")
CORRECTIONS = ("token_tis", "seq_tis", "token_mis", "seq_mis")
SEED = 1234  # clip_cov draws its tokens from torch's default generator: both sides seed it alike


def cfg_of(name, **overrides) -> rk.PolicyLossConfig:
    return rk.PolicyLossConfig(**{**MORE_LOSS_CONFIGS[name], **overrides})


def library(cfg, batch, **kwargs):
    torch.manual_seed(SEED)
    return run(cfg, batch, **kwargs)


def oracle(cfg, batch, cu=None, **kwargs):
    torch.manual_seed(SEED)
    return oracle_more(cfg, batch, cu, **kwargs)


def check(cfg, batch, dtype=torch.float64, **kwargs):
    out = library(cfg, batch, **kwargs)
    expected = oracle(cfg, batch, kwargs.get("cu_seqlens"))
    assert_close(out.loss, expected, dtype)
    for got, want in zip(grads(out.loss, batch), grads(expected, batch), strict=True):
        assert_close(got, want, dtype)
    return out


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("name", NAMES)
def test_matches_formula(name, aggregation, layout):
    cfg = cfg_of(name, aggregation=aggregation, kl_coef=0.05, entropy_coef=0.01)
    batch = make_batch(5, 7, seed=10 * NAMES.index(name) + AGGS.index(aggregation))
    kwargs = {}
    if layout == "packed":
        batch, kwargs["cu_seqlens"], _ = pack(batch, [7, 0, 3, 5, 1])
    out = check(cfg, batch, **kwargs)
    assert out.loss.dtype == torch.float64 and out.loss.dim() == 0
    # The test can fail: the selections and trust regions take some tokens and leave others.
    if cfg.loss_type in ("clip_cov", "kl_cov"):
        assert 0 < out.metrics["cov_frac"] < 1
    if cfg.loss_type.startswith("dppo"):
        assert 0 < out.metrics["clip_frac"] < 1


@pytest.mark.parametrize("name", NAMES)
def test_per_token_advantages_match_formula(name):
    cfg = cfg_of(name, aggregation="seq-mean-token-mean")
    check(cfg, make_batch(4, 6, seed=7, per_token_adv=True))


@pytest.mark.parametrize("name", NAMES)
def test_float32_matches_float64_formula(name):
    cfg = cfg_of(name, kl_coef=0.05)
    batch = make_batch(4, 6, seed=3, dtype=torch.float32)
    out = library(cfg, batch)
    assert out.loss.dtype == torch.float32
    assert_close(out.loss, oracle(cfg, batch), torch.float32)
    assert_close(grads(out.loss, batch)[0], grads(oracle(cfg, batch), batch)[0], torch.float32)


@pytest.mark.parametrize("bounds", [(None, 1.3), (0.7, 1.4)])
@pytest.mark.parametrize("mode", CORRECTIONS)
@pytest.mark.parametrize("name", ["vespo", "vespo_geo", "dppo_tv", "clip_cov", "kl_cov", "dro"])
def test_rollout_correction_matches_formula(name, mode, bounds):
    cfg = cfg_of(name, rollout_correction=mode, rollout_clip_min=bounds[0], rollout_clip_max=bounds[1])
    batch = make_batch(4, 6, seed=17)
    out = check(cfg, batch)
    assert "rollout_weight_mean" in out.metrics


def test_vespo_folds_the_rollout_weight_into_its_ratio_not_into_the_loss():
    """TRL: log w = Σ clamp(lr) + Σ clamp(log ω) for vespo; the loss is not multiplied by ω."""
    batch = make_batch(3, 5, seed=2, empty_row=False)
    with torch.no_grad():
        batch["rollout_logp"].copy_(batch["old_logp"] - 0.2)  # ω_t = e^0.2 on every token
    cfg = cfg_of("vespo", rollout_correction="token_tis", rollout_clip_max=10.0)  # no truncation
    shifted = dict(batch, old_logp=batch["old_logp"] - 0.2)  # the same w without a correction
    folded = library(cfg, batch).loss
    plain = library(cfg_of("vespo"), shifted).loss
    assert_close(folded, plain)
    multiplied = library(cfg_of("vespo"), batch).loss * torch.exp(torch.tensor(0.2, dtype=torch.float64))
    assert not torch.allclose(folded, multiplied)


@pytest.mark.parametrize("name", NAMES)
def test_garbage_and_all_masked(name):
    cfg = cfg_of(name, kl_coef=0.1, entropy_coef=0.02, rollout_correction="token_tis")
    batch = make_batch(4, 6, seed=5)
    clean = library(cfg, batch)
    dirty_batch = add_garbage(batch)
    dirty = library(cfg, dirty_batch)
    assert_close(dirty.loss, clean.loss)
    g_dirty = grads(dirty.loss, dirty_batch)
    for got, want in zip(g_dirty, grads(clean.loss, batch), strict=True):
        assert_close(got, want)
    off = batch["mask"] == 0
    assert torch.count_nonzero(g_dirty[0][off]) == 0
    empty = dict(dirty_batch, mask=torch.zeros_like(batch["mask"]))
    out = library(cfg, empty)
    assert out.loss.item() == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads(out.loss, empty))
    assert all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("where", ["logp", "old_logp", "advantages"])
@pytest.mark.parametrize("name", NEW_LOSS_TYPES)
def test_nonfinite_at_an_active_token_gives_nan(name, where):
    cfg = cfg_of(name)
    for value in (float("nan"), float("inf"), -float("inf")):
        batch = make_batch(3, 5, seed=8)
        with torch.no_grad():
            if where == "advantages":
                batch["advantages"][0] = value
            else:
                batch[where][0, 0] = value  # (0, 0) is active
        assert torch.isnan(library(cfg, batch).loss), (name, where, value)


# ----------------------------------------------------------------------------------- properties


def test_vespo_on_policy_is_reinforce():
    """At w = 1 the Gamma weight is φ = e^λ·1·e^−λ = 1, whatever k and λ: −A·logp."""
    batch = make_batch(4, 6, seed=9)
    batch = dict(batch, old_logp=batch["logp"].detach().clone())
    out = library(cfg_of("vespo", vespo_k_neg=5.0, vespo_lambda_pos=0.7), batch)
    ref = run(rk.PolicyLossConfig(loss_type="reinforce"), batch)
    assert_close(out.loss, ref.loss)
    assert_close(out.metrics["vespo_phi_mean"], torch.tensor(1.0, dtype=torch.float64))


def test_dro_is_reinforce_plus_a_quadratic_penalty():
    batch = make_batch(4, 6, seed=10)
    beta = 0.6
    out = library(cfg_of("dro", dro_beta=beta), batch)
    ref = run(rk.PolicyLossConfig(loss_type="reinforce"), batch)
    lr = (batch["logp"] - batch["old_logp"]).detach()
    penalty = 0.5 * beta * torch.where(batch["mask"], lr.square(), 0.0).sum() / batch["mask"].sum()
    assert_close(out.loss, ref.loss + penalty)


def test_dppo_with_open_thresholds_and_no_cap_is_a_detached_ratio_pg():
    """Thresholds too wide to bite and no cap: ℓ = −A·sg[r]·logp, i.e. the gradient of PPO's −A·r."""
    batch = make_batch(4, 6, seed=11)
    for loss_type in ("dppo_tv", "dppo_kl"):
        cfg = rk.PolicyLossConfig(loss_type=loss_type, clip_low=10.0, clip_high=10.0, dppo_ratio_cap=None)
        out = library(cfg, batch)
        ppo = run(rk.PolicyLossConfig(clip_low=1e6, clip_high=1e6), batch)  # unclipped −A·r
        assert_close(grads(out.loss, batch)[0], grads(ppo.loss, batch)[0])
        assert out.metrics["clip_frac"] == 0


def test_kl_cov_without_penalty_and_clip_cov_without_window_are_unclipped_or_plain_ppo():
    batch = make_batch(4, 6, seed=12)
    plain = run(rk.PolicyLossConfig(clip_low=1e6, clip_high=1e6), batch)  # −A·r
    out = library(rk.PolicyLossConfig(loss_type="kl_cov", kl_cov_coef=0.0, kl_cov_ratio=0.5), batch)
    assert_close(out.loss, plain.loss)
    ppo = run(rk.PolicyLossConfig(clip_low=0.2, clip_high=0.28), batch)
    cfg = rk.PolicyLossConfig(loss_type="clip_cov", clip_high=0.28, clip_cov_lb=100.0, clip_cov_ub=101.0)
    out = library(cfg, batch)
    assert_close(out.loss, ppo.loss)
    assert out.metrics["cov_frac"] == 0


def test_clip_cov_cuts_exactly_k_candidates_and_its_draw_follows_the_seed():
    batch = make_batch(6, 8, seed=13, empty_row=False)
    n_active = int(batch["mask"].sum())
    cfg = rk.PolicyLossConfig(loss_type="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=-10.0, clip_cov_ub=10.0)
    out = library(cfg, batch)
    k = max(int(0.2 * n_active), 1)
    assert round(out.metrics["cov_frac"].item() * n_active) == k
    losses = set()
    for seed in range(6):
        torch.manual_seed(seed)
        losses.add(round(run(cfg, batch).loss.item(), 12))
    assert len(losses) > 1  # different draws cut different tokens
    torch.manual_seed(3)
    first = run(cfg, batch).loss
    torch.manual_seed(3)
    assert torch.equal(run(cfg, batch).loss, first)


def test_kl_cov_penalizes_the_largest_covariances():
    batch = make_batch(5, 6, seed=14, empty_row=False)
    cfg = rk.PolicyLossConfig(loss_type="kl_cov", kl_cov_ratio=0.25, kl_cov_coef=1.0)
    n_active = int(batch["mask"].sum())
    out = library(cfg, batch)
    assert round(out.metrics["cov_frac"].item() * n_active) == max(1, int(n_active * 0.25))


def test_seq_ratio_product_is_the_geometric_mean_to_the_power_n():
    """One active token per sequence: product and geo_mean coincide; longer ones differ."""
    batch = make_batch(4, 6, seed=15, empty_row=False)
    one = dict(batch, mask=torch.zeros_like(batch["mask"]))
    one["mask"][:, 2] = True
    for loss_type in ("gspo", "gspo_token", "vespo"):
        geo = library(rk.PolicyLossConfig(loss_type=loss_type, seq_ratio="geo_mean", clip_low=0.3), one)
        prod = library(rk.PolicyLossConfig(loss_type=loss_type, seq_ratio="product", clip_low=0.3), one)
        assert_close(geo.loss, prod.loss)
        geo = library(rk.PolicyLossConfig(loss_type=loss_type, seq_ratio="geo_mean", clip_low=0.3), batch)
        prod = library(rk.PolicyLossConfig(loss_type=loss_type, seq_ratio="product", clip_low=0.3), batch)
        assert not torch.allclose(geo.loss, prod.loss)


def test_seq_ratio_default_is_each_loss_types_own_convention():
    batch = make_batch(4, 6, seed=16)
    for loss_type, own in (("gspo", "geo_mean"), ("gspo_token", "geo_mean"), ("vespo", "product")):
        default = library(rk.PolicyLossConfig(loss_type=loss_type), batch).loss
        explicit = library(rk.PolicyLossConfig(loss_type=loss_type, seq_ratio=own), batch).loss
        assert torch.equal(default, explicit)


def test_metrics_of_the_new_types():
    batch = make_batch(5, 7, seed=18)
    keys = {
        "clip_frac_low",
        "clip_frac_high",
        "clip_frac",
        "approx_kl",
        "ratio_mean",
        "ratio_min",
        "ratio_max",
    }
    for name in NAMES:
        out = library(cfg_of(name), batch)
        assert keys <= set(out.metrics), name
        assert all(v.dim() == 0 and not v.requires_grad for v in out.metrics.values())
    assert "vespo_phi_mean" in library(cfg_of("vespo"), batch).metrics
    # dppo: the clip fractions are the tokens outside the trust region, by sign(A).
    out = library(cfg_of("dppo_tv"), batch)
    assert_close(out.metrics["clip_frac"], out.metrics["clip_frac_low"] + out.metrics["clip_frac_high"])


# ------------------------------------------------------------------------------------ fused path


@pytest.mark.parametrize("name", NAMES)
def test_new_types_are_not_eligible_for_the_token_level_plan(name):
    cfg = cfg_of(name)
    assert not tl_mod.is_eligible(cfg)
    batch = make_batch(2, 3, dtype=torch.float32)
    with pytest.raises(ValueError, match="no token-level plan"):
        tl_mod.build_plan(
            cfg,
            token_ids=torch.zeros(2, 3, dtype=torch.long),
            old_logp=batch["old_logp"],
            advantages=batch["advantages"],
            mask=batch["mask"],
        )


@pytest.mark.parametrize("name", NAMES)
def test_exact_zero_advantages_match_formula(name):
    # A = 0 picks a branch: vespo's (k, λ) of A ≥ 0, dppo's trust region of A ≤ 0 (verl's).
    batch = make_batch(4, 6, seed=12, per_token_adv=True)
    batch["advantages"][:, ::2] = 0.0
    batch["advantages"][3] = 0.0
    check(cfg_of(name, aggregation="seq-mean-token-mean"), batch)


@pytest.mark.parametrize("loss_type", ["dppo_tv", "dppo_kl"])
def test_dppo_clip_fractions_follow_the_formula(loss_type):
    """clip_frac_high: tokens with A > 0 outside the region; clip_frac_low: A ≤ 0 ones (verl puts
    A = 0 on the negative side)."""
    from .formulas import sequences_from_padded
    from .formulas_more import dppo_valid

    batch = make_batch(5, 7, seed=19, per_token_adv=True)
    batch["advantages"][:, ::3] = 0.0
    cfg = cfg_of(loss_type, clip_low=0.005, clip_high=0.01) if loss_type == "dppo_kl" else cfg_of(loss_type)
    out = library(cfg, batch)
    seqs = sequences_from_padded(
        batch["mask"], logp=batch["logp"].detach(), old=batch["old_logp"], adv=batch["advantages"]
    )
    low = high = n = 0
    for s in seqs:
        for t in range(s["mask"].shape[0]):
            if not s["mask"][t]:
                continue
            n += 1
            if not dppo_valid(cfg, s["logp"][t], s["old"][t], s["adv"][t]):
                high, low = (high + 1, low) if s["adv"][t] > 0 else (high, low + 1)
    assert low > 0 and high > 0
    assert_close(out.metrics["clip_frac_low"], torch.tensor(low / n, dtype=torch.float64))
    assert_close(out.metrics["clip_frac_high"], torch.tensor(high / n, dtype=torch.float64))


@pytest.mark.filterwarnings("ignore")  # dynamo's notes on the graph breaks of clip_cov / kl_cov
@pytest.mark.parametrize("name", ["vespo", "dppo_kl", "dro", "kl_cov"])  # compiling costs seconds each
def test_under_torch_compile(name):
    """Traced by torch.compile: in one graph (fullgraph) where the loss needs no host value; with
    graph breaks at the host reads of the covariance selections (clip_cov, kl_cov)."""
    cfg = cfg_of(name, kl_coef=0.1, kl_ratio_weighted=name == "dro")
    batch = make_batch(4, 6, seed=21)
    fullgraph = name not in ("clip_cov", "kl_cov")
    torch._dynamo.reset()  # each config compiles afresh (no cached graph from another test)

    def loss_of(logp):
        return rk.policy_loss(
            logp, batch["old_logp"], batch["advantages"], batch["mask"], cfg, ref_logp=batch["ref_logp"]
        ).loss

    compiled = torch.compile(loss_of, backend="aot_eager", fullgraph=fullgraph)
    torch.manual_seed(SEED)
    got = compiled(batch["logp"])
    torch.manual_seed(SEED)
    want = loss_of(batch["logp"])
    assert_close(got, want)
    assert_close(torch.autograd.grad(got, batch["logp"])[0], torch.autograd.grad(want, batch["logp"])[0])
