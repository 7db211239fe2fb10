"""Bad input to the ``PolicyLossOutput`` constructor (public through ``rlkernel.__all__``): exactly one
of ``metrics`` and ``compute_metrics`` is required, else a TypeError saying so."""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk

COVERED = [rk.PolicyLossOutput]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(metrics={"clip_frac": torch.tensor(0.0)}, compute_metrics=lambda: {}),
    ],
    ids=["neither", "both"],
)
def test_policy_loss_output_needs_exactly_one_metrics_source(kwargs):
    with pytest.raises(TypeError, match="exactly one of metrics or compute_metrics"):
        rk.PolicyLossOutput(torch.tensor(0.5), **kwargs)


def test_policy_loss_output_accepts_either_source():
    loss = torch.tensor(0.5)
    assert rk.PolicyLossOutput(loss, {"m": torch.tensor(1.0)}).metrics["m"] == 1.0
    assert rk.PolicyLossOutput(loss, compute_metrics=lambda: {"m": torch.tensor(2.0)}).metrics["m"] == 2.0
