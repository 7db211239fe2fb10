"""The sequence-ratio loss from logits with its plan built on the device: three launches forward.

:class:`DeviceSeqPlanLossFunction` runs a :class:`rlkernel._token_loss_plan.DeviceSeqPlan` (gspo,
gspo_token or gmpo in closed form over a padded ``[S, T]`` batch) through
:func:`rlkernel.kernels.seq_plan.seq_plan_forward` (mask counts; one program per row: masked id, id
check, log-prob statistics; one program per sequence: the closed form's coefficients and loss), and
its backward is the token-level device plan's (:class:`rlkernel.ops.device_plan_loss.
DevicePlanLossFunction`: one gradient launch, over the base's rows for a row window of a model
output). The id check is deferred as there: the last sequence program writes its result into
pinned host memory (CUDA), or it is read at once (the CPU interpreter).
"""

from __future__ import annotations

import torch

from rlkernel.kernels.seq_plan import seq_plan_forward
from rlkernel.ops._logprobs_function import _base_and_window
from rlkernel.ops.device_plan_loss import DevicePlanLossFunction, three_pass_forward


class DeviceSeqPlanLossFunction(DevicePlanLossFunction):
    """Three passes over the logits: forward = mask counts + the rows kernel + the sequence kernel;
    backward = :class:`DevicePlanLossFunction`'s (the same saved tensors)."""

    @staticmethod
    def forward(ctx, logits, plan, temperature, inplace_backward, window, what):
        return three_pass_forward(
            ctx, _seq_forward, logits, plan, temperature, inplace_backward, window, what
        )


def _seq_forward(x, plan, temperature, layout, host):
    return seq_plan_forward(x, plan, temperature=temperature, row_layout=layout, host=host)


def seq_loss_device_plan(
    logits: torch.Tensor,
    plan,
    *,
    temperature: float,
    inplace_backward: bool,
    what: str = "token_ids (at active mask positions)",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, logp, entropy)`` of a device-built sequence-ratio loss (``plan``: a
    :class:`rlkernel._token_loss_plan.DeviceSeqPlan` of the logits' ``[S, T]`` tokens); ``logp`` and
    ``entropy`` fp32 ``[S·T]`` (``entropy`` empty without an entropy term), not differentiable.

    Args:
        logits: ``[S, T, V]`` (any layout the kernels read; a window of a base that requires grad
            gives the base's gradient directly, as ``token_logprobs`` does).
        inplace_backward: the backward writes the gradient into the logits' storage.
        what: the argument the deferred id check's error names.
    """
    base, window = _base_and_window(logits)
    inplace = bool(inplace_backward)
    return DeviceSeqPlanLossFunction.apply(base, plan, float(temperature), inplace, window, what)
