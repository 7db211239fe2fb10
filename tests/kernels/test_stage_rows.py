"""kernels.stage_rows (Triton interpreter on CPU) against the torch ops it replaces in the linear
path's staging (``index_select`` / ``copy_``, ``masked_fill_`` of ignored rows, ``zero_`` and
``fill_`` of the padded tail): bitwise, NaN rows at ignored positions included."""

from __future__ import annotations

import pytest
import torch

from rlkernel.kernels import stage_rows as kernel

from .conftest import DEVICE

IGNORE = -100


def reference(hidden, ids, start, n, m, hidden_index, row_index, zero_ignored, h_out, ids_out):
    h_out, ids_out = h_out.clone(), ids_out.clone()
    if hidden_index is None:
        h_out[:n] = hidden[start : start + n]
        ids_out[:n] = ids[start : start + n]
    else:
        h_out[:n] = hidden.index_select(0, hidden_index[start : start + n])
        ids_out[:n] = ids.index_select(0, row_index[start : start + n])
    if zero_ignored:
        h_out[:n].masked_fill_((ids_out[:n] == IGNORE)[:, None], 0)
    h_out[n:m] = 0
    ids_out[n:m] = IGNORE
    return h_out, ids_out


@pytest.mark.parametrize("hdim", [0, 24, 1030])
@pytest.mark.parametrize("indexed", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_stage_rows_is_bitwise_the_torch_ops(hdim, indexed, dtype):
    g = torch.Generator().manual_seed(hdim + indexed)
    rows = 40
    base = torch.randn(rows, hdim + 5, generator=g).to(dtype)
    hidden = base[:, 2 : 2 + hdim]  # a row pitch other than H
    ids = torch.randint(0, 50, (rows,), generator=g)
    ignored = torch.rand(rows, generator=g) < 0.3
    ids[ignored] = IGNORE
    hidden[ignored] = float("nan")  # garbage at ignored positions must not reach the buffer
    hidden, ids = hidden.to(DEVICE), ids.to(DEVICE)
    hidden_index = row_index = None
    if indexed:  # compaction: the active rows only, their storage rows in reversed order (any index)
        row_index = (ids != IGNORE).nonzero().squeeze(1)
        hidden_index = row_index.flip(0).contiguous()
    for start, n, m in ((0, 11, 16), (3, 8, 8), (5, 0, 4), (0, 0, 0)):
        h_out = torch.full((16, hdim), 7.0, dtype=dtype, device=DEVICE)
        ids_out = torch.full((16,), 3, dtype=torch.int64, device=DEVICE)
        want = reference(hidden, ids, start, n, m, hidden_index, row_index, not indexed, h_out, ids_out)
        kernel.stage_rows_unchecked(h_out, ids_out, hidden, ids, start, n, m, IGNORE, hidden_index,
                                    row_index, zero_ignored=not indexed)  # fmt: skip
        assert torch.equal(ids_out, want[1])
        # bitwise, NaN included (the rows staged from NaN hidden states, when not zeroed)
        assert torch.equal(h_out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want[0].view(torch.int16 if dtype == torch.bfloat16 else torch.int32))  # fmt: skip
