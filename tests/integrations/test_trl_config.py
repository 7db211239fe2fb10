"""``policy_config_from_trl`` / ``plan_from_trl``: TRL 1.16's ``GRPOConfig`` → ``PolicyLossConfig``, the
settings that raise at construction, and the version pin.

The expected configs are written out here from TRL's ``_compute_loss`` (one row per ``loss_type`` ×
``importance_sampling_level``); the numbers they give are compared with TRL's in test_trl_loss.py.
"""

from __future__ import annotations

import pytest
import torch

from rlkernel import PolicyLossConfig

from .trl_helpers import (
    grpo_args,
    require_trl,
)


@pytest.fixture(scope="module")
def args_for(tmp_path_factory):
    require_trl()
    out = str(tmp_path_factory.mktemp("out"))
    return lambda **overrides: grpo_args(out, **overrides)


# (GRPOConfig overrides, the PolicyLossConfig fields they map onto, the normalizer rule)
MAPPINGS = [
    (dict(), dict(loss_type="ppo", clip_low=0.2, clip_high=0.2, aggregation="token-mean"), "step_tokens"),
    (
        dict(loss_type="grpo", epsilon=0.1, epsilon_high=0.3),
        dict(loss_type="ppo", clip_low=0.1, clip_high=0.3, aggregation="seq-mean-token-mean"),
        "sequences",
    ),
    (dict(loss_type="bnpo"), dict(loss_type="ppo", aggregation="token-mean"), "local_tokens"),
    (
        dict(loss_type="dr_grpo", max_completion_length=64),
        dict(loss_type="ppo", aggregation="seq-mean-token-sum-norm", norm_length=64),
        "sequences",
    ),
    (dict(loss_type="luspo"), dict(loss_type="ppo", aggregation="seq-mean-token-sum"), "sequences"),
    (dict(delta=1.6), dict(loss_type="ppo", delta=1.6, aggregation="token-mean"), "step_tokens"),
    (
        dict(loss_type="cispo", epsilon_high=5.0),
        dict(loss_type="cispo", clip_low=None, clip_high=4.0, aggregation="token-mean"),
        "step_tokens",
    ),
    (
        dict(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0),
        dict(loss_type="sapo", sapo_tau_pos=0.5, sapo_tau_neg=2.0, aggregation="seq-mean-token-mean"),
        "sequences",
    ),
    (
        dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
        dict(loss_type="gspo", clip_low=3e-4, clip_high=4e-4, aggregation="seq-mean-token-mean"),
        "sequences",
    ),
    (
        dict(loss_type="luspo", importance_sampling_level="sequence"),
        dict(loss_type="gspo", aggregation="seq-mean-token-sum"),
        "sequences",
    ),
    (
        dict(importance_sampling_level="sequence"),
        dict(loss_type="gspo", aggregation="token-mean"),
        "step_tokens",
    ),
    (
        dict(beta=0.04, use_bias_correction_kl=False),
        dict(loss_type="ppo", aggregation="token-mean", kl_coef=0.04, kl_estimator="k3_unclamped"),
        "step_tokens",
    ),
    # The vLLM importance-sampling correction, on only with use_vllm.
    (
        dict(use_vllm=True),
        dict(loss_type="ppo", aggregation="token-mean", rollout_correction="seq_mis", rollout_clip_max=3.0),
        "step_tokens",
    ),
    (
        dict(
            use_vllm=True,
            vllm_importance_sampling_mode="token_truncate",
            vllm_importance_sampling_clip_min=0.5,
        ),
        dict(
            loss_type="ppo",
            aggregation="token-mean",
            rollout_correction="token_tis",
            rollout_clip_min=0.5,
            rollout_clip_max=3.0,
        ),  # fmt: skip
        "step_tokens",
    ),
    (
        dict(
            use_vllm=True,
            vllm_importance_sampling_mode="token_mask",
            vllm_importance_sampling_clip_max=None,
            vllm_importance_sampling_clip_min=0.2,
        ),  # fmt: skip
        dict(
            loss_type="ppo",
            aggregation="token-mean",
            rollout_correction="token_mis",
            rollout_clip_min=0.2,
            rollout_clip_max=None,
        ),  # fmt: skip
        "step_tokens",
    ),
    (
        dict(
            use_vllm=True,
            vllm_importance_sampling_mode="sequence_truncate",
            vllm_importance_sampling_clip_min=-1.0,
        ),
        dict(loss_type="ppo", aggregation="token-mean", rollout_correction="seq_tis", rollout_clip_max=3.0),
        "step_tokens",
    ),
    (
        dict(use_vllm=True, vllm_importance_sampling_correction=False),
        dict(aggregation="token-mean"),
        "step_tokens",
    ),
    # use_bias_correction_kl (TRL's default True) is the ratio-weighted KL.
    (
        dict(beta=0.04),
        dict(
            loss_type="ppo", aggregation="token-mean", kl_coef=0.04, kl_estimator="k3_unclamped",
            kl_ratio_weighted=True,
        ),
        "step_tokens",
    ),
    (
        dict(loss_type="vespo"),
        dict(loss_type="vespo", aggregation="token-mean", vespo_k_pos=2.0, vespo_lambda_pos=3.0,
             vespo_k_neg=3.0, vespo_lambda_neg=2.0),
        "step_tokens",
    ),  # fmt: skip
    (
        dict(loss_type="vespo", vespo_k_pos=0.5, vespo_lambda_neg=0.0, use_vllm=True),
        dict(loss_type="vespo", aggregation="token-mean", vespo_k_pos=0.5, vespo_lambda_neg=0.0,
             rollout_correction="seq_mis", rollout_clip_max=3.0),
        "step_tokens",
    ),  # fmt: skip
    (
        dict(loss_type="grpo", off_policy_mask_threshold=0.3, top_entropy_quantile=0.2),
        dict(aggregation="seq-mean-token-mean", off_policy_mask_threshold=0.3, top_entropy_quantile=0.2),
        "sequences",
    ),
]


