"""group_advantages against explicit per-group formulas: every estimator, consecutive and arbitrary
groups, singleton groups, token-weighted whitening."""

import pytest
import torch

import rlkernel as rk

from . import formulas

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


def _groups_from_ids(ids):
    groups = {}
    for i, g in enumerate(ids.tolist()):
        groups.setdefault(g, []).append(i)
    return list(groups.values())


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_consecutive_groups(estimator, group_size):
    rewards = torch.randn(8, generator=torch.Generator().manual_seed(group_size))
    got = rk.group_advantages(rewards, group_size, estimator=estimator)
    groups = [list(range(s, s + group_size)) for s in range(0, 8, group_size)]
    assert got.dtype == torch.float32 and got.shape == (8,) and not got.requires_grad
    torch.testing.assert_close(
        got.double(), formulas.group_advantages(rewards, groups, estimator), atol=1e-6, rtol=1e-6
    )


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_arbitrary_group_ids_with_singletons(estimator):
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(11, generator=g)
    ids = torch.tensor([70, -3, 70, 5, 2**40, -3, 70, 5, 9, -3, 70])  # groups of 4, 3, 2, and singletons
    got = rk.group_advantages(rewards, group_ids=ids, estimator=estimator)
    expected = formulas.group_advantages(rewards, _groups_from_ids(ids), estimator)
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-6)


def test_group_ids_equal_group_size_for_consecutive_groups():
    rewards = torch.randn(12)
    ids = torch.arange(12) // 3
    for estimator in ESTIMATORS:
        torch.testing.assert_close(
            rk.group_advantages(rewards, 3, estimator=estimator),
            rk.group_advantages(rewards, group_ids=ids, estimator=estimator),
        )


def test_singleton_groups_follow_verl():
    rewards = torch.tensor([2.0, -1.0, 0.5])
    ones = torch.ones(3)
    torch.testing.assert_close(rk.group_advantages(rewards, 1), rewards / (ones + 1e-6))
    torch.testing.assert_close(rk.group_advantages(rewards, 1, estimator="dr_grpo"), rewards)
    torch.testing.assert_close(rk.group_advantages(rewards, 1, estimator="rloo"), rewards)


def test_explicit_small_example():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    adv = rk.group_advantages(rewards, 3, eps=0.0)
    std = torch.tensor([1.0, 0.0, 0.0]).std()  # Bessel-corrected
    torch.testing.assert_close(adv[:3], (torch.tensor([1.0, 0.0, 0.0]) - 1 / 3) / std)
    assert torch.isnan(adv[3:]).all()  # a constant group with eps = 0 is 0/0, as the formula says
    rloo = rk.group_advantages(rewards, 3, estimator="rloo")
    torch.testing.assert_close(rloo[:3], torch.tensor([1.0, -0.5, -0.5]))


def test_constant_group_is_zero_with_eps():
    adv = rk.group_advantages(torch.tensor([3.0, 3.0, 3.0, 3.0]), 4)
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_reinforce_pp_baseline_token_weighted_whitening():
    g = torch.Generator().manual_seed(5)
    rewards = torch.randn(8, generator=g)
    counts = torch.tensor([3, 7, 1, 4, 9, 2, 5, 6])
    got = rk.group_advantages(rewards, 4, estimator="reinforce_pp_baseline", token_counts=counts, eps=1e-8)
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    expected = formulas.group_advantages(
        rewards, groups, "reinforce_pp_baseline", eps=1e-8, token_counts=counts
    )
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-6)
    # Same as whitening the tiled token-level values with a Bessel-corrected variance (verl's way).
    centered = rk.group_advantages(rewards, 4, estimator="dr_grpo").double()
    tokens = torch.repeat_interleave(centered, counts)
    tiled = (tokens - tokens.mean()) / torch.sqrt(tokens.var() + 1e-8)
    torch.testing.assert_close(torch.repeat_interleave(got.double(), counts), tiled, atol=1e-6, rtol=1e-6)
    unweighted = rk.group_advantages(rewards, 4, estimator="reinforce_pp_baseline", eps=1e-8)
    torch.testing.assert_close(
        unweighted.double(), (centered - centered.mean()) / centered.std(), atol=1e-6, rtol=1e-6
    )


def test_float64_rewards_and_empty_batch():
    rewards = torch.randn(6, dtype=torch.float64, requires_grad=True)
    out = rk.group_advantages(rewards, 3)
    assert out.dtype == torch.float32 and not out.requires_grad
    assert rk.group_advantages(torch.zeros(0), group_ids=torch.zeros(0, dtype=torch.long)).shape == (0,)
    assert rk.group_advantages(torch.zeros(0), 2).shape == (0,)


def test_nan_reward_stays_in_its_group():
    rewards = torch.tensor([1.0, float("nan"), 0.0, 2.0])
    adv = rk.group_advantages(rewards, 2)
    assert torch.isnan(adv[:2]).all() and torch.isfinite(adv[2:]).all()
