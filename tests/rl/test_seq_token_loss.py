"""Closed-form sequence-ratio coefficients (``rlkernel.rl.seq_token_loss``) against ``policy_loss``.

``seq_terms`` must give ``policy_loss``'s loss and, as coefficients, its autograd gradients
dL/dlogp and dL/dentropy for gspo, gspo_token and gmpo: every aggregation (with and without global
normalizers), both sequence-ratio conventions, KL estimators, entropy, rollout corrections, given
rollout weights, rollout rejection, on-policy calls, per-token advantages, padded and packed, the
log-ratio clamp at 10, non-finite inputs and all-masked batches. The reference is ``policy_loss`` in
float64 under autograd (an independent code path: the ``[B, T]`` algebra of
:mod:`rlkernel.rl.objectives`, itself tested against float64 formulas).
"""

import itertools

import pytest
import torch

import rlkernel as rk
from rlkernel.rl import seq_token_loss as seq_mod
from rlkernel.rl.batch import validate_batch
from rlkernel.rl.token_loss import masked_token_ids

from .helpers import AGGREGATIONS, LOSS_CONFIGS, add_garbage, config, make_batch, pack

F32, F64 = torch.float32, torch.float64
TOL = dict(atol=3e-6, rtol=3e-5)
SEQ_TYPES = ("gspo", "gspo_token", "gmpo")
CORRECTIONS = ("token_tis", "seq_tis", "token_mis", "seq_mis")


BACKEND = ["reference"]  # set per test by the autouse fixture below
# The Triton backend runs on the GPU when there is one, else in the interpreter on the CPU.
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _dev(x):
    """``x`` on the device of the backend under test (tensors only)."""
    if isinstance(x, torch.Tensor) and BACKEND[0] == "triton":
        return x.to(KERNEL_DEVICE)
    return x


@pytest.fixture(autouse=True, params=["reference", "triton"])
def backend(request):
    """Every test twice: the torch closed form (reference backend) and the Triton kernel (under
    the interpreter on the CPU)."""
    BACKEND[0] = request.param
    yield request.param
    BACKEND[0] = "reference"


def _ids(mask, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, mask.shape, generator=g)


