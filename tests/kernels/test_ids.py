"""kernels.ids.bad_id_stats (Triton interpreter) against a torch reference: the count of bad ids
and the flat index and value of the first one, with and without ignore_index and an active mask,
ids of several dtypes, sizes around the block boundary, and none bad."""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk
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


def masked_reference(ids, mask, ignore_index):
    active = mask != 0
    return torch.where(active, ids.long().clamp_min(-1), ignore_index), active


@pytest.mark.parametrize("n", [1, kernel.BLOCK + 3])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int32, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32, torch.uint8])
def test_masked_ids_match_torch(n, mask_dtype, id_dtype):
    """kernels.ids.masked_ids: active = mask != 0 (NaN counts as active, as in torch), ids int64 with
    negative active ids at -1 and inactive ones at ignore_index, for [B, T] and 1-D inputs."""
    g = torch.Generator().manual_seed(n)
    low = 0 if id_dtype == torch.uint8 else -150
    ids = torch.randint(low, 250, (n,), generator=g).to(id_dtype)
    mask = (torch.rand(n, generator=g) * 3).floor() - 1  # -1, 0, 1
    if mask_dtype.is_floating_point and n > 3:
        mask[3] = float("nan")
    mask = mask.to(mask_dtype)
    for shape in ((n,), (1, n)):
        got_ids, got_active = kernel.masked_ids(ids.view(shape).to(DEVICE), mask.view(shape).to(DEVICE), -100)
        want_ids, want_active = masked_reference(ids.view(shape), mask.view(shape), -100)
        assert got_ids.dtype == torch.int64 and got_active.dtype == torch.bool
        assert torch.equal(got_ids.cpu(), want_ids) and torch.equal(got_active.cpu(), want_active)
    if n > 1:  # both kinds of position present
        assert bool(want_active.any()) and not bool(want_active.all())


def test_masked_ids_empty_and_bad_layout():
    ids, active = kernel.masked_ids(torch.empty(0, 5, dtype=torch.long, device=DEVICE),
                                    torch.empty(0, 5, device=DEVICE), -100)  # fmt: skip
    assert ids.shape == (0, 5) and active.shape == (0, 5)
    x = torch.zeros(4, 6, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous and of one shape"):
        kernel.masked_ids(x.t(), x.t().bool(), -100)
    with pytest.raises(ValueError, match="contiguous and of one shape"):
        kernel.masked_ids(x, x[:2].bool(), -100)


def _spied_kernel_and_inputs(monkeypatch, seed, shape):
    """(launch record, ids, mask): ``kernel.masked_ids`` spied on, random ids (some negative) and a
    bool mask of ``shape`` on the test device."""
    calls = []
    real = kernel.masked_ids
    monkeypatch.setattr(kernel, "masked_ids", lambda *a: calls.append(1) or real(*a))  # seam: spy
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-3, 40, shape, generator=g).to(DEVICE)
    return calls, ids, (torch.rand(shape, generator=g) > 0.4).to(DEVICE)


def _same(got, ids, mask):
    want = masked_reference(ids.cpu(), mask.cpu(), -100)
    return all(torch.equal(a.cpu(), b) for a, b in zip(got, want, strict=True))


def test_masked_token_ids_takes_the_kernel_on_the_triton_backend(monkeypatch):
    """rl.token_loss.masked_token_ids: the kernel where the backend is triton (same values as the
    torch ops), the torch ops for a non-contiguous mask and on the reference backend."""
    from rlkernel.rl.token_loss import masked_token_ids

    calls, ids, mask = _spied_kernel_and_inputs(monkeypatch, 1, (4, 9))
    with rk.use_backend("triton"):
        assert _same(masked_token_ids(ids, mask), ids, mask)
        assert calls == [1]
        assert _same(masked_token_ids(ids, mask.t().contiguous().t()), ids, mask)
        assert calls == [1]
    with rk.use_backend("reference"):
        assert _same(masked_token_ids(ids, mask), ids, mask)
        assert calls == [1]


def test_masked_token_ids_inside_torch_compile_traces_the_torch_ops(monkeypatch):
    """Inside torch.compile(fullgraph=True) the launch would break the graph (the GPU suite's
    compiled fused-loss test caught it): the torch ops are traced instead, same values."""
    from rlkernel.rl.token_loss import masked_token_ids

    calls, ids, mask = _spied_kernel_and_inputs(monkeypatch, 2, (3, 7))
    torch._dynamo.reset()
    with rk.use_backend("triton"):
        got = torch.compile(masked_token_ids, fullgraph=True, backend="eager")(ids, mask)
    assert calls == []
    assert _same(got, ids, mask)


