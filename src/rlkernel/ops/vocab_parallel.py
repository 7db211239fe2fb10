"""The vocab-parallel (tensor-parallel) LM-head log-probs: the public op behind ``tp_group=``.

:func:`vocab_parallel_linear_token_logprobs` is what ``linear_token_logprobs(..., tp_group=g)`` and
``fused_policy_loss(hidden=..., tp_group=g)`` run, and is public as
``rlkernel.distributed.vocab_parallel_linear_token_logprobs`` (``docs/api/distributed.md``). Per
call it (1) validates the call across the ranks of the group
(:func:`rlkernel.ops._vocab_parallel_checks.agree_across_ranks`: one ``all_gather`` of a small
descriptor and one host read; every rank raises the same error, before any data collective), which
also yields ``vocab_start`` and the global V; (2) reads :func:`rlkernel.current_options` once and
resolves ``tp_gemm`` and ``tp_elementwise`` for these tensors; (3) applies the autograd Function of
:mod:`rlkernel.ops._vocab_parallel_function`, where the algorithm, its collectives and the cost of
each choice are documented.

Caveats:
    * Hidden states must be bitwise replicated across the group, and the upstream gradients of
      ``logp``/``entropy`` identical (they are when the loss is computed from the replicated outputs,
      as every rank must do). Only the ids are checksummed; different hidden states give wrong
      numbers, not an error.
    * Every rank must run backward (or none): ``dhidden`` is an all-reduce. Whether ``hidden``
      needs a gradient is checked in forward; a rank that skips backward stalls the others until the
      process group's timeout.
    * Errors raised before this function runs (``fused_policy_loss`` checks its configuration, its
      sources and masks first) are raised by the offending rank alone: keep the per-rank inputs
      (the weight shard, the bias) the only thing that differs.
    * A zero-row shard is rejected (every rank must own at least one vocabulary row).
    * The per-call descriptor read is a host sync; the path is not traceable by ``torch.compile``
      (``fullgraph=True`` breaks at the collectives).
"""

from __future__ import annotations

import torch

from rlkernel._autocast import without_autocast
from rlkernel._options import current_options
from rlkernel.ops._vocab_parallel_checks import agree_across_ranks
from rlkernel.ops._vocab_parallel_function import (
    VocabParallelLinearLogprobs,
    default_chunk_rows,
    half_gemm,
    use_kernels,
)
from rlkernel.reference import logprobs as ref


@without_autocast
def vocab_parallel_linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    token_ids: torch.Tensor,
    *,
    tp_group: object,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    validate: bool = True,
    chunk_rows: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Full-vocabulary log-probs (and entropy) from a vocab-sharded LM head, on every rank.

    What ``linear_token_logprobs(..., tp_group=g)`` runs. Rank r of ``g`` holds rows
    ``[vocab_start_r, vocab_start_r + V_r)`` of the ``[V, H]`` LM head, ``vocab_start_r`` = the sum
    of the shard sizes of ranks ``< r`` (shards contiguous, in rank order, sizes may differ). Every
    rank passes the same ``hidden`` and ``token_ids`` and gets the same ``logp``/``entropy``: those
    of the unsharded head. Collective call: every rank of ``g`` must make it, in the same order.

    The local GEMMs and the chunk math follow the options ``tp_gemm`` and ``tp_elementwise``
    (:class:`rlkernel.Options`, set with ``rk.use_options``; the same on every rank): by default
    bf16/fp16 on CUDA run half-precision-operand GEMMs with fp32 output and the Triton log-prob
    kernels, everything else the reference's fp32 GEMMs and PyTorch chunk math.

    Args:
        hidden: ``[..., H]`` float, replicated across the group.
        weight: ``[V_r, H]`` this rank's shard (``V_r >= 1``), same dtype and device as ``hidden``.
            Its gradient (and the bias's) stays local: rank r gets ``dL/dW[vocab_start_r : +V_r]``.
        token_ids: ``[...]`` integer global ids in ``[0, V)`` (V = Σ V_r) or ``ignore_index``,
            replicated across the group.
        tp_group: the tensor-parallel ``torch.distributed.ProcessGroup``. NCCL for CUDA tensors,
            gloo for CPU tensors.
        bias: optional ``[V_r]`` shard of the LM-head bias (all ranks or none).
        temperature, ignore_index, return_entropy: as in :func:`rlkernel.linear_token_logprobs`;
            the same on every rank.
        validate: check the ids against the global V (free: it rides on the layout check's single
            host sync). The layout check itself always runs: it also yields ``vocab_start``.
        chunk_rows: rows per chunk (the same on every rank); ``None`` sizes chunks for the largest
            shard: with the Triton chunk math (bf16/fp16 on CUDA) as the single-GPU linear path does
            (fp32 ``[C, V_r]`` within 1.28 GiB, C ≤ 4096), else with
            :func:`rlkernel.reference.logprobs.chunk_rows_for` (64 MiB).

    Returns:
        ``logp`` float32 ``[...]`` (float64 for float64 inputs), or ``(logp, entropy)``.
        ``dhidden`` is all-reduced in backward, so every rank gets the full gradient.

    Raises:
        TypeError: ``tp_group`` is not a ProcessGroup (raised locally, before any collective).
        ValueError: on every rank, with the same message, when any rank's local checks fail (the
            messages of ``linear_token_logprobs``; a ``TypeError`` if every rank failed a type check)
            or when N, H, dtype, device type, bias presence, temperature, ignore_index,
            return_entropy, ``hidden.requires_grad``, ``chunk_rows`` or the ids differ across
            ranks, or (``validate``) an active id is outside ``[0, V)``.
    """
    layout = agree_across_ranks(
        hidden,
        weight,
        bias,
        token_ids,
        tp_group,
        temperature=temperature,
        ignore_index=ignore_index,
        return_entropy=return_entropy,
        chunk_rows=chunk_rows,
        validate=validate,
    )
    options = current_options()  # read once per call; the choices are passed down as arguments
    ids = layout.ids
    n = ids.numel()
    lead = hidden.shape[:-1]
    h = hidden.reshape(lead.numel(), hidden.shape[-1])  # rows by count: H may be 0
    half = half_gemm(weight, options.tp_gemm)
    kernels = use_kernels(h, half, options.tp_elementwise)
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(layout.largest_shard, n, hidden.dtype, kernels)
    flat_ids, active = ref.prepare_ids(ids, ignore_index)
    # Ignored rows may hold garbage: zero them so they reach neither the logits nor the gradients.
    h = torch.where(active[:, None], h, torch.zeros((), dtype=h.dtype, device=h.device))
    logp, entropy = VocabParallelLinearLogprobs.apply(
        h,
        weight,
        bias,
        flat_ids,
        active,
        tp_group,
        layout.vocab_start,
        float(temperature),
        int(chunk_rows),
        bool(return_entropy),
        half,
        kernels,
    )
    if return_entropy:
        return logp.reshape(lead), entropy.reshape(lead)
    return logp.reshape(lead)