def _check(cfg, batch, *, cu=None, on_policy=False, rollout_weights=None, **norms):
    """seq_terms (fp32) == policy_loss (fp64, autograd): loss, dL/dlogp and dL/dentropy."""
    want_entropy = cfg.entropy_coef != 0
    old = None if on_policy else batch["old_logp"]
    kw = dict(ref_logp=batch["ref_logp"], rollout_logp=batch["rollout_logp"], cu_seqlens=cu, **norms)
    if rollout_weights is not None:
        kw["rollout_weights"] = rollout_weights
    logp64 = batch["logp"].detach().to(F64).requires_grad_(True)
    ent64 = batch["entropy"].detach().to(F64).requires_grad_(True)
    cast = {k: (v.detach().to(F64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in kw.items()}  # fmt: skip
    old64 = None if old is None else old.detach().to(F64)
    adv64 = batch["advantages"].detach().to(F64)
    want = rk.policy_loss(logp64, old64, adv64, batch["mask"], cfg,
                          entropy=ent64 if want_entropy else None, **cast)  # fmt: skip
    inputs = [logp64, ent64] if want_entropy else [logp64]
    want_grads = torch.autograd.grad(want.loss, inputs, allow_unused=True, materialize_grads=True)

    ids = _dev(_ids(batch["mask"]))
    to32 = {k: _dev(v.detach().to(F32) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in kw.items()}  # fmt: skip
    lb = validate_batch(cfg, ids, old_logp=None if old is None else _dev(old.detach().to(F32)),
                        advantages=_dev(batch["advantages"].detach().to(F32)), mask=_dev(batch["mask"]),
                        like_name="token_ids", **to32)  # fmt: skip
    assert seq_mod.is_eligible(cfg, on_policy=on_policy, has_rollout_weights=rollout_weights is not None)
    with rk.use_backend(BACKEND[0]):
        terms = seq_mod.seq_terms(
            lb,
            masked_token_ids(ids, lb.mask),
            _dev(batch["logp"].detach().to(F32)),
            _dev(batch["entropy"].detach().to(F32)) if want_entropy else None,
        )
    parts = (terms.loss, terms.g_logp, terms.g_entropy)
    terms = type(terms)(*(None if t is None else t.cpu() for t in parts))
    torch.testing.assert_close(terms.loss, want.loss.to(F32), **TOL, equal_nan=True)
    torch.testing.assert_close(terms.g_logp, want_grads[0].reshape(-1).to(F32), **TOL, equal_nan=True)
    if want_entropy:
        torch.testing.assert_close(terms.g_entropy, want_grads[1].reshape(-1).to(F32), **TOL, equal_nan=True)
    else:
        assert terms.g_entropy is None
    return terms


@pytest.mark.parametrize(
    ("name", "aggregation"), list(itertools.product(SEQ_TYPES, (*AGGREGATIONS, "token-sum")))
)
def test_matches_policy_loss(name, aggregation):
    cfg = config(name, aggregation=aggregation, kl_coef=0.1, entropy_coef=0.03)
    _check(cfg, make_batch(4, 7, seed=len(name) + len(aggregation), dtype=F32))


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
@pytest.mark.parametrize("convention", ["geo_mean", "product"])
def test_sequence_ratio_conventions(name, convention):
    cfg = config(name, seq_ratio=convention, clip_low=0.5, clip_high=0.6)
    batch = make_batch(4, 6, seed=7, dtype=F32)
    with torch.no_grad():  # small drifts, so that the product convention stays inside the clamps
        batch["old_logp"].copy_(
            batch["logp"] + 0.05 * torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
        )
    _check(cfg, batch)


@pytest.mark.parametrize("name", SEQ_TYPES)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_global_normalizers(name, aggregation):
    cfg = config(name, aggregation=aggregation, norm_length=9)
    batch = make_batch(3, 5, seed=11, dtype=F32)
    _check(cfg, batch, global_tokens=23.0, global_seqs=torch.tensor(7))
    _check(cfg, batch, global_tokens=torch.tensor(17.5), global_seqs=4)


@pytest.mark.parametrize("name", SEQ_TYPES)
def test_zero_global_normalizer_with_active_tokens_gives_nan(name):
    """A (device) normalizer of 0 with active tokens: the loss is NaN, as policy_loss's, and so is
    the coefficients of the active tokens that have a slope (policy_loss's autograd gives 0 at some
    of them, a clipped branch times an infinite upstream gradient: the gradients are not compared)."""
    batch = make_batch(3, 5, seed=12, dtype=F32)
    ids = _dev(_ids(batch["mask"]))
    lb = validate_batch(config(name), ids, old_logp=_dev(batch["old_logp"].detach()),
                        mask=_dev(batch["mask"]),
                        advantages=_dev(batch["advantages"]), global_tokens=_dev(torch.tensor(0.0)),
                        like_name="token_ids")  # fmt: skip
    with rk.use_backend(BACKEND[0]):
        terms = seq_mod.seq_terms(lb, masked_token_ids(ids, lb.mask), _dev(batch["logp"].detach()), None)
    terms = type(terms)(terms.loss.cpu(), terms.g_logp.cpu(), None)
    want = rk.policy_loss(batch["logp"], batch["old_logp"], batch["advantages"], batch["mask"], config(name),
                          global_tokens=torch.tensor(0.0))  # fmt: skip
    assert torch.isnan(terms.loss) and torch.isnan(want.loss)
    active = batch["mask"].reshape(-1)
    assert torch.isnan(terms.g_logp[active]).any() and (terms.g_logp[~active] == 0).all()


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs", "k3+", "k3_unclamped"])
@pytest.mark.parametrize("name", SEQ_TYPES)
def test_kl_estimators(name, estimator):
    _check(config(name, kl_coef=0.2, kl_estimator=estimator), make_batch(4, 6, seed=3, dtype=F32))


@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_rollout_corrections(name, correction):
    cfg = config(name, rollout_correction=correction, rollout_clip_min=0.8, rollout_clip_max=1.2, kl_coef=0.1)
    _check(cfg, make_batch(4, 6, seed=4, dtype=F32))


@pytest.mark.parametrize("correction", ["token_tis", "seq_mis"])
@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_rollout_batch_normalize(name, correction):
    cfg = config(name, rollout_correction=correction, rollout_clip_max=1.5, rollout_batch_normalize=True)
    _check(cfg, make_batch(4, 6, seed=18, dtype=F32))


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_given_rollout_weights(name):
    batch = make_batch(4, 6, seed=5, dtype=F32)
    weights = torch.rand(4, 6, generator=torch.Generator().manual_seed(2)) * 1.5 + 0.1
    _check(config(name), batch, rollout_weights=weights)


@pytest.mark.parametrize("name", SEQ_TYPES)
def test_rollout_rejection(name):
    cfg = config(name, rollout_rs="token_k1", rollout_rs_min=0.75, rollout_rs_max=1.3, entropy_coef=0.02)
    _check(cfg, make_batch(5, 6, seed=6, dtype=F32))


@pytest.mark.parametrize("name", SEQ_TYPES)
def test_on_policy(name):
    _check(config(name, kl_coef=0.1), make_batch(4, 6, seed=8, dtype=F32), on_policy=True)


@pytest.mark.parametrize("name", SEQ_TYPES)
@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_packed(name, per_token_adv, aggregation):
    cfg = config(name, aggregation=aggregation, kl_coef=0.1, entropy_coef=0.02)
    batch = make_batch(3, 6, seed=9, dtype=F32, per_token_adv=per_token_adv)
    packed, cu, _ = pack(batch, [6, 2, 4])
    _check(cfg, packed, cu=cu)


@pytest.mark.parametrize("name", SEQ_TYPES)
def test_per_token_advantages(name):
    _check(config(name, kl_coef=0.05), make_batch(4, 6, seed=10, dtype=F32, per_token_adv=True))


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_log_ratio_clamp_at_10_cuts_the_gradient(name):
    """log s_i > 10 (s clamped at e^10): no gradient through the ratio for that sequence."""
    cfg = config(name, clip_low=0.2, clip_high=1e6)  # no clip at e^10, so the clamp decides
    batch = make_batch(3, 5, seed=13, dtype=F32, empty_row=False)
    with torch.no_grad():
        batch["old_logp"][0] = batch["logp"][0] - 12.0
        batch["advantages"][0] = 1.0
    terms = _check(cfg, batch)
    row0 = terms.g_logp.reshape(3, 5)[0]
    assert torch.count_nonzero(row0) == 0


def test_ratio_inside_the_clip_interval_has_the_full_slope():
    """Inside the clip interval both branches of the max tie: the halves sum to −A·s per sequence."""
    cfg = config("gspo", clip_low=0.9, clip_high=9.0, aggregation="seq-mean-token-mean")
    batch = make_batch(3, 4, seed=14, dtype=F32, empty_row=False)
    terms = _check(cfg, batch)
    assert torch.count_nonzero(terms.g_logp) == int(batch["mask"].sum())


@pytest.mark.parametrize("name", SEQ_TYPES)
def test_garbage_at_masked_positions_is_ignored(name):
    cfg = config(name, kl_coef=0.1, entropy_coef=0.05)
    batch = add_garbage(make_batch(4, 6, seed=15, dtype=F32, per_token_adv=True))
    terms = _check(cfg, batch)
    assert torch.isfinite(terms.loss) and torch.isfinite(terms.g_logp).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("name", SEQ_TYPES)
def test_nonfinite_active_input_gives_nan(name, bad):
    batch = make_batch(3, 5, seed=16, dtype=F32, empty_row=False)
    with torch.no_grad():
        batch["old_logp"][0, 0] = bad
        batch["mask"][0, 0] = True
    terms = _check(config(name), batch)
    assert torch.isnan(terms.loss)


@pytest.mark.parametrize("name", SEQ_TYPES)
def test_all_masked_batch_gives_zero(name):
    batch = make_batch(3, 4, seed=17, dtype=F32)
    batch["mask"] = torch.zeros_like(batch["mask"])
    terms = _check(config(name, kl_coef=0.1, entropy_coef=0.1), batch, global_tokens=torch.tensor(0.0))
    assert terms.loss.item() == 0.0 and torch.count_nonzero(terms.g_logp) == 0


def test_eligibility():
    assert seq_mod.is_eligible(config("gspo"), on_policy=False, has_rollout_weights=False)
    assert not seq_mod.is_eligible(config("ppo"), on_policy=False, has_rollout_weights=False)
    assert not seq_mod.is_eligible(config("gspo", kl_ratio_weighted=True, kl_coef=0.1), on_policy=False,
                                   has_rollout_weights=False)  # fmt: skip
    assert not seq_mod.is_eligible(
        config("gspo", top_entropy_quantile=0.5), on_policy=False, has_rollout_weights=False
    )
    assert not seq_mod.is_eligible(config("gspo", rollout_correction="token_tis"), on_policy=True,
                                   has_rollout_weights=False)  # fmt: skip
    # gmpo folds rollout weights into one per sequence: not in the closed form
    assert not seq_mod.is_eligible(config("gmpo", rollout_correction="token_tis"), on_policy=False,
                                   has_rollout_weights=False)  # fmt: skip
    assert not seq_mod.is_eligible(config("gmpo"), on_policy=False, has_rollout_weights=True)
    assert set(seq_mod.SEQ_LOSS_TYPES) <= set(LOSS_CONFIGS)
