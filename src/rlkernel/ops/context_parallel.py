"""The one differentiable collective of context parallelism: a SUM all-reduce whose backward is
again a SUM all-reduce (:func:`all_reduce_sum`).

Context-parallel losses (``cp_group=`` of ``rlkernel.policy_loss`` / ``fused_policy_loss``; the
algebra is in :mod:`rlkernel.rl.context_parallel`) split each sequence over the ranks of a group.
A sequence-level quantity such as GSPO's Σ_t m·(logp − old) is then S = Σ_r S_r, the sum of each
rank's partial sum S_r, and every rank's loss L_r depends on S (so on every rank's log-probs). The
gradient a rank needs for its own tokens is that of the unsplit loss L = Σ_r L_r:

    ∂L/∂S_r = Σ_q ∂L_q/∂S        (every rank's loss, through the shared S)

so the backward of ``S = all_reduce(S_r)`` is ``all_reduce(∂L_r/∂S)``: each rank receives the sum
of the upstream gradients of all ranks. This is ``torch.distributed.nn.functional.all_reduce``'s
rule (deprecated there), kept here as a small Function of our own.

Caveats:
    * A collective in both directions: every rank of the group must run this forward and, if any
      rank runs the backward through it, every rank must (in the same order relative to the
      group's other collectives); a rank that skips it stalls the others until the process
      group's timeout.
    * The tensor is reduced where it lives (NCCL: CUDA tensors, gloo: CPU tensors); the caller
      picks the device (:func:`rlkernel.ops._vocab_parallel_checks.collective_device`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllReduceSum(torch.autograd.Function):
    """out = Σ_ranks x; d(out) → Σ_ranks d(out) (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object) -> torch.Tensor:
        ctx.group = group
        out = x.detach().clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def all_reduce_sum(x: torch.Tensor, group: object) -> torch.Tensor:
    """Σ of ``x`` over the ranks of ``group`` (a new tensor, bitwise the same on every rank).

    Differentiable when ``x`` requires grad (and grad mode is on): the backward all-reduces the
    incoming gradient (module docstring); otherwise a plain all-reduce of a copy. A collective:
    every rank of ``group`` calls it with a tensor of the same shape and dtype.
    """
    if x.requires_grad and torch.is_grad_enabled():
        return _AllReduceSum.apply(x, group)
    out = x.detach().clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out
