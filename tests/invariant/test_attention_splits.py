"""The two-level (split) softmax of ``rlkernel.invariant.attention`` at tiny sizes.

A row's keys are cut into splits of S keys from its sequence's first real key; each split's state
is the one-level key-block loop from a fresh state, and the splits are merged in order by the
prefill loop and by the split-decode combine alike (``kernels.attention._merge``). Here S = 32
(option ``attention_split_keys``): two interpreter key blocks of 16, four reference key blocks of
8, so sequences of 31 to 100 keys cross split boundaries. Decode steps run both ways
(``attention_split_decode`` "always": split partials + combine; "never": the one-pass kernel)
and must give the prefill's bits: cache lengths just below, at and above multiples of S, left and
right padding, packed streams (decode included), chunked prefill, batch 1 and several, GQA groups
of 2 and 3. Plus: rows with at most S keys keep their one-split bits, accuracy and the saved lse2
against float64, the backward against the reference, NaN reaching exactly the rows that see it
across splits, and bad values of the options.
"""

from __future__ import annotations

import math

import pytest
import torch

import rlkernel as rk
from rlkernel.invariant.attention import attention
from rlkernel.kernels import attention as kern
from rlkernel.reference import attention as ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
S = 32  # the split size of these tests
MODES = ["always", "never"]  # split-decode on / off (same bits by construction)

pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]


@pytest.fixture(autouse=True)
def small_reference_blocks(monkeypatch):
    monkeypatch.setattr(ref, "BLOCK_N", 8)  # seam (test size): several reference key blocks per split


