"""Group-relative advantage estimators for outcome rewards (one scalar reward per sequence).

Sequences are grouped (the responses to one prompt): consecutive groups of ``group_size``, or any
grouping by ``group_ids``. For a group g with rewards r_j, n_g members, mean μ_g and Bessel-corrected
standard deviation σ_g = sqrt(Σ_j (r_j − μ_g)² / (n_g − 1)):

    grpo                    A_i = (r_i − μ_g) / (σ_g + eps)
    dr_grpo                 A_i = r_i − μ_g                                (Dr. GRPO: no std scaling)
    rloo                    A_i = r_i − (Σ_g r − r_i) / (n_g − 1)          (leave-one-out baseline)
    reinforce_pp_baseline   x_i = r_i − μ_g, then whitened over the whole batch:
                            A_i = (x_i − μ_x) / sqrt(var_x + eps)

Singleton groups (n_g = 1) follow verl: grpo and dr_grpo use μ = 0, σ = 1 (so A = r / (1 + eps) and
A = r); rloo has no baseline (A = r); reinforce_pp_baseline uses μ = 0 before whitening.

REINFORCE++-baseline whitening: verl tiles x_i over the sequence's response tokens and whitens over
tokens, so each sequence weighs by its token count c_i: μ_x = Σ c x / C, var_x = Σ c (x − μ_x)² / (C − 1),
C = Σ c (Bessel-corrected over tokens), and ``rsqrt(var + 1e-8)``. ``token_counts`` gives those c_i
and reproduces verl exactly (pass ``eps=1e-8``); without it every sequence weighs 1 (whitening over
sequences, the REINFORCE++ paper's batch normalization).

Everything is vectorized: the rewards are laid out as a ``[G, K]`` matrix (G groups, K = largest group
size) and reduced along K — no Python loop over groups, no atomics, deterministic.

Provenance: verl ``core_algos`` (``compute_grpo_outcome_advantage``, ``..._rloo_...``,
``..._reinforce_plus_plus_baseline_...``, ``masked_whiten``), the GRPO (DeepSeekMath), Dr. GRPO, RLOO
and REINFORCE++ papers.

Caveats:
    * verl adds ``eps`` to σ in grpo (as here) but 1e-8 inside the square root for whitening; this
      function uses ``eps`` for both, so the default eps=1e-6 differs from verl in whitening by a
      relative ~1e-6/var.
    * With C ≤ 1 (one token in the whole batch) there is no Bessel-corrected variance; var_x = 0 is
      used (verl divides by zero).
    * ``group_ids`` costs a host sync (``torch.unique``). Ids may be any integers, in any order.
    * eps = 0 with a constant group (σ = 0) gives 0/0 = NaN, as the formula says.
"""

from __future__ import annotations

from typing import Literal

import torch

from rlkernel import _validate as check
from rlkernel._autocast import without_autocast

AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"]
ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


def _consecutive_layout(n: int, group_size: int, device: torch.device) -> tuple[torch.Tensor, int, int]:
    return torch.arange(n, device=device), n // group_size, group_size


