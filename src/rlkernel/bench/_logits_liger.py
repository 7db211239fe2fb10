"""Liger-Kernel's ops bound to the ``logits`` suite's inputs, as their users call them.

Liger takes contiguous causal-LM logits ``[B, L+1, V]`` and drops the last position itself
(``GrpoLossFunction`` asserts contiguity). On the contiguous workloads it gets its own ``[B, T+1, V]``
copy whose first T positions are everyone else's logits; on the sliced ones (the users' layout) the
whole model output ``[B, P+T, V]``, no copy, with its per-token tensors ``[B, P+T-1]`` prepended by
the P-1 prompt positions and the mask 0 there (:func:`rlkernel.bench._logits_inputs.prompt_extended`):
its kernels skip masked rows in forward and write them zero gradients, so its gradient is the
model output's, as everyone's. See :mod:`rlkernel.bench.logits` for the rest of the method.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlkernel.bench._logits_baselines import (
    LIGER_TENSOR_ARGS,
    TEMPERATURE,
    LossSpec,
    _liger,
    liger_grpo_args,
    liger_loss_kwargs,
)
from rlkernel.bench._logits_inputs import SEED, Kind, liger_logits, prompt_extended
from rlkernel.bench.suite import Call, CallResult, Skip


def liger_logprob_call(inputs: list[dict], device: torch.device, notes: dict) -> Call | Skip:
    """``fused_selective_log_softmax`` (forward only) on each contiguous input set's own
    ``[B, T+1, V]`` copy; Skip where Liger cannot run."""
    mod, why = _liger(device)
    if mod is None:
        return Skip(why)
    for inp in inputs:
        inp["liger_logits"] = liger_logits(inp["logits"], inp["b"], inp["t"], SEED + 7)
        inp["liger_ids"] = inp["ids"].reshape(inp["b"], inp["t"])

    def liger_fwd(i: int) -> CallResult:
        inp = inputs[i % len(inputs)]
        out = mod.fused_selective_log_softmax(inp["liger_logits"], inp["liger_ids"], TEMPERATURE)
        return CallResult((out.reshape(-1),))

    notes["liger"] = "fused_selective_log_softmax on [B, T+1, V] (forward only, no grad)"
    return liger_fwd



def liger_loss_call(kind: Kind, spec: LossSpec, inputs: list[dict], device: torch.device, notes: dict,
                     bind: Callable[..., Call]) -> Call | Skip:  # fmt: skip
    """Liger's ``GrpoLossFunction`` configured for ``spec``, bound to what it takes (see the module
    docstring): sliced, the whole model output and prompt-extended per-token tensors; contiguous,
    its own ``[B, T+1, V]`` copy."""
    mod, why = _liger(device)
    try:
        liger_kwargs = liger_loss_kwargs(spec)
        if mod is not None:  # fail here, not in every call, if this Liger lacks a parameter
            liger_grpo_args(mod.GrpoLossFunction, **dict.fromkeys(LIGER_TENSOR_ARGS), **liger_kwargs)
    except ValueError as exc:
        mod, why = None, str(exc)
    if mod is None:
        return Skip(why)
    use_ref = bool(spec.kl_coef)
    for inp in inputs:
        if kind.sliced:
            p = inp["p"]
            logits = inp["base"]
            per_token = {
                "old_logp": prompt_extended(inp["old_logp"], p, 0.0),
                "ref_logp": prompt_extended(inp["ref_logp"], p, 0.0) if use_ref else None,
                "completion_ids": prompt_extended(inp["ids"], p, 0),
                "completion_mask": prompt_extended(inp["mask"].to(torch.int32), p, 0),
            }
        else:
            logits = liger_logits(inp["logits"].detach(), inp["b"], inp["t"], SEED + 7).requires_grad_(True)
            inp["liger_logits"] = logits
            per_token = {
                "old_logp": inp["old_logp"],
                "ref_logp": inp["ref_logp"] if use_ref else None,
                "completion_ids": inp["ids"],
                "completion_mask": inp["mask"].to(torch.int32),
            }
        inp["liger_args"] = liger_grpo_args(
            mod.GrpoLossFunction, logits=logits, advantages=inp["adv_seq"], **per_token, **liger_kwargs
        )

    def liger_loss(inp: dict) -> torch.Tensor:
        return mod.GrpoLossFunction.apply(*inp["liger_args"])[0]  # (loss, kl_mean, clip_ratio)

    kw = liger_kwargs
    what = (
        f"GrpoLossFunction loss_type={kw['loss_type']} importance_sampling_level="
        f"{kw['importance_sampling_level']} beta={kw['beta']:g}, inplace=False"
        + (f"; no dual clip (c={spec.dual_clip:g} binds only where r > c)" if spec.dual_clip else "")
    )
    if kind.sliced:
        notes["liger"] = f"{what}; on the whole output [B, P+T, V], prompt positions masked"
        return bind(liger_loss)  # the gradient of the model output, as everyone's
    notes["liger"] = f"{what}; on a [B, T+1, V] copy"
    return bind(liger_loss, target="liger_logits", grad_view=lambda g, inp: g[:, : inp["t"]])
