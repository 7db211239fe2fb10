"""rlkernel: fused log-probs, exact RL objectives and batch-invariant kernels for LLM post-training.

Public API (see docs/ and DESIGN.md):

    token_logprobs, linear_token_logprobs          per-token log-probs (+ entropy), differentiable
    group_advantages, kl_penalty                    advantage estimators, KL estimators
    PolicyLossConfig, policy_loss, PolicyLossOutput the RL objective algebra
    fused_policy_loss                               loss straight from logits or hidden states
    global_normalizers                              token/sequence counts of a step over DP ranks
    use_backend                                     force "triton" / "reference" for a block of code
    use_options, Options, current_options          every other switch, scoped to a block of code
    raise_pending_errors                            raise a deferred token-id error now (CUDA)
    Route, record_routes                            which kernels a call ran (out.route; the primitives')
"""

from rlkernel._dispatch import use_backend
from rlkernel._options import MatmulThresholds, Options, current_options, use_options
from rlkernel.distributed import global_normalizers
from rlkernel.ops.id_checks import raise_pending_errors
from rlkernel.ops.logprobs import linear_token_logprobs, token_logprobs
from rlkernel.ops.routes import Route, record_routes
from rlkernel.rl import (
    PolicyLossConfig,
    PolicyLossOutput,
    fused_policy_loss,
    group_advantages,
    kl_penalty,
    policy_loss,
)

__version__ = "0.1.0"

__all__ = [
    "MatmulThresholds",
    "Options",
    "PolicyLossConfig",
    "PolicyLossOutput",
    "Route",
    "__version__",
    "current_options",
    "fused_policy_loss",
    "global_normalizers",
    "group_advantages",
    "kl_penalty",
    "linear_token_logprobs",
    "policy_loss",
    "raise_pending_errors",
    "record_routes",
    "token_logprobs",
    "use_backend",
    "use_options",
]