@pytest.mark.parametrize("overrides, fields, normalizer", MAPPINGS, ids=[str(m[0]) for m in MAPPINGS])
def test_mapping(args_for, overrides, fields, normalizer):
    from rlkernel.integrations.trl import plan_from_trl, policy_config_from_trl

    args = args_for(**overrides)
    assert policy_config_from_trl(args) == PolicyLossConfig(**fields)
    plan = plan_from_trl(args)
    assert plan.config == PolicyLossConfig(**fields)
    assert plan.normalizer == normalizer
    assert plan.rollout_correction == ("rollout_correction" in fields)
    assert not plan.entropy_bonus


@pytest.mark.parametrize("overrides", [dict(entropy_coef=0.01), dict(use_adaptive_entropy=True)])
def test_entropy_bonus_is_the_trainers_not_the_configs(args_for, overrides):
    """TRL's bonus is a token mean whatever the loss type's normalizer: no PolicyLossConfig field has
    that form, so policy_config_from_trl refuses it and the plan leaves it to the trainer."""
    from rlkernel.integrations.trl import plan_from_trl, policy_config_from_trl

    args = args_for(**overrides)
    with pytest.raises(ValueError, match="entropy_coef"):
        policy_config_from_trl(args)
    plan = plan_from_trl(args)
    assert plan.entropy_bonus and plan.config.entropy_coef == 0


def test_step_normalizers():
    """TRL's divisors (trl/trainer/grpo_trainer.py, _compute_loss), per rule, in training and eval."""
    from rlkernel.integrations.trl.config import TRLLossPlan, step_normalizers

    def plan(rule):
        return TRLLossPlan(
            config=PolicyLossConfig(), normalizer=rule, entropy_bonus=False, rollout_correction=False
        )

    common = dict(
        batch_size=4, local_tokens=torch.tensor(9), num_items_in_batch=torch.tensor(50), accumulation_steps=3,
        num_processes=2, steps_per_generation=6,
    )  # fmt: skip
    assert step_normalizers(plan("sequences"), training=True, **common) == {"global_seqs": 12}
    assert step_normalizers(plan("sequences"), training=False, **common) == {"global_seqs": 4}
    assert step_normalizers(plan("local_tokens"), training=True, **common)["global_tokens"].item() == 27
    assert step_normalizers(plan("local_tokens"), training=False, **common)["global_tokens"].item() == 9
    # dapo / cispo: num_items_in_batch / processes · accumulation / steps_per_generation
    assert step_normalizers(plan("step_tokens"), training=True, **common)["global_tokens"].item() == 12.5
    assert step_normalizers(plan("step_tokens"), training=False, **common)["global_tokens"].item() == 25
    empty = {**common, "local_tokens": torch.tensor(0), "num_items_in_batch": torch.tensor(0)}
    assert step_normalizers(plan("local_tokens"), training=False, **empty)["global_tokens"].item() == 1
    assert step_normalizers(plan("step_tokens"), training=False, **empty)["global_tokens"].item() == 0.5