def _grouped_layout(group_ids: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Flat positions in a ``[G, K]`` layout for arbitrary ids: row = group, column = rank within it."""
    _, group = torch.unique(group_ids, return_inverse=True)
    counts = torch.bincount(group)
    n_groups, width = counts.numel(), int(counts.max()) if counts.numel() else 0
    order = torch.argsort(group, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(group)
    rank[order] = torch.arange(group.numel(), device=group.device) - starts[group[order]]
    return group * width + rank, n_groups, width


def _to_groups(
    x: torch.Tensor, flat: torch.Tensor, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Values ``[G, K]`` (0 where empty) and the bool ``[G, K]`` membership mask."""
    values = x.new_zeros(shape[0] * shape[1]).index_put((flat,), x)
    member = torch.zeros(shape[0] * shape[1], dtype=torch.bool, device=x.device).index_put(
        (flat,), torch.ones_like(flat, dtype=torch.bool)
    )
    return values.view(shape), member.view(shape)


def _group_stats(values: torch.Tensor, member: torch.Tensor):
    """Per-group (size, sum, mean with verl's singleton mean 0, Bessel std with singleton std 1)."""
    size = member.sum(-1, keepdim=True).to(values.dtype)
    total = values.sum(-1, keepdim=True)
    single = size <= 1
    mean = torch.where(single, torch.zeros_like(total), total / size.clamp_min(1))
    sq_dev = torch.where(member, (values - mean).square(), torch.zeros_like(values)).sum(-1, keepdim=True)
    std = torch.where(single, torch.ones_like(total), (sq_dev / (size - 1).clamp_min(1)).sqrt())
    return size, total, mean, std


def _whiten(x: torch.Tensor, weights: torch.Tensor, eps: float) -> torch.Tensor:
    """(x − μ) / sqrt(var + eps) with weighted mean and weight-count Bessel-corrected variance."""
    total = weights.sum()
    mean = (weights * x).sum() / total.clamp_min(torch.finfo(x.dtype).tiny)
    sq_dev = (weights * (x - mean).square()).sum()
    var = torch.where(
        total > 1, sq_dev / (total - 1).clamp_min(torch.finfo(x.dtype).tiny), torch.zeros_like(sq_dev)
    )
    return (x - mean) / torch.sqrt(var + eps)


def _check_inputs(rewards, group_size, group_ids, estimator, eps, token_counts) -> torch.Tensor:
    rewards = check.float_tensor("rewards", rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B] (one scalar per sequence), got {check.describe(rewards)}")
    if (group_size is None) == (group_ids is None):
        raise ValueError(
            "pass exactly one of group_size (consecutive groups) or group_ids, got "
            f"{'both' if group_size is not None else 'neither'}"
        )
    if group_size is not None:
        check.positive_int("group_size", group_size)
        if rewards.shape[0] % group_size:
            raise ValueError(f"group_size={group_size} must divide the batch size {rewards.shape[0]}")
    else:
        check.int_tensor("group_ids", group_ids)
        check.same_shape("group_ids", group_ids, "rewards", rewards.shape)
        check.same_device("group_ids", group_ids, "rewards", rewards.device)
    check.choice("estimator", estimator, ADVANTAGE_ESTIMATORS)
    check.nonneg_float("eps", eps)
    if token_counts is not None:
        if estimator != "reinforce_pp_baseline":
            raise ValueError(
                f"token_counts is only used by estimator='reinforce_pp_baseline', got {estimator!r}"
            )
        _check_token_counts(token_counts, rewards)
    return rewards


def _check_token_counts(token_counts: object, rewards: torch.Tensor) -> None:
    """Token counts are weights of the whitening: real (int or float, not bool or complex), the shape
    and device of ``rewards``, finite and >= 0 (a negative count turns the weighted variance into
    nonsense, e.g. advantages of ±500; one host sync, like the rest of this per-step function)."""
    counts = check.tensor("token_counts", token_counts)
    if counts.dtype not in check.INT_DTYPES and counts.dtype not in check.FLOAT_DTYPES:
        raise TypeError(
            f"token_counts must be an integer or float tensor (response-token counts), got "
            f"{check.describe(counts)}"
        )
    check.same_shape("token_counts", counts, "rewards", rewards.shape)
    check.same_device("token_counts", counts, "rewards", rewards.device)
    if counts.numel() == 0:
        return
    values = counts.detach()
    bad = values < 0
    if values.is_floating_point():
        bad |= ~torch.isfinite(values)
    if bool(bad.any()):
        first = values[bad][0].item()
        raise ValueError(
            f"token_counts must be finite and >= 0 (response-token counts), got {int(bad.sum())} bad "
            f"value(s) (first: {first})"
        )


@torch.no_grad()
@without_autocast
def group_advantages(
    rewards: torch.Tensor,
    group_size: int | None = None,
    *,
    group_ids: torch.Tensor | None = None,
    estimator: AdvantageEstimator = "grpo",
    eps: float = 1e-6,
    token_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sequence advantages from per-sequence rewards, relative to each sequence's group.

    Args:
        rewards: ``[B]`` float, one scalar reward per sequence.
        group_size: the groups are consecutive runs of this many sequences (B % group_size == 0).
        group_ids: ``[B]`` int, the group of each sequence (any integers, any order). Exactly one of
            ``group_size`` and ``group_ids``.
        estimator: ``grpo | dr_grpo | rloo | reinforce_pp_baseline`` (see the module docstring).
        eps: ≥ 0; added to σ (grpo) or to the variance inside the square root (whitening).
        token_counts: ``[B]`` int/float response-token counts (finite, >= 0), ``reinforce_pp_baseline``
            only: whiten with token weights as verl does. Checking them costs one host sync.

    Returns:
        ``[B]`` float32 advantages, no gradient (computed in float64).

    Raises:
        TypeError: non-float rewards, non-int group_ids, token_counts not an int/float tensor (bool,
            complex), wrong argument types.
        ValueError: rewards not 1-D, both or neither of group_size/group_ids, group_size not dividing
            B, shape/device mismatches, unknown estimator, eps negative or not finite, token_counts
            with another estimator, token_counts negative or not finite.
    """
    rewards = _check_inputs(rewards, group_size, group_ids, estimator, eps, token_counts)
    r = rewards.detach().to(torch.float64)
    if r.numel() == 0:
        return r.to(torch.float32)
    if group_size is not None:
        flat, n_groups, width = _consecutive_layout(r.numel(), group_size, r.device)
    else:
        flat, n_groups, width = _grouped_layout(group_ids)
    values, member = _to_groups(r, flat, (n_groups, width))
    size, total, mean, std = _group_stats(values, member)
    if estimator == "grpo":
        adv = (values - mean) / (std + eps)
    elif estimator == "rloo":
        others = (total - values) / (size - 1).clamp_min(1)
        adv = torch.where(size > 1, values - others, values)
    else:
        adv = values - mean
    adv = adv.reshape(-1)[flat]
    if estimator == "reinforce_pp_baseline":
        weights = torch.ones_like(adv) if token_counts is None else token_counts.detach().to(torch.float64)
        adv = _whiten(adv, weights, eps)
    return adv.to(torch.float32)
