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
  global_tokens=, global_seqs=)``; also re-exported as ``rlkernel.global_normalizers``. With a
  context-parallel group, a sequence split over its ranks counts once.
* :func:`context_parallel_split` (here): which tokens of each sequence a context-parallel rank
  holds (contiguous, or Megatron's load-balanced layout), and their positions, for ``policy_loss(...,
  cp_group=, cp_positions=)``.

This module sits above ``ops`` (it imports the op and the process-group checks of
:mod:`rlkernel.ops._vocab_parallel_checks`); nothing in ``ops`` imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from rlkernel import _validate as check
from rlkernel.ops._dtensor_weight import gather_lm_head
from rlkernel.ops._vocab_parallel_checks import check_group, collective_device
from rlkernel.ops.vocab_parallel import vocab_parallel_linear_token_logprobs

# The public API of this module (docs/api/distributed.md).
__all__ = [
    "context_parallel_split",
    "gather_lm_head",
    "global_normalizers",
    "vocab_parallel_linear_token_logprobs",
]


def global_normalizers(
    mask: torch.Tensor | Sequence[torch.Tensor],
    *,
    cu_seqlens: torch.Tensor | Sequence[torch.Tensor] | None = None,
    group: object | None = None,
    count_empty: bool = False,
    cp_group: object | None = None,
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
        cp_group: context parallelism: the masks are this rank's slice of every sequence (the
            same sequences, in the same order, on every rank of ``cp_group``; see
            ``policy_loss(cp_group=)``). Each sequence's count is first summed over ``cp_group`` (one
            more ``all_reduce``), so a sequence counts once whatever ranks hold its tokens; then
            the counts are summed over ``group``, which must be the data-parallel group only (not
            containing two ranks of one context-parallel group). Checks that the ranks of
            ``cp_group`` hold the same number of sequences (one host read).

    Returns:
        two float32 0-dim tensors on the mask's device (on the current CUDA device for CPU masks
        with an NCCL group). The counts are summed in int64 (exact) and never read on the host;
        ``cu_seqlens`` is read on the host to be validated (no sync when it lives on the CPU).

    Raises:
        TypeError: a mask not a tensor, ``group`` not a ProcessGroup, ``count_empty`` not a bool.
        ValueError: no masks, masks on different devices, a padded mask not 2-D, a packed mask not
            1-D, bad ``cu_seqlens`` (or a list of a different length); with ``cp_group``, on every
            rank of it, sequence counts that differ across its ranks.
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
    if cp_group is not None:
        check_group("cp_group", cp_group)
    per_seq_counts = []  # context parallelism: every micro-batch's [S], summed over cp_group at once
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
        if cp_group is not None:
            per_seq_counts.append(per_seq)
            continue
        seqs = torch.full((), per_seq.numel(), device=device) if count_empty else (per_seq > 0).sum()
        counts += torch.stack([active.sum(), seqs])
    if cp_group is not None:
        per_seq = _summed_over_cp(torch.cat(per_seq_counts), cp_group)
        seqs = torch.full((), per_seq.numel(), device=device) if count_empty else (per_seq > 0).sum()
        counts += torch.stack([per_seq.sum(), seqs])
    if group is not None:
        check_group("group", group)
    if group is not None or (dist.is_available() and dist.is_initialized()):
        counts = counts.to(collective_device(group, counts))
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    counts = counts.to(torch.float32)
    return counts[0], counts[1]


def _summed_over_cp(per_seq: torch.Tensor, cp_group: object) -> torch.Tensor:
    """int64 ``[S]``: the per-sequence counts summed over ``cp_group``, after checking (one MAX
    all-reduce of two numbers and a host read) that every rank has the same S: ranks that
    disagree would reduce tensors of different sizes (an error, or a hang, in the collective)."""
    device = collective_device(cp_group, per_seq)
    size = torch.tensor([per_seq.numel(), -per_seq.numel()], dtype=torch.int64, device=device)
    dist.all_reduce(size, op=dist.ReduceOp.MAX, group=cp_group)
    largest, neg_smallest = size.tolist()  # one host read
    smallest = -neg_smallest
    if largest != smallest:
        raise ValueError(
            f"global_normalizers: the ranks of cp_group hold different numbers of sequences (from "
            f"{smallest} to {largest}); each must hold a slice of every sequence of the step (every "
            "rank raises this error)"
        )
    total = per_seq.to(device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=cp_group)
    return total.to(per_seq.device)


