"""Bad input to ``rlkernel.integrations.openrlhf.PolicyLoss``: settings are refused at construction
(``TypeError`` / ``ValueError`` naming the OpenRLHF parameter), ``forward`` refuses bad tensors
before any arithmetic. Needs no OpenRLHF (these run wherever rlkernel does)."""

from __future__ import annotations

import math

import pytest
import torch

from rlkernel.integrations.openrlhf import PolicyLoss

COVERED = [PolicyLoss]


@pytest.mark.parametrize(
    "settings, error, match",
    [
        (dict(policy_loss_type="grpo"), ValueError, "policy_loss_type"),
        (dict(policy_loss_type=None), ValueError, "policy_loss_type"),
        (dict(clip_eps_low=-0.1), ValueError, "clip_eps_low"),
        (dict(clip_eps_high=math.nan), ValueError, "clip_eps_high"),
        (dict(clip_eps_high="0.2"), TypeError, "clip_eps_high"),
        (dict(dual_clip=1.0), ValueError, "dual_clip"),
        (dict(dual_clip=True), TypeError, "dual_clip"),
        (dict(token_level_loss="False"), TypeError, "token_level_loss"),
        (dict(is_correction_level="sequence"), ValueError, "is_correction_level"),
        (dict(is_correction_mode="truncate"), ValueError, "is_correction_mode"),
        (dict(is_correction_gating="kl"), ValueError, "is_correction_gating"),
        (dict(is_correction_level="seq", is_correction_mode="clip"), ValueError, "is_correction_mode"),
        (
            dict(is_correction_level="token", is_correction_mode="clip", is_correction_gating="tv"),
            ValueError,
            "clip",
        ),
        (dict(is_correction_level="token", is_correction_gating="tv"), ValueError, "upper bound only"),
        (
            dict(is_correction_level="token", is_correction_threshold=5.0),
            ValueError,
            "is_correction_threshold",
        ),
        (
            dict(is_correction_level="token", is_correction_threshold=(0.5,)),
            ValueError,
            "is_correction_threshold",
        ),
        (
            dict(is_correction_level="token", is_correction_threshold="05"),
            ValueError,
            "is_correction_threshold",
        ),
        (dict(is_correction_level="token", is_correction_threshold=(0.5, "2")), TypeError, "threshold"),
        (dict(is_correction_level="token", is_correction_threshold=(math.nan, 2)), ValueError, "NaN"),
        (dict(is_correction_level="token", is_correction_threshold=(2.0, 0.5)), ValueError, "low <= high"),
        (dict(is_correction_level="token", is_correction_threshold=(0.5, -1.0)), ValueError, "high > 0"),
        (
            dict(is_correction_level="token", is_correction_threshold=(1e-39, 2.0)),
            ValueError,
            "rollout_clip_min",
        ),
        (
            dict(is_correction_level="token", is_correction_threshold=(0, math.inf)),
            ValueError,
            "bounds nothing",
        ),
        # settings OpenRLHF accepts and rlkernel cannot reproduce exactly (docs: "Not supported")
        (dict(policy_loss_type="gspo", dual_clip=3.0), ValueError, "not supported"),
        (dict(is_correction_level="seq"), ValueError, "not supported"),
        (
            dict(
                is_correction_level="token",
                is_correction_gating="binary_kl",
                is_correction_threshold=(0, 0.1),
            ),
            ValueError,
            "not supported",
        ),
    ],
)
def test_constructor_refuses(settings, error, match):
    with pytest.raises(error, match=match):
        PolicyLoss(**settings)


def _batch(B: int = 3, T: int = 5, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(0)
    log_probs = -torch.rand(B, T, generator=g, dtype=dtype)
    return dict(
        log_probs=log_probs,
        old_log_probs=log_probs + 0.1 * torch.randn(B, T, generator=g, dtype=dtype),
        advantages=torch.randn(B, T, generator=g, dtype=dtype),
        action_mask=torch.rand(B, T, generator=g) < 0.7,
        rollout_log_probs=log_probs + 0.1 * torch.randn(B, T, generator=g, dtype=dtype),
    )


def _replaced(**changes):
    return {**_batch(), **changes}


@pytest.mark.parametrize(
    "inputs, error, match",
    [
        (_replaced(log_probs=[[0.1, 0.2]]), TypeError, "log_probs"),
        (_replaced(log_probs=torch.zeros(3, 5, dtype=torch.int64)), TypeError, "log_probs"),
        (_replaced(log_probs=torch.zeros(15)), ValueError, r"log_probs must be \[B, T\]"),
        (_replaced(old_log_probs=torch.zeros(3, 4)), ValueError, "old_log_probs"),
        (_replaced(advantages=torch.zeros(3)), ValueError, "advantages"),
        (_replaced(advantages=torch.zeros(3, 5, dtype=torch.int32)), TypeError, "advantages"),
        (_replaced(action_mask=torch.ones(3, 4, dtype=torch.bool)), ValueError, "action_mask"),
        (_replaced(action_mask="all"), TypeError, "action_mask"),
        (_replaced(action_mask=torch.full((3, 5), 0.5)), ValueError, "0 and 1"),
        (_replaced(action_mask=torch.full((3, 5), 2, dtype=torch.int64)), ValueError, "0 and 1"),
        (_replaced(dp_size=0), ValueError, "dp_size"),
        (_replaced(dp_size=2.0), TypeError, "dp_size"),
        (_replaced(batch_num_tokens=-1.0), ValueError, "batch_num_tokens"),
        (_replaced(batch_num_tokens=torch.ones(2)), ValueError, "batch_num_tokens"),
        (_replaced(global_batch_size=math.inf), ValueError, "global_batch_size"),
        (_replaced(global_batch_size="8"), TypeError, "global_batch_size"),
    ],
)
def test_forward_refuses(inputs, error, match):
    with pytest.raises(error, match=match):
        PolicyLoss()(**inputs)


@pytest.mark.parametrize(
    "settings",
    [
        dict(is_correction_level="token"),
        dict(is_correction_level="token", is_correction_mode="clip"),
        dict(policy_loss_type="gspo", is_correction_level="seq"),
    ],
)
def test_a_correction_needs_rollout_log_probs(settings):
    loss = PolicyLoss(**settings)
    with pytest.raises(ValueError, match="rollout_log_probs is required"):
        loss(**_replaced(rollout_log_probs=None))
    with pytest.raises(ValueError, match="rollout_log_probs"):
        loss(**_replaced(rollout_log_probs=torch.zeros(3, 4)))
    assert torch.isfinite(loss(**_batch())[0])  # the same loss runs on good input


def test_without_a_correction_rollout_log_probs_is_ignored():
    batch = _batch()
    reference = PolicyLoss()(**batch)[0]
    assert torch.equal(PolicyLoss()(**{**batch, "rollout_log_probs": None})[0], reference)


def test_non_finite_input_at_an_active_token_gives_nan():
    batch = _batch()
    active = batch["action_mask"].nonzero()[0]
    for name in ("log_probs", "old_log_probs", "advantages"):
        for value in (math.nan, math.inf):
            bad = batch[name].clone()
            bad[tuple(active)] = value
            assert torch.isnan(PolicyLoss()(**{**batch, name: bad})[0]), (name, value)
    # garbage where the mask is 0 is ignored
    masked = (~batch["action_mask"]).nonzero()[0]
    bad = batch["log_probs"].clone()
    bad[tuple(masked)] = math.nan
    assert torch.isfinite(PolicyLoss()(**{**batch, "log_probs": bad})[0])