@pytest.fixture(params=["reference", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setenv("RLKERNEL_BACKEND", request.param)
    return request.param


def split(mode: str = "auto", size: int = S):
    return rk.use_options(attention_split_keys=size, attention_split_decode=mode)


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def make_seq(t, hq=4, hkv=2, d=16, dtype=torch.float32, seed=0):
    """q [t, Hq, D], k/v [t, Hkv, D] of one sequence."""
    return randn(t, hq, d, dtype=dtype, seed=seed), *(
        randn(t, hkv, d, dtype=dtype, seed=seed + i) for i in (1, 2)
    )


def pad_batch(seqs, total, side, fill_seed=99):
    """Stack sequences [t, H, D] into [B, total, H, D] with random (not zero) padding."""
    out = []
    for i, s in enumerate(seqs):
        pad = randn(total - s.shape[0], *s.shape[1:], dtype=s.dtype, seed=fill_seed + i)
        out.append(torch.cat([pad, s] if side == "left" else [s, pad]))
    return torch.stack(out)


def oracle(q, k, v, scale, key_start=None):
    """fp64 softmax attention from the definition (padded form, bottom-right causal) and its base-2
    log-sum-exp ``[Hq, B, Tq]``."""
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    kk = k.double().repeat_interleave(hq // hkv, 2)
    vv = v.double().repeat_interleave(hq // hkv, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
    keys = torch.arange(tk, device=q.device)
    hide = (keys[None, :] > (tk - tq + torch.arange(tq, device=q.device))[:, None])[None, None]
    hide = hide.expand(b, 1, tq, tk).clone()
    if key_start is not None:
        hide |= (keys[None, :] < key_start[:, None])[:, None, None, :]
    s = s.masked_fill(hide, -math.inf)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1).nan_to_num(0.0), vv)
    return out, (torch.logsumexp(s, -1) / math.log(2)).permute(1, 0, 2)


# ------------------------------------------------------------------------ decode == prefill
def modes(backend):
    """The split-decode modes to run: both on the kernel; the reference has one path."""
    return MODES if backend == "triton" else ["never"]


def test_decode_at_every_split_edge_equals_prefill(backend):
    """Batch-1 decode against caches of 1 … 100 keys around the split edges (31, 32, 33, 64, 65,
    66, 96, 97 keys), GQA group of 3, both decode paths: every step gives its prefill row."""
    q, k, v = make_seq(100, hq=6, hkv=2, seed=1)
    with split("never"):
        full = attention(q[None], k[None], v[None])[0]
    differ = []
    for mode in modes(backend):
        with split(mode):
            for pos in (0, 30, 31, 32, 63, 64, 65, 95, 96, 99):
                step = attention(q[None, pos : pos + 1], k[None, : pos + 1], v[None, : pos + 1])[0, 0]
                if not torch.equal(step, full[pos]):
                    differ.append((mode, pos))
    assert not differ, f"decode differs from prefill at {differ}"


def test_padded_and_packed_batches_decode_equal_prefill(backend):
    """Sequences of 70, 33 and 31 keys: the right-padded prefill equals each sequence alone and the
    packed prefill; the left-padded batch-3 decode of each one's last two tokens (``key_start``)
    and the packed decode (one query per sequence, ``cu_seqlens``), by both decode paths, equal
    its rows."""
    lens = [70, 33, 31]
    seqs = [make_seq(t, seed=10 * i + 3) for i, t in enumerate(lens)]
    total = max(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE)
    with split("never"):
        prefill = attention(*(pad_batch([s[j] for s in seqs], total, "right") for j in range(3)))
        parts = (torch.cat([s[j] for s in seqs]) for j in range(3))
        packed = attention(*parts, cu_seqlens_q=cu, cu_seqlens_k=cu)
        for i, t in enumerate(lens):
            assert torch.equal(packed[cu[i] : cu[i + 1]], prefill[i, :t])
            assert torch.equal(attention(*(x[None] for x in seqs[i]))[0], prefill[i, :t])
    starts = torch.tensor([total - t for t in lens], device=DEVICE)
    # packed decode: one query per sequence against its own cache of t - 1 keys
    cut = [[x[: t - 1] for x in s] for s, t in zip(seqs, lens, strict=True)]
    cu_q = torch.arange(len(lens) + 1, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor([t - 1 for t in lens]).cumsum(0).tolist()], device=DEVICE)
    qp = torch.stack([c[0][-1] for c in cut])
    kp, vp = (torch.cat([c[j] for c in cut]) for j in (1, 2))
    for mode in modes(backend):
        with split(mode):
            for back in (2, 1):
                cut = [[x[: t - back + 1] for x in s] for s, t in zip(seqs, lens, strict=True)]
                qd, kd, vd = (pad_batch([c[j] for c in cut], total - back + 1, "left") for j in range(3))
                step = attention(qd[:, -1:], kd, vd, key_start=starts)
                for i, t in enumerate(lens):
                    assert torch.equal(step[i, 0], prefill[i, t - back]), (mode, back, i)
            step = attention(qp, kp, vp, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
            for i, t in enumerate(lens):
                assert torch.equal(step[i], prefill[i, t - 2]), (mode, i)


def test_chunked_prefill_and_multi_query_decode_equal_prefill(backend):
    """A prefill in chunks whose edges miss the split edges, and 8 queries at once (positions 60 …
    67: rows spanning two and three splits, combined per row), by both paths, give the one-shot
    prefill's rows."""
    q, k, v = make_seq(80, seed=5)
    with split("never"):
        full = attention(q[None], k[None], v[None])[0]
    for mode in modes(backend):
        with split(mode):
            edges = ((0, 30), (30, 66), (66, 80))
            chunks = [attention(q[None, a:b], k[None, :b], v[None, :b])[0] for a, b in edges]
            assert torch.equal(torch.cat(chunks), full), mode
            rows = attention(q[None, 60:68], k[None, :68], v[None, :68])[0]
            assert torch.equal(rows, full[60:68]), mode


def test_rows_within_one_split_keep_their_bits(backend):
    """S changes only the rows with more than S keys: a row with at most S keys (counted from
    key_start) has the one-split bits, the others the two-level ones, within fp32 rounding of them."""
    q, k, v = (randn(2, 70, 4, 16, seed=20), randn(2, 70, 2, 16, seed=21), randn(2, 70, 2, 16, seed=22))
    starts = torch.tensor([0, 30], device=DEVICE)
    with split(size=S):
        two = attention(q, k, v, key_start=starts)
    with split(size=1 << 30):
        one = attention(q, k, v, key_start=starts)
    assert torch.equal(two[0, :S], one[0, :S])
    assert torch.equal(two[1, : 30 + S], one[1, : 30 + S])
    torch.testing.assert_close(two, one, atol=1e-6, rtol=1e-5)
    assert not torch.equal(two[0, S:], one[0, S:])  # the splits are really merged


def test_split_decode_rule():
    """The "auto" rule: split-decode when some row spans two splits or more and the one-pass grid
    leaves SMs idle (the interpreter counts 4); "always"/"never" force it."""
    cpu = torch.device("cpu")
    assert kern.use_split_decode("auto", 2, 3, cpu)
    assert not kern.use_split_decode("auto", 2, 4, cpu)
    assert not kern.use_split_decode("auto", 1, 1, cpu)
    assert kern.use_split_decode("always", 1, 100, cpu)
    assert not kern.use_split_decode("never", 8, 1, cpu)


# ------------------------------------------------------------------------------- accuracy, lse
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accuracy_against_fp64_with_splits(backend, dtype):
    """A 5-query chunk against 100 keys (both decode paths) and a 70-key prefill, left padding 0
    and 9, GQA: within the usual tolerance of the fp64 definition."""
    atol = 2e-5 if dtype == torch.float32 else 4e-2  # bf16: the interpreter truncates to bf16
    starts = torch.tensor([0, 9], device=DEVICE)
    for tq, tk, mode in ((5, 100, "always"), (5, 100, "never"), (70, 70, "never")):
        if backend == "reference" and mode == "always":
            continue
        q = randn(2, tq, 4, 16, dtype=dtype)
        k, v = randn(2, tk, 2, 16, dtype=dtype, seed=1), randn(2, tk, 2, 16, dtype=dtype, seed=2)
        with split(mode):
            out = attention(q, k, v, key_start=starts, scale=0.3)
        want, _ = oracle(q, k, v, 0.3, starts)
        torch.testing.assert_close(out.double(), want, atol=atol, rtol=atol)


def test_saved_lse_matches_fp64_and_both_paths():
    """The kernel's lse2 (the backward recomputes P from it) after the merges: the fp64 base-2
    log-sum-exp, the same bits from the split-decode and the one-pass kernels, +inf for rows that
    see no key."""
    q, k, v = randn(2, 3, 4, 16, seed=30), randn(2, 90, 2, 16, seed=31), randn(2, 90, 2, 16, seed=32)
    starts = torch.tensor([0, 88], device=DEVICE)  # sequence 1: its first query sees no key
    out, lse = kern.attention_fwd(q, k, v, scale=0.3, key_start=starts, split=S, split_decode="always")
    out2, lse2 = kern.attention_fwd(q, k, v, scale=0.3, key_start=starts, split=S, split_decode="never")
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    want_out, want = oracle(q, k, v, 0.3, starts)
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=2e-5)
    seen = want.reshape(4, 6).isfinite()
    torch.testing.assert_close(lse.double()[seen], want.reshape(4, 6)[seen], atol=1e-5, rtol=1e-5)
    assert bool(lse[~seen].isinf().all()) and bool((lse[~seen] > 0).all())


# ------------------------------------------------------------------------------------ backward
def _grads(fn, q, k, v, g):
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    fn(*leaves).backward(g)
    return [x.grad for x in leaves]


def test_backward_with_splits_matches_reference_and_is_deterministic(monkeypatch):
    """48 keys (two splits), left padding 0 and 6: the kernel's dq, dk, dv against the reference's
    (same splits) and the fp64 definition's autograd, and bitwise equal twice (the backward
    recomputes P from the merged lse2)."""
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")
    q, k, v = randn(2, 48, 4, 16, seed=40), randn(2, 48, 2, 16, seed=41), randn(2, 48, 2, 16, seed=42)
    g = randn(2, 48, 4, 16, seed=43)
    starts = torch.tensor([0, 6], device=DEVICE)

    def ours(a, b, c):
        return attention(a, b, c, key_start=starts)

    def reference(a, b, c):
        return ref.attention(a, b, c, key_start=starts, split_keys=S)

    def exact(a, b, c):
        return oracle(a, b, c, 0.25, starts)[0]

    with split():
        got, again = _grads(ours, q, k, v, g), _grads(ours, q, k, v, g)
    want = _grads(reference, q, k, v, g)
    best = _grads(exact, q.double(), k.double(), v.double(), g.double())
    for a, w, e in zip(got, want, best, strict=True):
        assert (a - w).norm() <= 1e-4 * w.norm()
        assert (a.double() - e).norm() <= 1e-4 * e.norm()
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))
    assert torch.equal(got[1][1, :6], torch.zeros_like(got[1][1, :6]))  # keys before key_start


