"""Bad input to ``rlkernel.invariant``: a clear ``ValueError``/``TypeError`` naming the argument, never
uninitialised memory, an out-of-bounds read or a silently different answer; NaN/Inf propagate only to
the rows that see them (DESIGN.md, "Bad input").

Attention cases run on both backends (``reference`` and ``triton``, the latter in the CPU interpreter
without a GPU): both must reject the same inputs. Every input is random (no zeros), so that a kernel
reading memory it should not cannot pass by accident.
"""

from __future__ import annotations

import pytest
import torch

import rlkernel.invariant as inv
from rlkernel.invariant import attention
from rlkernel.reference import attention as ref

COVERED = [
    inv.attention,
    inv.linear,
    inv.matmul,
    inv.patch_hf_model,
    inv.rms_norm,
    inv.unpatch_hf_model,
]

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]


@pytest.fixture(autouse=True)
def small_reference_blocks(monkeypatch):
    monkeypatch.setattr(ref, "BLOCK_N", 8)  # several key blocks in short test sequences


@pytest.fixture(params=["reference", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setenv("RLKERNEL_BACKEND", request.param)
    return request.param


def randn(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def packed_qkv(n_q=9, n_k=9, hq=2, hkv=1, d=16, seed=0):
    return randn(n_q, hq, d, seed=seed), randn(n_k, hkv, d, seed=seed + 1), randn(n_k, hkv, d, seed=seed + 2)


def cu(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


# ------------------------------------------------------------------ attention: packed size hints
@pytest.mark.parametrize("max_seqlen_q", [4, 1, 0, -1])
def test_attention_max_seqlen_q_below_the_longest_sequence_raises(backend, max_seqlen_q):
    q, k, v = packed_qkv()
    c = cu(0, 4, 9)  # the longest query sequence has 5 rows
    with pytest.raises(ValueError, match=r"max_seqlen_q must be >= the longest query sequence .*\(5\)"):
        attention(q, k, v, cu_seqlens_q=c, cu_seqlens_k=c, max_seqlen_q=max_seqlen_q)


def test_attention_max_seqlen_q_valid_hints_give_the_same_bits(backend):
    q, k, v = packed_qkv(seed=3)
    c = cu(0, 4, 9)
    want = attention(q, k, v, cu_seqlens_q=c, cu_seqlens_k=c)
    assert not want.isnan().any()
    for hint in (5, 6, 40):  # exact, and any larger bound
        assert torch.equal(attention(q, k, v, cu_seqlens_q=c, cu_seqlens_k=c, max_seqlen_q=hint), want)


def test_attention_max_seqlen_q_wrong_type_or_form_raises(backend):
    q, k, v = packed_qkv()
    c = cu(0, 4, 9)
    with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
        attention(q, k, v, cu_seqlens_q=c, cu_seqlens_k=c, max_seqlen_q=5.0)
    with pytest.raises(ValueError, match="max_seqlen_q applies to the packed form only"):
        attention(q[None], k[None], v[None], max_seqlen_q=9)


@pytest.mark.parametrize(
    ("cu_q", "cu_k", "match"),
    [
        ((-2, 4, 9), (0, 4, 9), "cu_seqlens_q must start at 0, got -2"),
        ((0, 4, 9), (0, -1, 9), "cu_seqlens_k must be non-decreasing"),
        ((0, 6, 4, 9), (0, 6, 7, 9), "cu_seqlens_q must be non-decreasing"),
        ((0, 4, 8), (0, 4, 9), "cu_seqlens_q must end at the packed length 9, got 8"),
        ((0, 4, 9), (0, 4, 12), "cu_seqlens_k must end at the packed length 9, got 12"),
        ((0, 4, 9), (0, 5, 9), "sequence 1 has 5 queries and 4 keys"),
        ((0, 9), (0, 4, 9), "same number of sequences"),
    ],
)
def test_attention_bad_cu_seqlens_raise(backend, cu_q, cu_k, match):
    q, k, v = packed_qkv()
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, cu_seqlens_q=cu(*cu_q), cu_seqlens_k=cu(*cu_k))


def test_attention_cu_seqlens_wrong_dtype_or_shape_raise(backend):
    q, k, v = packed_qkv()
    c = cu(0, 4, 9)
    with pytest.raises(TypeError, match="cu_seqlens_q must be an integer tensor"):
        attention(q, k, v, cu_seqlens_q=c.float(), cu_seqlens_k=c)
    with pytest.raises(ValueError, match="cu_seqlens_k must be 1-D"):
        attention(q, k, v, cu_seqlens_q=c, cu_seqlens_k=c[None])


# -------------------------------------------------------------------------- attention: key_start
@pytest.mark.parametrize("starts", [(-3, 0), (0, -1), (2, 6), (7, 1)])
def test_attention_key_start_out_of_range_raises(backend, starts):
    q, k, v = randn(2, 4, 2, 16), randn(2, 5, 1, 16, seed=1), randn(2, 5, 1, 16, seed=2)
    bad = torch.tensor(starts, device=DEVICE)
    i = next(j for j, s in enumerate(starts) if not 0 <= s <= 5)
    match = rf"key_start must be in \[0, Tk\] = \[0, 5\] .* got {starts[i]} at batch index {i}"
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, key_start=bad)


def test_attention_key_start_edges_are_valid(backend):
    q, k, v = randn(2, 4, 2, 16, seed=5), randn(2, 5, 1, 16, seed=6), randn(2, 5, 1, 16, seed=7)
    out = attention(q, k, v, key_start=torch.tensor([5, 0], device=DEVICE))  # Tk: all padding
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(out[1], attention(q[1:], k[1:], v[1:])[0])


def test_attention_unvalidated_key_start_gives_nan_rows_not_out_of_bounds_reads(backend):
    """validate=False skips the host check; the kernel (and the reference) must still never read a
    key outside the sequence: the bad sequence's rows are NaN, the others unchanged."""
    q, k, v = randn(3, 4, 2, 16, seed=8), randn(3, 6, 1, 16, seed=9), randn(3, 6, 1, 16, seed=10)
    starts = torch.tensor([-3, 2, 9], device=DEVICE)
    out = attention(q, k, v, key_start=starts, validate=False)
    assert bool(out[0].isnan().all()) and bool(out[2].isnan().all())
    want = attention(q[1:2], k[1:2], v[1:2], key_start=starts[1:2])
    assert torch.equal(out[1], want[0])
