"""The issue-14 loss algebra against verl 0.9.1's own code: ``compute_policy_loss_<mode>`` of its
``POLICY_LOSS_REGISTRY`` for ``dppo_tv``, ``dppo_kl``, ``clip_cov``, ``kl_cov``, ``dro`` (and ``gspo``
for the sequence-ratio convention), and ``agg_loss`` for ``token-sum``.

verl is installed with ``--no-deps``: ``verl.trainer.ppo.core_algos`` imports ``verl.protocol`` and
its tracking utilities, which import ``ray``, ``tensordict`` and ``orjson`` at the top (none of them is
called by the loss functions). This module stubs whichever of them is not installed for the duration
of the import only, then removes the stubs and every ``verl`` module from ``sys.modules`` again (the
imported functions keep their module globals), so that no other test sees a stub or this import.
The tests skip when verl is not installed, except under ``CI``, where they fail.

Every comparison runs verl's function and ``rlkernel.policy_loss`` on the same fresh random float32
batch (ragged mask with a full and an empty row, per-token advantages of both signs, drifts that
cross every threshold) and checks loss and gradient wrt the log-probs to ≤ 1e-6. ``clip_cov`` draws its
tokens with ``torch.randperm`` on the default CPU generator in both: the generator is seeded alike
before each call, and the selection is then the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
import types
import warnings

import pytest
import torch

import rlkernel as rk

VERL_VERSION = "0.9.1"
# Imported at the top of verl.protocol / verl.utils.tracking, never called by the loss functions.
_STUBBED = ("ray", "tensordict", "orjson")
TOL = dict(atol=1e-6, rtol=1e-6)


class _StubMeta(type):
    """A stub class: any attribute is another stub class, calling one returns a stub (or, used as a
    decorator, the decorated function unchanged), ``X | Y`` works in annotations."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (), {})

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return _StubMeta(cls.__name__, (), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def _stubs_for_the_import():
    missing = [name for name in _STUBBED if importlib.util.find_spec(name) is None]
    finder = _StubFinder(missing)
    before = set(sys.modules)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in set(sys.modules) - before:
            if name.split(".")[0] in (*missing, "verl"):
                del sys.modules[name]


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"{reason}; CI must run the verl comparison")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def verl():
    """(core_algos module, ActorConfig, verl's PolicyLossConfig) from the installed verl 0.9.1."""
    if importlib.util.find_spec("verl") is None:
        _unavailable(f"verl is not installed (pip install --no-deps verl=={VERL_VERSION})")
    version = importlib.metadata.version("verl")
    if version != VERL_VERSION:
        _unavailable(f"verl {version} is installed; these tests compare with {VERL_VERSION}")
    with _stubs_for_the_import(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        core_algos = importlib.import_module("verl.trainer.ppo.core_algos")
        config_mod = importlib.import_module("verl.workers.config")
    return types.SimpleNamespace(
        core=core_algos, ActorConfig=config_mod.ActorConfig, LossConfig=config_mod.PolicyLossConfig
    )


def make_batch(seed: int, B: int = 6, T: int = 9, *, drift: float = 0.5):
    """float32 (log_prob leaf, old, advantages [B, T], mask [B, T] float, rollout); row 0 is full,
    row 1 empty; old log-probs < 0 (probabilities, for dppo's trust region)."""
    g = torch.Generator().manual_seed(seed)
    log_prob = -2.5 * torch.rand(B, T, generator=g) - 0.02
    old = (log_prob + drift * torch.randn(B, T, generator=g)).clamp(max=-1e-3)
    rollout = old + 0.4 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    lengths = torch.randint(1, T, (B,), generator=g)
    lengths[0], lengths[1] = T, 0
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    return log_prob.requires_grad_(True), old, adv, mask, rollout


def actor_config(verl, mode: str, **fields):
    """verl's ActorConfig for ``mode``: policy-loss fields go to its PolicyLossConfig, the others
    (clip ratios, ``global_batch_info``) to the ActorConfig."""
    loss_fields = {k: fields.pop(k) for k in list(fields) if k in verl.LossConfig.__dataclass_fields__}
    return verl.ActorConfig(
        strategy="fsdp",
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        policy_loss=verl.LossConfig(loss_mode=mode, **loss_fields),
        **fields,
    )


def verl_loss(verl, mode, batch, agg, seed=0, rollout_w=None, **fields):
    log_prob, old, adv, mask, _ = batch
    fn = verl.core.get_policy_loss_fn(mode)
    torch.manual_seed(seed)
    loss, metrics = fn(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=agg,
        config=actor_config(verl, mode, **fields),
        rollout_is_weights=rollout_w,
    )
    return loss, metrics


def ours(cfg, batch, seed=0, **kwargs):
    log_prob, old, adv, mask, rollout = batch
    torch.manual_seed(seed)
    return rk.policy_loss(log_prob, old, adv, mask, cfg, rollout_logp=rollout, **kwargs)


def assert_same(verl_out, our_out, batch):
    (g_verl,) = torch.autograd.grad(verl_out, batch[0])
    (g_ours,) = torch.autograd.grad(our_out, batch[0])
    torch.testing.assert_close(our_out, verl_out, **TOL)
    torch.testing.assert_close(g_ours, g_verl, **TOL)


AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl"])
def test_dppo(verl, mode, agg):
    batch = make_batch(seed=len(mode) + AGGS.index(agg))
    lo, hi = (0.04, 0.06) if mode == "dppo_tv" else (0.01, 0.015)
    for cap in (3.0, 1.3):  # ActorConfig's default clip_ratio_c, and one that truncates more ratios
        loss, metrics = verl_loss(
            verl, mode, batch, agg, clip_ratio=0.2, clip_ratio_low=lo, clip_ratio_high=hi, clip_ratio_c=cap
        )
        cfg = rk.PolicyLossConfig(
            loss_type=mode, clip_low=lo, clip_high=hi, dppo_ratio_cap=cap, aggregation=agg
        )
        out = ours(cfg, batch)
        assert_same(loss, out.loss, batch)
        # verl's pg_clipfrac: the fraction of tokens outside the trust region (the test can fail).
        assert 0 < metrics["actor/pg_clipfrac"] < 1
        assert out.metrics["clip_frac"].item() == pytest.approx(metrics["actor/pg_clipfrac"], abs=1e-6)


@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl", "clip_cov", "kl_cov", "dro"])
def test_rollout_weights_and_global_batch_info(verl, mode):
    """verl multiplies ``rollout_is_weights`` into the policy loss (ours: token_tis, max only) and
    normalizes by ``global_batch_info`` × dp_size (ours: global_tokens / global_seqs, × dp_size)."""
    batch = make_batch(seed=31)
    log_prob, old, adv, mask, rollout = batch
    weights = torch.exp(old - rollout).clamp(max=1.5)
    fields = dict(clip_ratio=0.2, clip_ratio_low=0.05, clip_ratio_high=0.07)
    extra = dict(
        dppo_tv=dict(dppo_ratio_cap=3.0),
        dppo_kl=dict(dppo_ratio_cap=3.0),
        clip_cov=dict(clip_cov_ratio=0.2, clip_cov_lb=-0.5, clip_cov_ub=0.8),
        kl_cov=dict(kl_cov_ratio=0.2),
        dro=dict(dro_beta=0.4),
    )[mode]
    verl_fields = {k: v for k, v in extra.items() if k != "dppo_ratio_cap"}
    if mode == "dro":
        verl_fields = dict(dro_beta=0.4)
    info = {"dp_size": 2, "batch_num_tokens": 57, "global_batch_size": 11}
    for agg in ("token-mean", "seq-mean-token-sum"):
        loss, _ = verl_loss(
            verl, mode, batch, agg, seed=5, rollout_w=weights, global_batch_info=info, **fields, **verl_fields
        )
        cfg = rk.PolicyLossConfig(
            loss_type=mode,
            clip_low=0.05 if mode != "dro" else 0.2,
            clip_high=0.07 if mode != "dro" else 0.2,
            aggregation=agg,
            rollout_correction="token_tis",
            rollout_clip_max=1.5,
            **extra,
        )
        out = ours(cfg, batch, seed=5, global_tokens=57, global_seqs=11)
        assert_same(loss, out.loss * 2, batch)


@pytest.mark.parametrize("agg", AGGS)
def test_clip_cov(verl, agg):
    batch = make_batch(seed=7 + AGGS.index(agg), B=8, T=12)
    for seed in range(3):  # three draws: verl and rlkernel cut the same tokens for each
        fields = dict(clip_cov_ratio=0.1, clip_cov_lb=-0.3, clip_cov_ub=0.9)
        loss, metrics = verl_loss(
            verl, "clip_cov", batch, agg, seed=seed, clip_ratio=0.2, clip_ratio_high=0.28, **fields
        )
        cfg = rk.PolicyLossConfig(
            loss_type="clip_cov", clip_low=0.2, clip_high=0.28, aggregation=agg, **fields
        )
        out = ours(cfg, batch, seed=seed)
        assert_same(loss, out.loss, batch)
        assert 0 < metrics["actor/pg_clipfrac"] < 1  # verl's pg_clipfrac is the cut fraction here
        assert out.metrics["cov_frac"].item() == pytest.approx(metrics["actor/pg_clipfrac"], abs=1e-6)


@pytest.mark.parametrize("agg", AGGS)
def test_kl_cov(verl, agg):
    batch = make_batch(seed=11 + AGGS.index(agg), B=8, T=12)
    for ratio, coef in ((0.1, 0.1), (0.3, 1.7)):
        loss, _ = verl_loss(verl, "kl_cov", batch, agg, kl_cov_ratio=ratio, ppo_kl_coef=coef)
        cfg = rk.PolicyLossConfig(loss_type="kl_cov", kl_cov_ratio=ratio, kl_cov_coef=coef, aggregation=agg)
        out = ours(cfg, batch)
        assert_same(loss, out.loss, batch)
        plain = ours(rk.PolicyLossConfig(loss_type="kl_cov", kl_cov_coef=0.0, aggregation=agg), batch)
        assert not torch.allclose(plain.loss, out.loss)  # the penalty is on (the test can fail)


@pytest.mark.parametrize("agg", AGGS)
def test_dro(verl, agg):
    batch = make_batch(seed=13 + AGGS.index(agg))
    loss, _ = verl_loss(verl, "dro", batch, agg, dro_beta=0.7)
    out = ours(rk.PolicyLossConfig(loss_type="dro", dro_beta=0.7, aggregation=agg), batch)
    assert_same(loss, out.loss, batch)


def test_token_sum_is_verls_agg_loss(verl):
    g = torch.Generator().manual_seed(3)
    loss_mat = torch.randn(5, 7, generator=g, dtype=torch.float64)
    _, _, _, mask, _ = make_batch(seed=3, B=5, T=7)
    from rlkernel.rl.aggregate import aggregate

    for dp in (1, 4):  # verl scales every mode by dp_size (DDP averages gradients): ours is × dp_size
        want = verl.core.agg_loss(loss_mat, mask.double(), "token-sum", dp_size=dp)
        got = aggregate(loss_mat, mask.bool(), "token-sum", global_tokens=99, global_seqs=5) * dp
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_gspo_sequence_ratio_is_the_geometric_mean(verl):
    """Item 4's probe of verl: its gspo ratio is exp(Σ m·lr / n) (geo_mean), not the product."""
    batch = make_batch(seed=17, drift=0.05)
    log_prob, old, adv, mask, _ = batch
    seq_adv = adv[:, :1].expand_as(adv).contiguous()  # gspo: one advantage per sequence
    fields = dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.3)
    fn = verl.core.get_policy_loss_fn("gspo")
    batch = (log_prob, old, seq_adv, mask, None)
    for loss_type in ("gspo", "gspo_token"):
        loss, _ = fn(
            old, log_prob, seq_adv, mask, "seq-mean-token-mean", actor_config(verl, "gspo", **fields)
        )
        default = rk.PolicyLossConfig(loss_type=loss_type, clip_high=0.3, aggregation="seq-mean-token-mean")
        geo = ours(default, batch)
        assert_same(loss, geo.loss, batch)
        explicit = dataclasses.replace(default, seq_ratio="geo_mean")
        assert torch.equal(ours(explicit, batch).loss, geo.loss)
        product = dataclasses.replace(default, seq_ratio="product")
        assert not torch.allclose(ours(product, batch).loss, loss.detach(), atol=1e-4)


def test_the_import_leaves_no_stub_and_no_verl_module_behind(verl):
    leftovers = [name for name in sys.modules if name.split(".")[0] in ("verl", *_STUBBED)]
    assert all(not isinstance(sys.modules[name], _StubModule) for name in leftovers)
    assert not [name for name in leftovers if name.split(".")[0] == "verl"]
