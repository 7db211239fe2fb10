"""The input checks the log-prob primitives share (and ``fused_policy_loss`` and the
vocab-parallel path call once, up front): ``TypeError``/``ValueError`` naming the argument."""

from __future__ import annotations

import torch

from rlkernel import _validate as check


def check_common(
    name: str,
    x: torch.Tensor,
    token_ids: object,
    temperature: float,
    ignore_index: int,
    *,
    ids_checked: bool = False,
) -> torch.Tensor:
    """The checks both primitives make of ``token_ids`` (int, the leading shape and device of
    ``x``), ``temperature`` and ``ignore_index``; returns the ids. ``ids_checked``: the caller
    already checked that ``token_ids`` is an int tensor (each input is checked once)."""
    ids = token_ids if ids_checked else check.int_tensor("token_ids", token_ids)
    check.same_shape("token_ids", ids, f"{name}.shape[:-1]", x.shape[:-1])
    check.same_device("token_ids", ids, name, x.device)
    # In float32's normal range, as the config's fields: the logits are divided by it in float32.
    check.fp32_float("temperature", check.positive_float("temperature", temperature), positive=True)
    check.integer("ignore_index", ignore_index)
    return ids


def check_linear_inputs(
    hidden: object,
    weight: object,
    token_ids: object,
    bias: object,
    temperature: float,
    ignore_index: int,
    *,
    shard: bool = False,
    ids_checked: bool = False,
) -> torch.Tensor:
    """The checks of :func:`linear_token_logprobs` (all but the id range); returns the int ids.
    ``shard``: ``weight`` is this rank's vocabulary shard (the vocab-parallel path's wording);
    ``ids_checked``: as :func:`check_common`'s."""
    check.float_tensor("hidden", hidden, min_dim=1)
    check.float_tensor("weight", weight)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        what = "weight (this rank's vocabulary shard) must be [V_r, H]" if shard else "weight must be [V, H]"
        raise ValueError(
            f"{what} with H = hidden.shape[-1] = {hidden.shape[-1]}, got {check.describe(weight)}"
        )
    if weight.shape[0] < 1:
        why = " (every tensor-parallel rank must own a non-empty shard)" if shard else ""
        raise ValueError(f"weight must have at least one vocabulary row{why}, got {check.describe(weight)}")
    check.same_device("weight", weight, "hidden", hidden.device)
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must match hidden dtype {hidden.dtype}")
    if bias is not None:
        check.float_tensor("bias", bias)
        check.same_shape("bias", bias, "weight.shape[:1]", weight.shape[:1])
        check.same_device("bias", bias, "hidden", hidden.device)
    return check_common("hidden", hidden, token_ids, temperature, ignore_index, ids_checked=ids_checked)
