"""ops._dweight_accum.DweightAccumulator: the grouped loop's fp32 dweight accumulator in two parts,
cast at the end into the first part's own bytes (the returned gradient holds no more memory than a
16-bit gradient), against the plain fp32 sum cast once."""

from __future__ import annotations

import pytest
import torch

from rlkernel.ops import _dweight_accum as da


def _filled(acc: da.DweightAccumulator, full: torch.Tensor) -> None:
    for cols, part in acc.parts:
        part.copy_(full if cols is None else full[cols])


@pytest.mark.parametrize("v", [9, 10, 53, 61, 200])
def test_split_parts_cover_the_rows_and_top_holds_the_16bit_gradient(v):
    h = 12
    acc = da.DweightAccumulator(torch.empty(v, h, dtype=torch.bfloat16), "fp32")
    assert acc.dtype == torch.float32
    (c0, top), (c1, bottom) = acc.parts
    assert c0 == slice(0, c1.start) and c1.stop == v and top.shape == (c1.start, h)
    assert bottom.shape == (v - c1.start, h) and c1.start < v
    assert c1.start % da.SPLIT_ROW_MULTIPLE == 0 or c1.start == -(-v // 2)
    assert top.untyped_storage().nbytes() >= v * h * 2  # top's bytes take the whole bf16 gradient


@pytest.mark.parametrize("v", [1, 2, 8])
def test_rows_within_one_aligned_half_are_one_part(v):
    acc = da.DweightAccumulator(torch.empty(v, 4, dtype=torch.bfloat16), "fp32")
    assert [c for c, _ in acc.parts] == [None]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [None, 0.37])
def test_finish_is_the_fp32_sum_cast_once_in_top_s_bytes(dtype, scale, monkeypatch):
    monkeypatch.setattr(da, "CAST_SLAB_BYTES", 3 * 4 * 16)  # seam: a memory bound, several slabs
    g = torch.Generator().manual_seed(1)
    v, h = 61, 16
    full = torch.randn(v, h, generator=g) * 3
    acc = da.DweightAccumulator(torch.empty(v, h, dtype=dtype), "fp32")
    _filled(acc, full)
    top = acc.parts[0][1]
    s = None if scale is None else torch.tensor(scale, dtype=torch.float32)
    expect = (full if s is None else full * s).to(dtype)
    copy = None if s is None else acc.scaled_copy(s)  # a retained graph's copy keeps the parts
    out = acc.finish(s)
    assert out.dtype == dtype and out.shape == (v, h)
    assert torch.equal(out, expect)
    if copy is not None:
        assert torch.equal(copy, expect)
    assert out.untyped_storage().data_ptr() == top.untyped_storage().data_ptr()
    assert out.untyped_storage().nbytes() == top.untyped_storage().nbytes() < v * h * 4
    assert acc.parts == []  # spent: bottom released


def test_same_dtype_accumulator_is_one_part_scaled_in_place():
    g = torch.Generator().manual_seed(2)
    w = torch.empty(10, 8, dtype=torch.bfloat16)
    acc = da.DweightAccumulator(w, "weight")
    assert [(c, p.dtype) for c, p in acc.parts] == [(None, torch.bfloat16)]
    full = torch.randn(10, 8, generator=g).bfloat16()
    _filled(acc, full)
    part = acc.parts[0][1]
    s = torch.tensor(0.5)
    out = acc.finish(s)
    assert out.data_ptr() == part.data_ptr() and torch.equal(out, (full.float() * 0.5).bfloat16())
    acc32 = da.DweightAccumulator(torch.empty(10, 8), "fp32")  # fp32 weight: one fp32 part
    _filled(acc32, full.float())
    assert torch.equal(acc32.finish(), full.float())


def test_zero_clears_every_part():
    acc = da.DweightAccumulator(torch.empty(20, 4, dtype=torch.bfloat16), "fp32")
    _filled(acc, torch.ones(20, 4))
    acc.zero_()
    assert all(p.abs().sum() == 0 for _, p in acc.parts)
    assert torch.equal(acc.finish(), torch.zeros(20, 4, dtype=torch.bfloat16))