# --------------------------------------------------------------------------------- non-finite
@pytest.mark.parametrize("pos", [5, 40])  # a NaN value in the first split, in the second
def test_nan_value_reaches_exactly_the_rows_that_see_it_across_splits(backend, pos):
    """A NaN in one value row at key ``pos``: the prefill and decode rows before it are exact, every
    row from it on (later splits included) is NaN in the q heads that read it, by both decode
    paths; the other kv head's rows keep their bits."""
    q, k, v = make_seq(80, seed=50)
    v2 = v.clone()
    v2[pos, 1, 7] = float("nan")
    with split("never"):
        want = attention(q[None], k[None], v[None])[0]
        got = attention(q[None], k[None], v2[None])[0]
    assert torch.equal(got[:pos], want[:pos])
    assert torch.equal(got[:, :2], want[:, :2])  # q heads 0, 1 read kv head 0
    assert bool(got[pos:, 2:].isnan().all())  # q heads 2, 3 read kv head 1
    for mode in modes(backend):
        with split(mode):
            for p in (pos - 1, pos, 79):
                step = attention(q[None, p : p + 1], k[None, : p + 1], v2[None, : p + 1])[0, 0]
                assert torch.equal(step[:2], want[p, :2]), (mode, p)
                if p < pos:
                    assert torch.equal(step, want[p]), (mode, p)
                else:
                    assert bool(step[2:].isnan().all()), (mode, p)


# ---------------------------------------------------------------------------------- bad input
def test_bad_split_options(backend):
    """A split size that is not a multiple of the backend's key block, or not a positive int, and
    an unknown split-decode mode: ValueError naming the option."""
    q, k, v = (x[None] for x in make_seq(40))
    with split(size=20), pytest.raises(ValueError, match="attention_split_keys"):
        attention(q, k, v)  # not a multiple of 16 (interpreter) nor of 8 (reference)
    for bad in (0, -32, True, 32.0, 1 << 31):
        with pytest.raises(ValueError, match="attention_split_keys"):
            with rk.use_options(attention_split_keys=bad):
                pass
    with pytest.raises(ValueError, match="attention_split_decode"):
        with rk.use_options(attention_split_decode="sometimes"):
            pass
    with pytest.raises(ValueError, match="attention_split_decode"):
        kern.attention_fwd(q, k, v, scale=0.25, split_decode="sometimes")
