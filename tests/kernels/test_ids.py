"""kernels.ids.bad_id_stats (Triton interpreter) against a torch reference: the count of bad ids
and the flat index and value of the first one, with and without ignore_index and an active mask,
ids of several dtypes, sizes around the block boundary, and none bad."""

from __future__ import annotations

import pytest
import torch

from rlkernel.kernels import ids as kernel

from .conftest import DEVICE

V = 50


def reference(ids, vocab, ignore_index, active):
    flat = ids.reshape(-1).long()
    bad = (flat < 0) | (flat >= vocab)
    if ignore_index is not None:
        bad &= flat != ignore_index
    if active is not None:
        bad &= active.reshape(-1)
    where = bad.nonzero().flatten()
    first = (int(where[0]), int(flat[where[0]])) if where.numel() else None
    return int(bad.sum()), first


@pytest.mark.parametrize("n", [1, 7, kernel.BLOCK, kernel.BLOCK + 3, 3 * kernel.BLOCK - 1])
@pytest.mark.parametrize("ignore_index", [None, -100])
@pytest.mark.parametrize("with_active", [False, True])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_bad_id_stats_match_reference(n, ignore_index, with_active, dtype):
    g = torch.Generator().manual_seed(n + (ignore_index or 0) + with_active)
    ids = torch.randint(0, V, (n,), generator=g)
    pick = torch.rand(n, generator=g)
    ids = torch.where(pick < 0.02, V + torch.randint(0, 5, (n,), generator=g), ids)
    ids = torch.where((pick > 0.97), -100, ids)
    ids = torch.where((pick > 0.5) & (pick < 0.51), -3, ids).to(dtype)
    active = torch.rand(n, generator=g) > 0.3 if with_active else None
    on = (lambda t: t.to(DEVICE)) if DEVICE != "cpu" else (lambda t: t)
    stats = kernel.bad_id_stats(on(ids), V, ignore_index, None if active is None else on(active)).tolist()
    count, first = reference(ids, V, ignore_index, active)
    assert stats[0] == count
    if first is None:
        assert stats[1] == kernel.NO_BAD_ID
    else:
        assert kernel.decode_first(stats[1]) == first


def test_no_bad_id_and_empty():
    ids = torch.randint(0, V, (3, 5)).to(DEVICE)
    assert kernel.bad_id_stats(ids, V, None, None).tolist() == [0, kernel.NO_BAD_ID]
    assert kernel.bad_id_stats(ids[:0], V, None, None).tolist() == [0, kernel.NO_BAD_ID]


def test_wild_ids_are_reported_clamped_to_int32():
    ids = torch.tensor([3, 2**40, -(2**40)], device=DEVICE)
    stats = kernel.bad_id_stats(ids, V, None, None).tolist()
    assert stats[0] == 2 and kernel.decode_first(stats[1]) == (1, 2**31 - 1)
