"""The RL objective algebra on ``[B, T]`` (or packed) tensors.

advantages   group_advantages: grpo | dr_grpo | rloo | reinforce_pp_baseline
kl           kl_penalty: k1 | k2 | k3 | abs | k1+ | k3+ (and verl's aliases)
config       PolicyLossConfig and its presets
aggregate    sequence segmentation (padded / packed) and the four aggregation modes
objectives   per-token terms of every loss type
rollout      rollout-mismatch correction weights (TIS / MIS, token / sequence)
loss         policy_loss -> PolicyLossOutput(loss, metrics)
fused        fused_policy_loss: the same loss from logits or hidden states
"""

from rlkernel.rl.advantages import ADVANTAGE_ESTIMATORS, group_advantages
from rlkernel.rl.aggregate import AGGREGATIONS
from rlkernel.rl.config import LOSS_TYPES, PRESETS, ROLLOUT_CORRECTIONS, PolicyLossConfig
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
    "PolicyLossConfig",
    "PolicyLossOutput",
    "fused_policy_loss",
    "group_advantages",
    "kl_penalty",
    "policy_loss",
]
