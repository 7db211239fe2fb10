"""DTensor LM heads (FSDP2 ``fully_shard``) on the hidden-state path: gathered to a full local weight.

A model wrapped with ``torch.distributed.fsdp.fully_shard`` holds each parameter as a ``DTensor``
sharded on dim 0 (``Shard(0)``); only inside the owning module's forward is it a plain, unsharded
tensor. A loss computed *after* ``model(...)`` from ``out.hidden_states[-1]`` therefore gets
``model.lm_head.weight`` as a DTensor, which the chunk engine cannot read. :func:`local_lm_head`
turns it into a plain ``[V, H]`` tensor, differentiably:

    full = weight.redistribute(placements=[Replicate()] * mesh.ndim, forward_dtype=...)   # all-gather
                 .to_local(grad_placements=[Partial("avg")] * mesh.ndim)

Forward: one all-gather of the weight (what FSDP2 runs before the module's forward anyway).
Backward: the ``[V, H]`` gradient of ``full`` is reduced over the mesh with a *mean* and scattered
back to the shards: one reduce-scatter, accumulated into the sharded ``weight.grad`` (a DTensor with
the weight's placements), as FSDP2's own post-backward does. The mean is FSDP2's default reduction
(gradients averaged over the data-parallel ranks, ``ReduceOp.AVG``), so the LM head's gradient stays
consistent with every other parameter's; on mesh dimensions whose ranks hold the same data (tensor
parallel) the mean of equal gradients is that gradient.

Why not ``weight.full_tensor()``: its default ``grad_placements`` declare the gradient replicated,
and the backward of Replicate -> Shard(0) is a local slice, no communication. With data-parallel
inputs every rank's shard would then hold only its own rank's gradient: silently wrong.

Mixed precision. FSDP2 with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` keeps fp32 shards
and gathers them in bf16 for the forward. So a float32 DTensor weight (or bias) with float16/bfloat16
``hidden`` is cast to ``hidden``'s dtype *before* the gather (half the bytes on the wire), and its
gradient is reduced in float32 (the shard's dtype: FSDP2's ``reduce_dtype=torch.float32``). Every
other dtype mismatch raises as for plain tensors.

Placements: the weight and the bias may be ``Shard(0)`` or ``Replicate()`` on each mesh dimension
(FSDP2, HSDP's ``(Replicate(), Shard(0))``, a replicated DTensor). Anything else (``Partial``,
``Shard(1)``, ``_StridedShard``) raises ``ValueError`` naming the placement. A DTensor ``hidden``
must be ``Replicate()`` everywhere (its local tensor is the whole value); rows split over ranks
(``Shard(0)``) raise, since the token ids and loss inputs of this rank's rows are the caller's.

Caveats:
    * Plain tensors (the unsharded weight inside the module's forward, or any model without FSDP2)
      cost three ``type()`` checks (~0.3 µs); ``torch.distributed.tensor`` is never imported here
      (it costs ~1.5 s): a DTensor can only exist once its module has been imported.
    * Not with ``tp_group``: the vocab-parallel path takes this rank's plain vocabulary shard.
    * The gradient is reduced at every call; FSDP2's ``set_requires_gradient_sync(False)`` and
      ``set_gradient_divide_factor`` do not apply to it.
    * The gathered weight stays alive until the backward (it is saved for it), like FSDP2 with
      ``reshard_after_forward=False``.
"""

from __future__ import annotations

import sys

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_HALF = (torch.float16, torch.bfloat16)


