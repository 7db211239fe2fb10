"""The sequence-ratio loss launcher (gspo, gspo_token, gmpo): one kernel launch and one sum.

The interface between :mod:`rlkernel.rl.seq_token_loss` (the closed form, and its torch version
for every other backend) and the Triton kernel :mod:`rlkernel.kernels.seq_token_loss`. It lives in
``ops`` because ``rl`` may not import ``kernels`` (``tests/test_layering.py``).
"""

from __future__ import annotations

import torch

from rlkernel.ops.token_loss import TokenLossPlan, TokenLossTerms


def seq_token_loss_triton(
    plan: TokenLossPlan,
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    *,
    kind: str,
    geo_mean: bool,
    old: torch.Tensor | None,
    adv: torch.Tensor,
    adv_per_seq: bool,
    cu_seqlens: torch.Tensor | None,
    n_seqs: int,
    clip_lo: float,
    clip_hi: float,
    eps_low: float,
    eps_high: float,
    log_ratio_max: float,
) -> TokenLossTerms:
    """The loss (0-dim fp32, the ``[S]`` sequence partials summed in order) and the per-token
    coefficients of sequence-ratio loss ``kind`` through the Triton kernel; the arguments are
    those of :func:`rlkernel.kernels.seq_token_loss.seq_token_loss_fwd` (fp32 contiguous
    per-token tensors; ``cu_seqlens`` int64 on the device, or None for padded input)."""
    from rlkernel.kernels import seq_token_loss as kernels

    partial, g_logp, g_entropy = kernels.seq_token_loss_fwd(
        plan, logp, entropy, kind=kind, geo_mean=geo_mean, old=old, adv=adv, adv_per_seq=adv_per_seq,
        cu_seqlens=cu_seqlens, n_seqs=n_seqs, clip_lo=clip_lo, clip_hi=clip_hi, eps_low=eps_low,
        eps_high=eps_high, log_ratio_max=log_ratio_max,
    )  # fmt: skip
    return TokenLossTerms(partial.sum(), g_logp, g_entropy)
