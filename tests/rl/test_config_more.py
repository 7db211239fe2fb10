"""The issue-14 fields of ``PolicyLossConfig``: defaults, valid corners, and every bad value raising
a clear error that names the field."""

import pytest

import rlkernel as rk
from rlkernel.rl.aggregate import AGGREGATIONS
from rlkernel.rl.config import LOSS_TYPES, SEQ_RATIOS


def test_defaults_and_names():
    cfg = rk.PolicyLossConfig()
    assert (cfg.seq_ratio, cfg.kl_ratio_weighted, cfg.dro_beta) == (None, False, None)
    assert (cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg) == (
        2.0,
        3.0,
        3.0,
        2.0,
    )
    assert cfg.dppo_ratio_cap == 20.0
    assert (cfg.clip_cov_ratio, cfg.clip_cov_lb, cfg.clip_cov_ub) == (2e-4, 1.0, 5.0)
    assert (cfg.kl_cov_ratio, cfg.kl_cov_coef) == (2e-4, 0.1)
    assert {"vespo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov", "dro"} <= set(LOSS_TYPES)
    assert "token-sum" in AGGREGATIONS and SEQ_RATIOS == ("geo_mean", "product")


def test_valid_corner_values():
    rk.PolicyLossConfig(loss_type="dro", dro_beta=1e-30)
    rk.PolicyLossConfig(loss_type="vespo", vespo_k_pos=0, vespo_lambda_neg=0.0, seq_ratio="geo_mean")
    rk.PolicyLossConfig(loss_type="gspo_token", seq_ratio="product", kl_ratio_weighted=True)
    rk.PolicyLossConfig(loss_type="dppo_kl", dppo_ratio_cap=None, clip_low=0.0)
    rk.PolicyLossConfig(loss_type="clip_cov", clip_cov_ratio=1.0, clip_cov_lb=-3.0, clip_cov_ub=-2.9)
    rk.PolicyLossConfig(loss_type="kl_cov", kl_cov_ratio=1, kl_cov_coef=0)
    rk.PolicyLossConfig(aggregation="token-sum", kl_ratio_weighted=True)
    rk.PolicyLossConfig.preset("dapo", aggregation="token-sum")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(seq_ratio="mean"), ValueError, "seq_ratio must be one of"),
        (dict(loss_type="gspo", seq_ratio=1), ValueError, "seq_ratio must be one of"),
        (dict(loss_type="ppo", seq_ratio="product"), ValueError, "seq_ratio applies to loss_type in"),
        (dict(loss_type="gmpo", seq_ratio="geo_mean"), ValueError, "seq_ratio applies to loss_type in"),
        (dict(kl_ratio_weighted=1), TypeError, "kl_ratio_weighted must be a bool"),
        (dict(kl_ratio_weighted="True"), TypeError, "kl_ratio_weighted"),
        (dict(vespo_k_pos=-1.0), ValueError, "vespo_k_pos"),
        (dict(vespo_lambda_pos=float("nan")), ValueError, "vespo_lambda_pos"),
        (dict(vespo_k_neg="2"), TypeError, "vespo_k_neg"),
        (dict(vespo_lambda_neg=float("inf")), ValueError, "vespo_lambda_neg"),
        (dict(vespo_k_pos=1e39), ValueError, "vespo_k_pos must be at most"),
        (dict(vespo_lambda_neg=10**400), ValueError, "vespo_lambda_neg must be a finite number"),
        (dict(dppo_ratio_cap=0.0), ValueError, "dppo_ratio_cap"),
        (dict(dppo_ratio_cap=True), TypeError, "dppo_ratio_cap"),
        (dict(dppo_ratio_cap=1e-40), ValueError, "dppo_ratio_cap must be at least"),
        (dict(clip_cov_ratio=0.0), ValueError, "clip_cov_ratio"),
        (dict(clip_cov_ratio=1.5), ValueError, r"clip_cov_ratio is a fraction .* \(0, 1\]"),
        (dict(clip_cov_ratio=None), TypeError, "clip_cov_ratio"),
        (dict(clip_cov_ratio=1e-40), ValueError, "clip_cov_ratio must be at least"),
        (dict(kl_cov_ratio=-0.1), ValueError, "kl_cov_ratio"),
        (dict(kl_cov_ratio=2), ValueError, "kl_cov_ratio is a fraction"),
        (dict(clip_cov_lb=float("-inf")), ValueError, "clip_cov_lb"),
        (dict(clip_cov_ub="5"), TypeError, "clip_cov_ub"),
        (dict(clip_cov_lb=5.0, clip_cov_ub=5.0), ValueError, r"clip_cov_lb \(5.0\) must be < clip_cov_ub"),
        (dict(clip_cov_lb=-1e39, clip_cov_ub=0.0), ValueError, "clip_cov_lb must be at most"),
        (dict(kl_cov_coef=-0.5), ValueError, "kl_cov_coef"),
        (dict(loss_type="dro"), ValueError, "loss_type='dro' requires dro_beta"),
        (dict(loss_type="dro", dro_beta=0.0), ValueError, "dro_beta"),
        (dict(loss_type="dro", dro_beta=-1.0), ValueError, "dro_beta"),
        (dict(loss_type="dro", dro_beta="0.1"), TypeError, "dro_beta"),
        (dict(loss_type="dro", dro_beta=1e39), ValueError, "dro_beta must be at most"),
        (dict(loss_type="ppo", dro_beta=0.1), ValueError, "dro_beta applies to loss_type='dro' only"),
        (dict(loss_type="vespo", dual_clip=3.0), ValueError, "dual_clip applies to loss_type='ppo' only"),
        (dict(loss_type="clip_cov", delta=2.0), ValueError, "delta applies to loss_type='ppo' only"),
        (dict(loss_type="dppo_tv", clip_low=None), ValueError, "clip_low=None"),
        (dict(aggregation="token_sum"), ValueError, "aggregation must be one of"),
    ],
)
def test_field_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        rk.PolicyLossConfig(**kwargs)


def test_preset_overrides_are_validated_too():
    with pytest.raises(ValueError, match="seq_ratio applies"):
        rk.PolicyLossConfig.preset("dapo", seq_ratio="product")
    cfg = rk.PolicyLossConfig.preset("gspo", seq_ratio="product", kl_ratio_weighted=True)
    assert (cfg.seq_ratio, cfg.kl_ratio_weighted) == ("product", True)
