"""A trainer's hidden states ``base[:, P - 1:-1]`` (a slice of ``[B, P + T, H]``, not viewable as
``[N, H]``) are read in place by the linear path when padding compaction applies
(``_linear_rows.hidden_rows``), instead of being copied to ``[N, H]`` first: the rows read, the
dhidden rows scattered back and the results must be those of the contiguous copy."""

from __future__ import annotations

import pytest
import torch

from _linear_helpers import autograd_coef_fn
from rlkernel.ops import _linear_function as lf
from rlkernel.ops import _linear_rows as linear_rows

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
B, P, T, H, V = 3, 4, 7, 16, 53


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")


def make(seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, P + T, H, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(V, H, generator=g) * 0.5).to(torch.bfloat16).to(DEVICE)
    ids = torch.randint(0, V, (B, T), generator=g).to(DEVICE)
    ids[0, 5:], ids[2, 2:] = -100, -100  # ragged: padding at the end of two sequences
    return base, w, ids


def test_hidden_rows_reads_a_slice_in_place():
    base, _, ids = make()
    hidden = base[:, P - 1 : -1]
    idx = (ids.reshape(-1) != -100).nonzero().squeeze(1)
    hr = linear_rows.hidden_rows(hidden, idx)
    assert hr.layout.step == P + T
    assert hr.rows.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert torch.equal(hr.rows.index_select(0, hr.index), hidden.reshape(-1, H)[idx])
    dh = torch.zeros(hr.rows.shape, dtype=base.dtype, device=DEVICE)
    dh.index_copy_(0, hr.index, hidden.reshape(-1, H)[idx])
    want = torch.zeros_like(hidden)
    want.reshape(-1, H)[idx] = hidden.reshape(-1, H)[idx]
    assert torch.equal(hr.layout.grad(dh), want)
    # No compaction (every row read): the flattening copy; 2-D and viewable inputs: as they are.
    assert linear_rows.hidden_rows(hidden, None).layout.step == 0
    viewable = linear_rows.hidden_rows(base, idx)
    assert viewable.layout.step == 0 and viewable.index is None
    flat = base.reshape(-1, H)
    assert linear_rows.hidden_rows(flat, idx).rows is flat


@pytest.mark.parametrize("mode", ["triton", "cublas"])
@pytest.mark.parametrize("whole_batch", [None, False])
def test_sliced_hidden_gives_the_contiguous_copys_results(mode, whole_batch):
    import rlkernel as rk

    base, w, ids = make(1)
    coef = torch.randn(B * T, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    sizes = {"chunk_rows": 8, "grad_rows": 8, "whole_batch": whole_batch}

    def run(sliced: bool):
        b, ww = base.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
        hidden = b[:, P - 1 : -1] if sliced else b[:, P - 1 : -1].contiguous()
        with rk.use_options(linear_head_gemm=mode):
            lp, en = lf.linear_token_logprobs_triton(hidden, ww, ids, return_entropy=True, **sizes)
            g_prim = torch.autograd.grad((lp * coef.view(B, T)).sum() + en.sum(), (b, ww))
            coef_fn = autograd_coef_fn(lambda r, logp, e: (coef[r] * logp).sum())
            loss, lp2 = lf.fused_linear_token_loss(hidden, ww, None, ids, coef_fn=coef_fn, **sizes)
            g_fused = torch.autograd.grad(loss, (b, ww))
        return lp, en, g_prim, loss, lp2, g_fused

    got, want = run(True), run(False)
    for a, e in zip(got[:2] + got[3:5], want[:2] + want[3:5], strict=True):
        assert torch.equal(a, e)
    for a, e in zip(got[2] + got[5], want[2] + want[5], strict=True):
        torch.testing.assert_close(a, e, atol=0, rtol=0)
    assert torch.equal(got[2][0][:, : P - 1], torch.zeros_like(got[2][0][:, : P - 1]))  # prompt rows
