"""PolicyLossConfig: presets, overrides, immutability and field validation."""

import dataclasses

import pytest
import torch

import rlkernel as rk
from rlkernel.rl.config import PRESETS

from .helpers import make_batch, oracle, run

# preset -> the values the module docstring's table promises.
EXPECTED = {
    "ppo": dict(
        loss_type="ppo", clip_low=0.2, clip_high=0.2, dual_clip=3.0, aggregation="token-mean", kl_coef=0.0
    ),
    "grpo": dict(
        loss_type="ppo",
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=None,
        aggregation="seq-mean-token-mean",
        kl_coef=0.001,
        kl_estimator="k3",
    ),
    "dapo": dict(loss_type="ppo", clip_low=0.2, clip_high=0.28, dual_clip=10.0, aggregation="token-mean"),
    "dr_grpo": dict(loss_type="ppo", clip_low=0.2, clip_high=0.2, aggregation="seq-mean-token-sum-norm"),
    "gspo": dict(loss_type="gspo", clip_low=3e-4, clip_high=4e-4, aggregation="seq-mean-token-mean"),
    "luspo": dict(loss_type="gspo", clip_low=3e-4, clip_high=4e-4, aggregation="seq-mean-token-sum"),
    "cispo": dict(loss_type="cispo", clip_low=None, clip_high=4.0, aggregation="token-mean"),
    "sapo": dict(loss_type="sapo", aggregation="seq-mean-token-mean", sapo_tau_pos=1.0, sapo_tau_neg=1.05),
    "gmpo": dict(loss_type="gmpo", clip_low=0.4, clip_high=0.4, aggregation="seq-mean-token-mean"),
}


def test_every_preset_is_listed():
    assert (
        set(PRESETS)
        == set(EXPECTED)
        == {"ppo", "grpo", "dapo", "dr_grpo", "gspo", "luspo", "cispo", "sapo", "gmpo"}
    )


@pytest.mark.parametrize("name", list(EXPECTED))
def test_preset_values_and_loss(name):
    cfg = rk.PolicyLossConfig.preset(name)
    for field, value in EXPECTED[name].items():
        assert getattr(cfg, field) == value, field
    assert cfg.entropy_coef == 0.0 and cfg.rollout_correction is None
    batch = make_batch(4, 6, seed=2)
    out = run(cfg, batch)
    torch.testing.assert_close(out.loss, oracle(cfg, batch), atol=1e-10, rtol=1e-9)


def test_preset_overrides_and_immutability():
    cfg = rk.PolicyLossConfig.preset("dapo", kl_coef=0.01, aggregation="seq-mean-token-mean")
    assert (cfg.clip_high, cfg.kl_coef, cfg.aggregation) == (0.28, 0.01, "seq-mean-token-mean")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.clip_low = 0.1
    assert dataclasses.replace(cfg, clip_low=0.1).clip_low == 0.1
    assert rk.PolicyLossConfig.preset("ppo") == rk.PolicyLossConfig.preset("ppo")


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match=r"preset name must be one of .*'dapo'.*got 'dpo'"):
        rk.PolicyLossConfig.preset("dpo")
    with pytest.raises(TypeError, match="unknown PolicyLossConfig field.*clip_ratio"):
        rk.PolicyLossConfig.preset("ppo", clip_ratio=0.2)
    with pytest.raises(ValueError, match="clip_high"):
        rk.PolicyLossConfig.preset("ppo", clip_high=-0.1)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(loss_type="grpo"), ValueError, "loss_type must be one of"),
        (dict(aggregation="mean"), ValueError, "aggregation must be one of"),
        (dict(clip_low=-0.1), ValueError, "clip_low"),
        (dict(clip_low="0.2"), TypeError, "clip_low"),
        (dict(clip_low=None), ValueError, "clip_low=None .* only valid for loss_type='cispo'"),
        (dict(clip_high=None), TypeError, "clip_high"),
        (dict(clip_high=float("inf")), ValueError, "clip_high"),
        (dict(dual_clip=1.0), ValueError, "dual_clip must be > 1"),
        (dict(dual_clip=True), TypeError, "dual_clip"),
        (dict(loss_type="gspo", dual_clip=3.0), ValueError, "dual_clip applies to loss_type='ppo' only"),
        (dict(delta=0.5), ValueError, "delta must be > 1"),
        (dict(loss_type="cispo", delta=2.0), ValueError, "delta applies to loss_type='ppo' only"),
        (dict(norm_length=0), ValueError, "norm_length"),
        (dict(norm_length=4.0), TypeError, "norm_length"),
        (dict(kl_coef=-1.0), ValueError, "kl_coef"),
        (dict(kl_estimator="k4"), ValueError, "kl_estimator must be one of"),
        (dict(entropy_coef=float("nan")), ValueError, "entropy_coef"),
        (dict(entropy_coef="0.1"), TypeError, "entropy_coef"),
        (dict(rollout_correction="tis"), ValueError, "rollout_correction must be one of"),
        (dict(rollout_clip_min=0.0), ValueError, "rollout_clip_min"),
        (dict(rollout_clip_max=-2.0), ValueError, "rollout_clip_max"),
        (
            dict(rollout_clip_min=3.0, rollout_clip_max=2.0),
            ValueError,
            "rollout_clip_min .* <= rollout_clip_max",
        ),
        (dict(rollout_correction="seq_mis", rollout_clip_max=None), ValueError, "needs rollout_clip_min or"),
        (dict(sapo_tau_pos=0.0), ValueError, "sapo_tau_pos"),
        (dict(sapo_tau_neg=-1.0), ValueError, "sapo_tau_neg"),
    ],
)
def test_field_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        rk.PolicyLossConfig(**kwargs)


def test_valid_corner_values():
    rk.PolicyLossConfig(loss_type="cispo", clip_low=None)
    rk.PolicyLossConfig(kl_estimator="low_var_kl+", entropy_coef=-0.01, clip_low=0, clip_high=1)
    rk.PolicyLossConfig(rollout_correction="token_tis", rollout_clip_min=0.5, rollout_clip_max=None)
