"""The RL objective algebra on ``[B, T]`` (or packed) tensors.

advantages   group_advantages: grpo | dr_grpo | rloo | reinforce_pp_baseline
kl           kl_penalty: k1 | k2 | k3 | abs | k1+ | k3+ | k3_unclamped (and verl's aliases)
config       PolicyLossConfig and its presets
aggregate    sequence segmentation (padded / packed) and the five aggregation modes (token-sum included)
objectives   per-token terms of every loss type (ppo … reinforce, vespo, dppo_tv/kl, clip_cov, kl_cov, dro)
covariance   clip_cov / kl_cov token selection (verl's)
rollout      rollout-mismatch correction weights (TIS / MIS, token / sequence, batch-normalized), rejection
masks        TRL's off-policy sequence mask and top-entropy-quantile mask
batch        validate_batch: every input checked once -> LossBatch
context_parallel, context_parallel_checks
             cp_group: the reductions across ranks that hold slices of every sequence, and the
             cross-rank check of a call's layout
token_loss   the token-level plan of the fused path
loss         policy_loss -> PolicyLossOutput(loss, metrics)
fused        fused_policy_loss: the same loss from logits or hidden states
"""

from rlkernel.rl.advantages import ADVANTAGE_ESTIMATORS, group_advantages
from rlkernel.rl.aggregate import AGGREGATIONS
from rlkernel.rl.config import (
    LOSS_TYPES,
    PRESETS,
    ROLLOUT_CORRECTIONS,
    ROLLOUT_REJECTIONS,
    PolicyLossConfig,
)
from rlkernel.rl.fused import fused_policy_loss
from rlkernel.rl.kl import KL_ALIASES, KL_ESTIMATORS, kl_penalty
from rlkernel.rl.loss import PolicyLossOutput, policy_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_ALIASES",
    "KL_ESTIMATORS",
    "LOSS_TYPES",
    "PRESETS",
    "ROLLOUT_CORRECTIONS",
    "ROLLOUT_REJECTIONS",
    "PolicyLossConfig",
    "PolicyLossOutput",
    "fused_policy_loss",
    "group_advantages",
    "kl_penalty",
    "policy_loss",
]