def _dtensor_type() -> type | None:
    """``torch.distributed.tensor.DTensor`` if that module is loaded (else no DTensor exists)."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_dtensor(x: object) -> bool:
    """Whether ``x`` is a ``DTensor`` (cheap for plain tensors and parameters: one type check)."""
    if type(x) in _PLAIN or not isinstance(x, torch.Tensor):
        return False
    cls = _dtensor_type()
    return cls is not None and isinstance(x, cls)


def local_lm_head(
    hidden: object, weight: object, bias: object, *, tp_group: object = None
) -> tuple[object, object, object]:
    """``(hidden, weight, bias)`` with any DTensor among them replaced by a plain local tensor.

    Args:
        hidden: ``[..., H]`` hidden states: a plain tensor, or a DTensor replicated on every mesh
            dimension (its local tensor is used; its gradient is this rank's, replicated).
        weight: ``[V, H]`` LM head: a plain tensor, or a DTensor with ``Shard(0)``/``Replicate()``
            placements, gathered to the full ``[V, H]`` tensor (module docstring: cost, gradient).
        bias: optional ``[V]``, as ``weight``.
        tp_group: the vocab-parallel group of the call: DTensors are not supported with it.

    Returns:
        The three arguments, plain tensors where DTensors were given; the others untouched (plain
        inputs come back as the very same objects).

    Raises:
        ValueError: a DTensor with ``tp_group``; a weight/bias placement other than ``Shard(0)``
            or ``Replicate()``; a DTensor ``hidden`` not replicated on every mesh dimension.
    """
    if type(weight) in _PLAIN and type(hidden) in _PLAIN and (bias is None or type(bias) in _PLAIN):
        return hidden, weight, bias  # the common case, in three type checks
    if not (is_dtensor(hidden) or is_dtensor(weight) or is_dtensor(bias)):
        return hidden, weight, bias
    if tp_group is not None:
        given = [n for n, v in (("hidden", hidden), ("weight", weight), ("bias", bias)) if is_dtensor(v)]
        raise ValueError(
            f"{' and '.join(given)} {'is a DTensor' if len(given) == 1 else 'are DTensors'}, which is "
            "not supported with tp_group: the vocab-parallel path takes plain tensors, weight (and "
            "bias) being this rank's contiguous vocabulary shard (a ColwiseParallel head: pass "
            "weight.to_local()); without tp_group a DTensor weight is gathered to the full [V, H] head"
        )
    if is_dtensor(hidden):
        hidden = _replicated_local(hidden)
    half = hidden.dtype if isinstance(hidden, torch.Tensor) and hidden.dtype in _HALF else None
    if is_dtensor(weight):
        weight = _gathered("weight", weight, half)
    if is_dtensor(bias):
        bias = _gathered("bias", bias, half)
    return hidden, weight, bias


def gather_lm_head(
    weight: torch.Tensor, bias: torch.Tensor | None = None, *, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head as full local tensors, differentiably: each DTensor among ``weight`` and ``bias``
    is all-gathered, its gradient averaged over the mesh and reduce-scattered back to the shards
    (module docstring); plain tensors (and ``None``) come back as the very same objects.

    The public entry (re-exported as ``rlkernel.distributed.gather_lm_head``) for code that needs
    the head's full weight itself, e.g. a model forward that projects its own hidden states:
    ``weight.full_tensor()`` there would keep only this rank's gradient.

    Args:
        weight: ``[V, H]``: a plain tensor, or a DTensor with ``Shard(0)``/``Replicate()`` placements.
        bias: optional ``[V]``, as ``weight``.
        dtype: ``None``, or float16/bfloat16: a float32 DTensor is cast to it before the gather
            (FSDP2's mixed precision; its gradient is reduced in float32). ``None`` keeps the dtype.

    Returns:
        ``(weight [V, H], bias [V] or None)``, plain tensors.

    Raises:
        TypeError: ``weight`` not a tensor, ``bias`` neither a tensor nor None.
        ValueError: a DTensor placement other than ``Shard(0)`` or ``Replicate()``; ``dtype`` not
            None, float16 or bfloat16.
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor (or DTensor), got {type(weight).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor (or DTensor) or None, got {type(bias).__name__}")
    if dtype is not None and dtype not in _HALF:
        raise ValueError(f"dtype must be None, torch.float16 or torch.bfloat16, got {dtype!r}")
    if is_dtensor(weight):
        weight = _gathered("weight", weight, dtype)
    if is_dtensor(bias):
        bias = _gathered("bias", bias, dtype)
    return weight, bias


def _placements(t) -> str:
    return f"({', '.join(map(repr, t.placements))}) on a {t.device_mesh.ndim}-D mesh"


def _replicated_local(hidden):
    """The local tensor of a DTensor ``hidden`` replicated on every mesh dimension."""
    if not all(p.is_replicate() for p in hidden.placements):
        raise ValueError(
            f"hidden is a DTensor with placements {_placements(hidden)}; only Replicate() on every "
            "mesh dimension is supported (the local tensor is then the whole value). Rows split "
            "over ranks: pass hidden.to_local() with the token_ids (and loss inputs) of this rank's rows"
        )
    return hidden.to_local()


def _gathered(name: str, t, half: torch.dtype | None) -> torch.Tensor:
    """The full local tensor of a ``Shard(0)``/``Replicate()`` DTensor, its gradient averaged over
    the mesh and scattered back to the shards; cast to ``half`` first if it is float32 (FSDP2's
    mixed precision; the gradient is reduced in float32)."""
    from torch.distributed.tensor import Partial, Replicate

    bad = [p for p in t.placements if not (p.is_shard(0) or p.is_replicate())]
    if bad:
        raise ValueError(
            f"{name} is a DTensor with placements {_placements(t)}: {bad[0]!r} is not supported; "
            f"{name} must be Shard(0) (FSDP2's fully_shard) or Replicate() on every mesh dimension"
        )
    ndim = t.device_mesh.ndim
    cast = half if t.dtype == torch.float32 and half is not None else None
    full = t.redistribute(placements=[Replicate()] * ndim, forward_dtype=cast)
    return full.to_local(grad_placements=[Partial("avg")] * ndim)
