"""``rlkernel.distributed``: the collective helpers on torch.distributed (``docs/api/distributed.md``).

* :func:`vocab_parallel_linear_token_logprobs`: full-vocabulary log-probs (and entropy) from a
  vocab-sharded (tensor-parallel) LM head, on every rank; what ``linear_token_logprobs(...,
  tp_group=)`` runs. It is a differentiable primitive like the others, so it lives in ``ops``
  (:mod:`rlkernel.ops.vocab_parallel`: cross-rank validation and options; its autograd Function and
  chunk math in :mod:`rlkernel.ops._vocab_parallel_function`) and is re-exported here.
* :func:`gather_lm_head`: an FSDP2 (``DTensor``) LM head as full local tensors whose gradient is
  averaged over the mesh and reduce-scattered back to the shards (what ``linear_token_logprobs`` and
  ``fused_policy_loss`` do to a DTensor weight; :mod:`rlkernel.ops._dtensor_weight`), for code that
  projects hidden states with the head's weight itself; re-exported here.
* :func:`global_normalizers` (here): the active-token and sequence counts of a whole step (all
  micro-batches, all data-parallel ranks) in one ``all_reduce``, for ``policy_loss(...,
  global_tokens=, global_seqs=)``; also re-exported as ``rlkernel.global_normalizers``.

This module sits above ``ops`` (it imports the op and the process-group checks of
:mod:`rlkernel.ops._vocab_parallel_checks`); nothing in ``ops`` imports it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from rlkernel import _validate as check
from rlkernel.ops._dtensor_weight import gather_lm_head
from rlkernel.ops._vocab_parallel_checks import check_group, collective_device
from rlkernel.ops.vocab_parallel import vocab_parallel_linear_token_logprobs

# The public API of this module (docs/api/distributed.md).
__all__ = ["gather_lm_head", "global_normalizers", "vocab_parallel_linear_token_logprobs"]


def global_normalizers(
    mask: torch.Tensor | Sequence[torch.Tensor],
    *,
    cu_seqlens: torch.Tensor | Sequence[torch.Tensor] | None = None,
    group: object | None = None,
    count_empty: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(global_tokens, global_seqs)`` of a whole optimizer step, summed over a data-parallel group.

    The normalizers of :func:`rlkernel.policy_loss` / :func:`rlkernel.fused_policy_loss` for a step
    split into micro-batches (gradient accumulation) and data-parallel ranks: with them, the losses
    (and gradients) of all micro-batches on all ranks add up to the loss of the whole step.
    ``global_tokens`` = Σ active tokens; ``global_seqs`` = Σ sequences with at least one active token
    (the count the ``seq-mean-*`` aggregations use locally), or every sequence with ``count_empty``.

    Args:
        mask: this rank's masks: one ``[B, T]`` padded mask, one packed ``[N]`` mask with
            ``cu_seqlens``, or a list of them (one per micro-batch), bool/int/float (nonzero =
            active), all on one device.
        cu_seqlens: int ``[S + 1]`` cumulative lengths for packed masks (a list matching a list of
            masks; ``None`` entries for padded ones); ``None`` for padded masks.
        group: the data-parallel process group; ``None`` = the default group when torch.distributed
            is initialized, else no reduction (one process: the local counts are global).
        count_empty: also count sequences without any active token (TRL and verl divide by every
            row of the batch).

    Returns:
        two float32 0-dim tensors on the mask's device (on the current CUDA device for CPU masks
        with an NCCL group). The counts are summed in int64 (exact) and never read on the host;
        ``cu_seqlens`` is read on the host to be validated (no sync when it lives on the CPU).

    Raises:
        TypeError: a mask not a tensor, ``group`` not a ProcessGroup, ``count_empty`` not a bool.
        ValueError: no masks, masks on different devices, a padded mask not 2-D, a packed mask not
            1-D, bad ``cu_seqlens`` (or a list of a different length).
    """
    check.boolean("count_empty", count_empty)
    masks = list(mask) if isinstance(mask, (list, tuple)) else [mask]
    if not masks:
        raise ValueError("mask must be a tensor or a non-empty list of micro-batch masks, got an empty list")
    if cu_seqlens is None or isinstance(cu_seqlens, torch.Tensor):
        cus = [cu_seqlens] * len(masks) if cu_seqlens is None or len(masks) == 1 else None
        if cus is None:
            raise ValueError("with a list of masks, cu_seqlens must be a list of the same length (or None)")
    else:
        cus = list(cu_seqlens)
        if len(cus) != len(masks):
            raise ValueError(f"cu_seqlens has {len(cus)} entries for {len(masks)} masks")
    device = check.mask_tensor("mask[0]", masks[0]).device
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    for i, (m, cu) in enumerate(zip(masks, cus, strict=True)):
        name = "mask" if len(masks) == 1 else f"mask[{i}]"
        m = check.mask_tensor(name, m)
        check.same_device(name, m, "mask[0]", device)
        active = m != 0
        if cu is None:
            if m.dim() != 2:
                raise ValueError(
                    f"{name} must be [B, T] (padded), or 1-D (packed) with cu_seqlens, "
                    f"got {check.describe(m)}"
                )
            per_seq = active.sum(-1)
        else:
            if m.dim() != 1:
                raise ValueError(f"{name} must be 1-D (packed) with cu_seqlens, got {check.describe(m)}")
            cu = check.cu_seqlens_tensor(
                "cu_seqlens" if len(masks) == 1 else f"cu_seqlens[{i}]", cu, m.shape[0]
            )
            cu = cu.to(device=device, dtype=torch.int64)
            csum = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), active.long().cumsum(0)])
            per_seq = csum[cu[1:]] - csum[cu[:-1]]
        seqs = torch.full((), per_seq.numel(), device=device) if count_empty else (per_seq > 0).sum()
        counts += torch.stack([active.sum(), seqs])
    if group is not None:
        check_group("group", group)
    if group is not None or (dist.is_available() and dist.is_initialized()):
        counts = counts.to(collective_device(group, counts))
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    counts = counts.to(torch.float32)
    return counts[0], counts[1]
