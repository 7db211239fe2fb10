"""TRL 1.16's GRPO loss computed by rlkernel, from hidden states (docs/integrations/trl.md).

    from rlkernel.integrations.trl import RLKernelGRPOTrainer   # instead of trl.GRPOTrainer

Entry points:

    RLKernelGRPOTrainer      ``trl.GRPOTrainer`` (same constructor) whose loss is
                             ``rk.fused_policy_loss(hidden=..., weight=lm_head.weight, ...)`` (or,
                             with TRL's entropy bonus, the linear primitive + ``rk.policy_loss``): the
                             ``[B, T, V]`` logits never exist; every other step (generation,
                             rewards, advantages, old and reference log-probs) is TRL's own code.
    policy_config_from_trl   ``GRPOConfig`` → :class:`rlkernel.PolicyLossConfig` (raises for what
                             cannot map; the normalizers are per-call: ``config.step_normalizers``).
    add_rlkernel_lm_head     TRL's ``add_fused_lm_head`` computed by ``rk.linear_token_logprobs``;
    use_rlkernel_lm_head     applied to a ``GRPOTrainer``'s policy and reference models: TRL's current,
                             old and reference log-probs and entropies go through rlkernel, TRL's
                             loss stays.

    SamplerLogprobs          keeps the sampler's per-token log-probs while ``model.generate`` samples
    sampling_metrics         (TRL's training semantics); the mismatch against a trainer's log-probs
                             under TRL's ``sampling/*`` metric names.

``RLKernelGRPOTrainer(..., true_on_policy=True)`` patches the policy with
``rlkernel.invariant.patch_hf_model``: the sampler's log-probs are then the trainer's bit for bit and
serve as the old log-probs (no scoring forward); see :mod:`rlkernel.integrations.trl.on_policy`.

Version: TRL 1.16.x only (tested with 1.16.0); anything else raises ``RuntimeError`` naming the pin.
``policy_config_from_trl`` and ``add_rlkernel_lm_head`` do not import TRL at import time; the trainer
class is a subclass of ``trl.GRPOTrainer``, so ``RLKernelGRPOTrainer`` imports TRL when first read.

Settings rlkernel cannot reproduce raise ``ValueError`` at construction, naming the ``GRPOConfig``
field (never a different number later); see :mod:`rlkernel.integrations.trl.config`.
"""

from __future__ import annotations

from rlkernel.integrations.trl.config import (
    SUPPORTED_SERIES,
    TESTED_VERSIONS,
    plan_from_trl,
    policy_config_from_trl,
)
from rlkernel.integrations.trl.head import add_rlkernel_lm_head, use_rlkernel_lm_head
from rlkernel.integrations.trl.sampler import SamplerLogprobs, sampling_metrics

__all__ = [
    "SUPPORTED_SERIES",
    "TESTED_VERSIONS",
    "RLKernelGRPOTrainer",
    "SamplerLogprobs",
    "add_rlkernel_lm_head",
    "plan_from_trl",
    "policy_config_from_trl",
    "sampling_metrics",
    "use_rlkernel_lm_head",
]


def __getattr__(name: str) -> object:
    # The trainer subclasses trl.GRPOTrainer: importing it imports TRL (and transformers, accelerate).
    if name == "RLKernelGRPOTrainer":
        from rlkernel.integrations.trl.trainer import RLKernelGRPOTrainer

        return RLKernelGRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