@pytest.mark.parametrize("n", [0, 1, 7, kernel.ROWS_BLOCK, kernel.ROWS_BLOCK + 3, 2 * kernel.ROWS_BLOCK + 5])
@pytest.mark.parametrize("storage", [False, True])
def test_active_rows_match_nonzero(n, storage):
    """``active_rows``: the positions of the non-ignored ids in increasing order (bitwise what
    ``nonzero`` gives), their storage rows ``i + (i // T)·gap``, and the count, across the blocks
    that count their predecessors; ignore_index everywhere and nowhere too."""
    g = torch.Generator().manual_seed(n + storage)
    seq_len, gap = 7, 3
    for fraction in (0.4, 0.0, 1.0):
        ids = torch.randint(0, V, (n,), generator=g)
        ids[torch.rand(n, generator=g) < fraction] = -100
        ids = ids.to(DEVICE)
        out = kernel.active_rows(ids, -100, seq_len, gap, storage=storage)
        want = (ids != -100).nonzero().squeeze(1)
        count = int(out[2 * n if storage else n])
        assert count == want.numel()
        assert torch.equal(out[:count], want)
        if storage:
            assert torch.equal(out[n : n + count], want + (want // seq_len) * gap)


@pytest.mark.parametrize("n", [1, 7, kernel.ROWS_BLOCK + 3, 2 * kernel.ROWS_BLOCK + 5])
@pytest.mark.parametrize("storage", [False, True])
@pytest.mark.parametrize(
    ("id_dtype", "mask_dtype"),
    [(torch.int64, torch.bool), (torch.int32, torch.float32), (torch.uint8, torch.int32),
     (torch.int64, torch.bfloat16)],
)  # fmt: skip
def test_masked_rows_match_the_three_kernels(n, storage, id_dtype, mask_dtype):
    """``masked_rows`` (one launch) against ``masked_ids``' torch reference, ``nonzero`` and the id
    check's reference on fresh random ids (some negative, some >= V) and masks (NaN counts as active,
    as in torch): masked ids and active mask bitwise, the positions, storage rows and count, and the
    bad ids' count and first one (active positions only), for masks with some, no and every
    position active; without the check only the count is compared."""
    g = torch.Generator().manual_seed(n + 10 * storage)
    seq_len, gap = 7, 3
    low = 0 if id_dtype == torch.uint8 else -150
    for fraction in (0.4, 0.0, 1.0):
        ids = torch.randint(low, V + 20, (n,), generator=g).to(id_dtype)
        mask = torch.rand(n, generator=g) * 2 + 0.5  # never 0: active
        mask[torch.rand(n, generator=g) >= fraction] = 0.0
        if mask_dtype.is_floating_point and n > 3 and fraction == 0.4:
            mask[3] = float("nan")  # active, as mask != 0 in torch
        mask = mask.to(mask_dtype)
        for check in (True, False):
            out, active, tail = kernel.masked_rows(ids.to(DEVICE), mask.to(DEVICE), -100, V, seq_len=seq_len,
                                                   gap=gap, storage=storage, check=check)  # fmt: skip
            want_ids, want_active = masked_reference(ids, mask, -100)
            out, active = out.cpu(), active.cpu()
            assert tail == (3 if storage else 2) * n
            assert torch.equal(out[:n], want_ids) and torch.equal(active, want_active)
            want = want_active.nonzero().squeeze(1)
            count = int(out[tail])
            assert count == want.numel()
            assert torch.equal(out[n : n + count], want)
            if storage:
                assert torch.equal(out[2 * n : 2 * n + count], want + (want // seq_len) * gap)
            if check:
                bad, first = reference(ids, V, None, want_active)
                assert int(out[tail + 1]) == bad
                if bad:
                    assert kernel.decode_first(int(out[tail + 2])) == first
                else:
                    assert int(out[tail + 2]) == kernel.NO_BAD_ID
        if fraction == 0.4 and n > 7:  # both kinds of position, and bad active ids, present
            assert 0 < count < n and bad > 0
