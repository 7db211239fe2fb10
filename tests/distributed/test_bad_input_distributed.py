"""Bad input to the public functions of ``rlkernel.distributed`` (docs/api/distributed.md), in one
process: a TypeError/ValueError naming the argument, raised before (or instead of) any work.

The cross-rank cases (one rank's bad shard makes every rank raise) run in several processes in
tests/distributed/test_vocab_parallel.py; here a one-rank gloo group stands in for the group.
"""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk
from rlkernel.distributed import gather_lm_head, global_normalizers, vocab_parallel_linear_token_logprobs

COVERED = [vocab_parallel_linear_token_logprobs, rk.global_normalizers, gather_lm_head]

N, V, H = 3, 5, 4




def _vp_args(**changes):
    g = torch.Generator().manual_seed(0)
    args = dict(
        hidden=torch.randn(N, H, generator=g),
        weight=torch.randn(V, H, generator=g),
        token_ids=torch.randint(0, V, (N,), generator=g),
    )
    args.update(changes)
    return args


@pytest.mark.parametrize("group", [object(), "world", None])
def test_vocab_parallel_group_must_be_a_process_group(group):
    args = _vp_args()
    with pytest.raises(TypeError, match="tp_group must be a torch.distributed ProcessGroup"):
        vocab_parallel_linear_token_logprobs(**args, tp_group=group)


VP_CASES = {
    "weight not [V_r, H]": (dict(weight=torch.randn(V, H - 1)), "weight"),
    "id outside the global vocabulary": (dict(token_ids=torch.tensor([0, V + 2, 1])), r"outside \[0, 5\)"),
    "chunk_rows 0": (dict(chunk_rows=0), "chunk_rows must be > 0"),
    "temperature < 0": (dict(temperature=-1.0), "temperature"),
}


@pytest.mark.parametrize("case", list(VP_CASES))
def test_vocab_parallel_bad_input(one_rank_group, case):
    changes, match = VP_CASES[case]
    with pytest.raises(ValueError, match=match):
        vocab_parallel_linear_token_logprobs(**_vp_args(**changes), tp_group=one_rank_group)


GN_CASES = {
    "empty list": (dict(mask=[]), ValueError, "non-empty list of micro-batch masks"),
    "mask not a tensor": (dict(mask=[[1, 0]]), TypeError, r"mask\[0\] must be a torch.Tensor"),
    "1-D mask without cu_seqlens": (dict(mask=torch.ones(3)), ValueError, r"mask must be \[B, T\]"),
    "3-D mask": (dict(mask=torch.ones(2, 3, 4)), ValueError, r"mask must be \[B, T\]"),
    "cu_seqlens list length": (
        dict(mask=[torch.ones(3), torch.ones(3)], cu_seqlens=[torch.tensor([0, 3])]),
        ValueError,
        "cu_seqlens has 1 entries for 2 masks",
    ),
    "group not a process group": (dict(mask=torch.ones(2, 3), group="dp"), TypeError, "group must be"),
}


@pytest.mark.parametrize("case", list(GN_CASES))
def test_global_normalizers_bad_input(case):
    kwargs, error, match = GN_CASES[case]
    with pytest.raises(error, match=match):
        global_normalizers(**kwargs)


def test_gather_lm_head_bad_input(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    w = torch.randn(V, H)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        gather_lm_head(w.tolist())
    with pytest.raises(TypeError, match="bias must be a torch.Tensor .* or None"):
        gather_lm_head(w, bias=[0.0] * V)
    with pytest.raises(ValueError, match="dtype must be None, torch.float16 or torch.bfloat16"):
        gather_lm_head(w, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (1,))
    with pytest.raises(ValueError, match=r"weight is a DTensor .*Partial\(sum\) is not supported"):
        gather_lm_head(DTensor.from_local(w, mesh, [Partial()]))