class ContextParallelSplit(NamedTuple):
    """One context-parallel rank's share of a batch (:func:`context_parallel_split`).

    Attributes:
        index: int64 ``[N_r]``: where this rank's tokens are in the unsplit packed stream (the
            sequences concatenated), in this rank's order: ``x_local = x_packed[index]``. For a
            padded batch split with ``seq_lens=T``: the columns, ``x_local = x[:, index]``.
        positions: int64 ``[N_r]``: each local token's position in its sequence: pass it as
            ``cp_positions`` (padded: ``positions.expand(B, -1)``).
        cu_seqlens: int64 ``[S + 1]``: this rank's cumulative lengths (pass as ``cu_seqlens``).
    """

    index: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor


def context_parallel_split(
    seq_lens: int | Sequence[int] | torch.Tensor, *, cp_size: int, cp_rank: int, load_balanced: bool = True
) -> ContextParallelSplit:
    """Which tokens of each sequence context-parallel rank ``cp_rank`` of ``cp_size`` holds.

    ``load_balanced=True`` is Megatron's layout for causal attention: each sequence is cut into
    2·cp_size chunks and rank r holds chunks r and 2·cp_size − 1 − r, in that order (so every rank
    gets an early and a late piece, the same attention work). ``False``: cp_size contiguous chunks,
    rank r holding chunk r. Chunks are as equal as possible (``torch.tensor_split``'s rule: the
    first n mod k chunks one token longer); Megatron requires every length to be a multiple of
    2·cp_size, in which case the chunks are exactly its.

    Args:
        seq_lens: the sequence lengths of the unsplit batch: ints ``[S]`` (a packed batch), or one
            int T (the time axis of a padded ``[B, T]`` batch: ``index`` and ``positions`` are
            then columns, the same for every row).
        cp_size: the context-parallel group's size (>= 1).
        cp_rank: this rank's index in it.
        load_balanced: Megatron's load-balanced layout, else contiguous chunks.

    Returns:
        :class:`ContextParallelSplit` (CPU int64 tensors: move them to your device).

    Raises:
        TypeError / ValueError: a non-integer or negative length, ``cp_size < 1``, ``cp_rank``
            outside ``[0, cp_size)``.
    """
    cp_size = check.positive_int("cp_size", cp_size)
    check.integer("cp_rank", cp_rank)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size = {cp_size}), got {cp_rank}")
    check.boolean("load_balanced", load_balanced)
    if isinstance(seq_lens, torch.Tensor):
        lengths = check.int_tensor("seq_lens", seq_lens).detach().to("cpu", torch.int64).reshape(-1)
    elif isinstance(seq_lens, int) and not isinstance(seq_lens, bool):
        lengths = torch.tensor([seq_lens], dtype=torch.int64)
    else:
        values = list(seq_lens)
        for v in values:
            check.integer("seq_lens", v)
        lengths = torch.tensor(values, dtype=torch.int64).reshape(-1)
    if bool((lengths < 0).any()):
        raise ValueError(f"seq_lens must be >= 0, got {lengths.tolist()[:16]}")
    chunks = 2 * cp_size if load_balanced else cp_size
    mine = (cp_rank, chunks - 1 - cp_rank) if load_balanced else (cp_rank,)
    base, extra = lengths // chunks, lengths % chunks
    pieces = []  # (start, size) per sequence and chunk, in local order
    for j in mine:
        start = j * base + torch.clamp(extra, max=j)
        pieces.append(torch.stack([start, base + (j < extra).to(torch.int64)], -1))
    pieces = torch.stack(pieces, 1).reshape(-1, 2)  # [S * len(mine), 2], sequence-major
    starts, sizes = pieces[:, 0], pieces[:, 1]
    total = int(sizes.sum())
    first = torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
    positions = torch.repeat_interleave(starts, sizes) + torch.arange(total) - first
    seq_start = torch.cumsum(lengths, 0) - lengths
    seq_of_piece = torch.arange(lengths.numel()).repeat_interleave(len(mine))
    index = positions + torch.repeat_interleave(seq_start[seq_of_piece], sizes)
    local = sizes.reshape(-1, len(mine)).sum(-1)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(local, 0)])
    return ContextParallelSplit(index=index, positions=positions, cu_seqlens=cu)
