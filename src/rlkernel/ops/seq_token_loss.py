"""The sequence-ratio loss launcher (gspo, gspo_token, gmpo): one kernel launch and one sum.

The interface between :mod:`rlkernel.rl.seq_token_loss` (the closed form, and its torch version
for every other backend) and the Triton kernel :mod:`rlkernel.kernels.seq_token_loss`. It lives in
``ops`` because ``rl`` may not import ``kernels`` (``tests/test_layering.py``).
"""

from __future__ import annotations

import torch

from rlkernel.ops.token_loss import TokenLossPlan, TokenLossTerms


def seq_token_loss_triton(
    plan: TokenLossPlan, logp: torch.Tensor, entropy: torch.Tensor | None, **sequence_terms
) -> TokenLossTerms:
    """The loss (0-dim fp32, the ``[S]`` sequence partials summed in order) and the per-token
    coefficients of a sequence-ratio loss through the Triton kernel. ``sequence_terms``: the
    keyword arguments of :func:`rlkernel.kernels.seq_token_loss.seq_token_loss_fwd` (the loss
    kind, its ratio convention, old log-probs, advantages, ``cu_seqlens``, clip bounds)."""
    from rlkernel.kernels import seq_token_loss as kernels

    partial, g_logp, g_entropy = kernels.seq_token_loss_fwd(plan, logp, entropy, **sequence_terms)
    return TokenLossTerms(partial.sum(), g_logp, g_entropy)
