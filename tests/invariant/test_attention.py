"""rlkernel.invariant.attention: batch invariance (torch.equal), accuracy, backward, bad input.

Every invariance test runs under both backends: ``reference`` (the CPU path of a patched model) and
``triton`` (the kernels; in the CPU interpreter without a GPU, so sizes stay tiny). A sequence is
scored in several compositions (batch sizes, padding sides and amounts, packed, chunked prefill,
token-by-token decode) and its rows must be bitwise equal.
"""

import math

import pytest
import torch

from rlkernel.invariant.attention import attention
from rlkernel.kernels import attention as kern
from rlkernel.reference import attention as ref

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

# (atol, rtol) of the output against the fp64 softmax-attention oracle on the same input values:
# the output is rounded once to the input dtype and, in the kernel, P is rounded to it before P·V.
TOLERANCES = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}

pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]


# The reference's production key block, read before the autouse fixture below shrinks it.
PRODUCTION_BLOCK_N = ref.BLOCK_N


@pytest.fixture(autouse=True)
def small_reference_blocks(monkeypatch):
    # Tiny reference key blocks so that the short test sequences span several of them (the kernel's
    # interpreter BLOCK_N is 16, its GPU one 32-64).
    monkeypatch.setattr(ref, "BLOCK_N", 8)  # seam: test size: the reference's key block


@pytest.fixture(params=["reference", "triton"])
def backend(request, monkeypatch):
    monkeypatch.setenv("RLKERNEL_BACKEND", request.param)
    return request.param


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def make_seq(t, hq=4, hkv=2, d=16, dtype=torch.float32, seed=0):
    """q [t, Hq, D], k/v [t, Hkv, D] of one sequence."""
    return randn(t, hq, d, dtype=dtype, seed=seed), *(
        randn(t, hkv, d, dtype=dtype, seed=seed + i) for i in (1, 2)
    )


def oracle(q, k, v, scale=None, key_start=None):
    """fp64 softmax attention from the definition (padded form, bottom-right causal)."""
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    kk = k.double().repeat_interleave(hq // hkv, 2)
    vv = v.double().repeat_interleave(hq // hkv, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
    qpos = tk - tq + torch.arange(tq, device=q.device)
    keys = torch.arange(tk, device=q.device)
    hide = keys[None, :] > qpos[:, None]
    hide = hide[None, None].expand(b, 1, tq, tk).clone()
    if key_start is not None:
        hide |= (keys[None, :] < key_start[:, None])[:, None, None, :]
    s = s.masked_fill(hide, -math.inf)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1).nan_to_num(0.0), vv)
    return out


def pad_batch(seqs, total, side, fill_seed=99):
    """Stack sequences [t, H, D] into [B, total, H, D] with random (not zero) padding."""
    out = []
    for i, s in enumerate(seqs):
        pad = randn(total - s.shape[0], *s.shape[1:], dtype=s.dtype, seed=fill_seed + i)
        out.append(torch.cat([pad, s] if side == "left" else [s, pad]))
    return torch.stack(out)


# --------------------------------------------------------------------------------- invariance
def test_batch_and_padding_invariance(backend):
    lens = [19, 7, 24]
    seqs = [make_seq(t, seed=10 * i) for i, t in enumerate(lens)]
    alone = [attention(q[None], k[None], v[None])[0] for q, k, v in seqs]
    total = 26
    left = [pad_batch([s[j] for s in seqs], total, "left") for j in range(3)]
    starts = torch.tensor([total - t for t in lens], device=DEVICE)
    out_left = attention(*left, key_start=starts)
    right = [pad_batch([s[j] for s in seqs], total, "right") for j in range(3)]
    out_right = attention(*right)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE)
    out_packed = attention(
        *(torch.cat([s[j] for s in seqs]) for j in range(3)), cu_seqlens_q=cu, cu_seqlens_k=cu
    )
    for i, t in enumerate(lens):
        assert torch.equal(out_left[i, total - t :], alone[i])
        assert torch.equal(out_right[i, :t], alone[i])
        assert torch.equal(out_packed[cu[i] : cu[i + 1]], alone[i])
    assert torch.equal(out_left[1, : total - lens[1]], torch.zeros_like(out_left[1, : total - lens[1]]))


def test_decode_and_chunked_prefill_equal_full_prefill(backend):
    t = 21
    q, k, v = make_seq(t, seed=3)
    full = attention(q[None], k[None], v[None])[0]
    for pos in (0, 1, 15, 16, 20):  # token-by-token decode against a cache of pos + 1 entries
        step = attention(q[None, pos : pos + 1], k[None, : pos + 1], v[None, : pos + 1])[0, 0]
        assert torch.equal(step, full[pos])
    chunks = [attention(q[None, a:b], k[None, :b], v[None, :b])[0] for a, b in ((0, 9), (9, 17), (17, t))]
    assert torch.equal(torch.cat(chunks), full)


def test_left_padded_decode_batch_equals_right_padded_prefill(backend):
    """HF generate(): left-padded prompts decoding together vs a right-padded training prefill."""
    lens = [6, 17, 11]
    seqs = [make_seq(t, seed=7 * i + 1) for i, t in enumerate(lens)]
    total = max(lens)
    prefill = attention(*(pad_batch([s[j] for s in seqs], total, "right") for j in range(3)))
    starts = torch.tensor([total - t for t in lens], device=DEVICE)
    # decode the last 3 tokens of every sequence at once: each cache is left-padded to `total`
    for back in (3, 2, 1):
        cut = [
            (q[: t - back + 1], k[: t - back + 1], v[: t - back + 1])
            for (q, k, v), t in zip(seqs, lens, strict=True)
        ]
        width = total - back + 1
        qd, kd, vd = (pad_batch([c[j] for c in cut], width, "left") for j in range(3))
        step = attention(qd[:, -1:], kd, vd, key_start=starts)
        for i, t in enumerate(lens):
            assert torch.equal(step[i, 0], prefill[i, t - back])


def test_batch_sizes_1_3_8(backend):
    seqs = [make_seq(17, seed=i) for i in range(8)]
    batch8 = attention(*(torch.stack([s[j] for s in seqs]) for j in range(3)))
    batch3 = attention(*(torch.stack([s[j] for s in seqs[2:5]]) for j in range(3)))
    batch1 = attention(*(s[None] for s in seqs[4]))
    assert torch.equal(batch3[2], batch8[4])
    assert torch.equal(batch1[0], batch8[4])


def test_many_blocks_decode_chunked_packed_equal_prefill(backend):
    """Sequences of several key blocks: batch-1 decode against caches ending around block
    boundaries, chunked prefill, packed prefill, the sequence alone and a left-padded batch-3 decode
    of each sequence's last tokens, all bitwise equal to a right-padded prefill."""
    lens = [70, 45, 9]
    seqs = [make_seq(t, seed=5 * i + 2) for i, t in enumerate(lens)]
    total = max(lens)
    prefill = attention(*(pad_batch([s[j] for s in seqs], total, "right") for j in range(3)))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE)
    packed = attention(*(torch.cat([s[j] for s in seqs]) for j in range(3)), cu_seqlens_q=cu, cu_seqlens_k=cu)
    for i, t in enumerate(lens):
        assert torch.equal(packed[cu[i] : cu[i + 1]], prefill[i, :t])
        assert torch.equal(attention(*(x[None] for x in seqs[i]))[0], prefill[i, :t])
    q, k, v = seqs[0]
    for pos in (31, 32, 33, 63, 69):  # batch-1 decode against caches ending around block boundaries
        step = attention(q[None, pos : pos + 1], k[None, : pos + 1], v[None, : pos + 1])[0, 0]
        assert torch.equal(step, prefill[0, pos])
    chunks = [attention(q[None, a:b], k[None, :b], v[None, :b])[0] for a, b in ((0, 30), (30, 66), (66, 70))]
    assert torch.equal(torch.cat(chunks), prefill[0, :70])
    starts = torch.tensor([total - t for t in lens], device=DEVICE)
    for back in (2, 1):  # left-padded batch-3 decode of each sequence's last tokens
        cut = [
            (q[: t - back + 1], k[: t - back + 1], v[: t - back + 1])
            for (q, k, v), t in zip(seqs, lens, strict=True)
        ]
        qd, kd, vd = (pad_batch([c[j] for c in cut], total - back + 1, "left") for j in range(3))
        step = attention(qd[:, -1:], kd, vd, key_start=starts)
        for i, t in enumerate(lens):
            assert torch.equal(step[i, 0], prefill[i, t - back])


def test_long_cache_decode_accuracy_determinism_and_lse(monkeypatch):
    """Decode of 2 queries against a cache of several blocks (left padding, GQA) against the fp64
    oracle, two runs bitwise equal, and the saved LSE (the backward reads it): the oracle's base-2
    log-sum-exp, +inf with zero output for a sequence that is all padding (key_start = Tk)."""
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")
    b, tq, tk, hq, hkv, d = 2, 2, 75, 4, 2, 16
    q, k, v = (randn(b, tq, hq, d), randn(b, tk, hkv, d, seed=1), randn(b, tk, hkv, d, seed=2))
    starts = torch.tensor([0, 20], device=DEVICE)
    out = attention(q, k, v, key_start=starts, scale=0.3)
    torch.testing.assert_close(out.double(), oracle(q, k, v, 0.3, starts), atol=2e-5, rtol=2e-5)
    assert torch.equal(out, attention(q, k, v, key_start=starts, scale=0.3))
    out2, lse2 = kern.attention_fwd(q, k, v, scale=0.3, key_start=starts)
    assert torch.equal(out2, out)
    kk = k.double().repeat_interleave(hq // hkv, 2)
    scores = torch.einsum("bqhd,bkhd->hbqk", q.double(), kk) * 0.3
    keys = torch.arange(tk, device=DEVICE)
    hide = (keys[None, None, :] > (tk - tq + torch.arange(tq, device=DEVICE))[None, :, None]) | (
        keys[None, None, :] < starts[:, None, None]
    )
    want = torch.logsumexp(scores.masked_fill(hide, -math.inf), -1) / math.log(2)  # [Hq, B, Tq]
    torch.testing.assert_close(lse2.double(), want.reshape(hq, b * tq), atol=1e-5, rtol=1e-5)
    starts = torch.tensor([tk, 20], device=DEVICE)
    out3, lse3 = kern.attention_fwd(q, k, v, scale=0.3, key_start=starts)
    assert torch.equal(out3[0], torch.zeros_like(out3[0])) and bool(lse3[:, :tq].isinf().all())
    assert torch.equal(out3[1], out[1]) and torch.equal(lse3[:, tq:], lse2[:, tq:])


def test_reference_tree_sum_is_exact_pairwise():
    x = torch.randn(5, 37, dtype=torch.float64)
    torch.testing.assert_close(ref.tree_sum(x, dim=1), x.sum(1))
    big = torch.randn(64, 37)
    assert torch.equal(ref.tree_sum(big, 1)[3], ref.tree_sum(big[3:4], 1)[0])


# ----------------------------------------------------------------------------------- accuracy
@pytest.mark.parametrize(
    ("dtype", "hq", "hkv", "d"),
    [
        (torch.float32, 4, 4, 16),
        (torch.float32, 4, 2, 32),
        (torch.bfloat16, 4, 2, 16),
        (torch.float16, 3, 1, 16),
        (torch.float32, 2, 1, 24),  # head_dim not a power of two: padded lanes in the kernel
    ],
)
def test_accuracy_against_fp64_oracle(backend, dtype, hq, hkv, d):
    b, tq, tk = 2, 13, 20
    q, k, v = (
        randn(b, tq, hq, d, dtype=dtype),
        randn(b, tk, hkv, d, dtype=dtype, seed=1),
        randn(b, tk, hkv, d, dtype=dtype, seed=2),
    )
    starts = torch.tensor([0, 5], device=DEVICE)
    out = attention(q, k, v, key_start=starts, scale=0.3)
    assert out.dtype == dtype and out.shape == q.shape
    atol, rtol = TOLERANCES[dtype]
    if dtype == torch.bfloat16 and not ON_GPU:  # the interpreter truncates fp32 -> bf16 (one ulp)
        atol, rtol = 4e-2, 4e-2
    torch.testing.assert_close(out.double(), oracle(q, k, v, 0.3, starts), atol=atol, rtol=rtol)


def test_float64_runs_reference(backend):
    q, k, v = (x[None].double() for x in make_seq(9))
    torch.testing.assert_close(attention(q, k, v), oracle(q, k, v), atol=1e-12, rtol=1e-12)


# ----------------------------------------------------------------------------------- backward
def _grads(fn, q, k, v, g):
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    fn(*leaves).backward(g)
    return [x.grad for x in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_matches_reference_and_is_deterministic(monkeypatch, dtype):
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")
    b, tq, tk, hq, hkv, d = 2, 11, 19, 4, 2, 16
    q, k, v = (
        randn(b, tq, hq, d, dtype=dtype),
        randn(b, tk, hkv, d, dtype=dtype, seed=1),
        randn(b, tk, hkv, d, dtype=dtype, seed=2),
    )
    g = randn(b, tq, hq, d, dtype=dtype, seed=3)
    starts = torch.tensor([3, 0], device=DEVICE)

    def kernel(q, k, v):
        return attention(q, k, v, key_start=starts)

    def reference(q, k, v):
        return ref.attention(q.float(), k.float(), v.float(), key_start=starts)

    got = _grads(kernel, q, k, v, g)
    want = _grads(reference, q, k, v, g.float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for a, w in zip(got, want, strict=False):
        assert a.dtype == dtype
        assert (a.float() - w).norm() <= tol * w.norm()
    assert torch.equal(got[1][0, :3], torch.zeros_like(got[1][0, :3]))  # keys before key_start
    again = _grads(kernel, q, k, v, g)
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=False))


def test_backward_packed(monkeypatch):
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")
    q, k, v = make_seq(23, hq=2, hkv=1)
    cu = torch.tensor([0, 9, 23], device=DEVICE)
    g = randn(*q.shape, seed=5)

    def packed(q, k, v):
        return attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)

    def reference(q, k, v):
        return ref.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)

    for a, w in zip(_grads(packed, q, k, v, g), _grads(reference, q, k, v, g), strict=False):
        assert (a - w).norm() <= 1e-4 * w.norm()


def test_backward_strided_views_same_bits(monkeypatch):
    # The backward kernels address a block's tokens by int32 offsets from its first one, scaled by
    # the token stride: q, k, v sliced from one fused projection (token stride (Hq + 2·Hkv)·D) and a
    # grad whose token stride is D take the same bits as contiguous copies.
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")
    b, t, hq, hkv, d = 2, 21, 4, 2, 16
    g = randn(b, hq, t, d, dtype=torch.bfloat16, seed=3).transpose(1, 2)
    starts = torch.tensor([0, 5], device=DEVICE)

    def grads(qkv, grad):
        qkv = qkv.detach().clone().requires_grad_(True)
        q, k, v = qkv[:, :, :hq], qkv[:, :, hq : hq + hkv], qkv[:, :, hq + hkv :]
        attention(q, k, v, key_start=starts).backward(grad)
        return qkv.grad

    qkv = randn(b, t, hq + 2 * hkv, d, dtype=torch.bfloat16)
    got = grads(qkv, g)
    want = torch.cat(
        _grads(lambda q, k, v: attention(q, k, v, key_start=starts), *(
            x.contiguous() for x in (qkv[:, :, :hq], qkv[:, :, hq : hq + hkv], qkv[:, :, hq + hkv :])
        ), g.contiguous()),
        dim=2,
    )  # fmt: skip
    assert g.stride(1) == d and got.abs().sum() > 0
    assert torch.equal(got, want)


def test_backward_int32_rows_guard():
    # What makes the kernels' int32 block offsets safe: a token stride too large for them is made
    # contiguous (meta tensors: the layouts without the memory).
    from rlkernel.kernels.attention_bwd import _int32_rows

    t = torch.empty(2, 8, 4, 128, device="meta")
    assert _int32_rows(t, 64) is t
    wide = torch.empty_strided((2, 8, 4, 128), (8 * 2**26, 2**26, 128, 1), device="meta")
    assert _int32_rows(wide, 32) is wide  # 31 · 2^26 + 127 < 2^31
    assert _int32_rows(wide, 64).stride() == (8 * 512, 512, 128, 1)  # 63 · 2^26 ≥ 2^31: a copy
    with pytest.raises(ValueError, match="int32"):  # no layout fits: token stride 2^26 when contiguous
        _int32_rows(torch.empty(1, 2, 2**19, 128, device="meta"), 64)


def test_reference_backward_matches_oracle(monkeypatch):
    monkeypatch.setenv("RLKERNEL_BACKEND", "reference")
    q, k, v = (x[None] for x in make_seq(12))
    g = randn(*q.shape, seed=4)
    got = _grads(attention, q, k, v, g)
    want = _grads(lambda a, b, c: oracle(a, b, c).float(), q, k, v, g)
    for a, w in zip(got, want, strict=False):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------- bad input
def test_bad_input():
    q, k, v = (x[None] for x in make_seq(5, hq=4, hkv=2))
    with pytest.raises(TypeError, match="q"):
        attention(q.long(), k, v)
    with pytest.raises(TypeError, match="k must have the dtype"):
        attention(q, k.double(), v)
    with pytest.raises(ValueError, match="v must have shape"):
        attention(q, k, v[:, :3])
    with pytest.raises(ValueError, match="multiple"):
        attention(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="head_dim"):
        attention(q, k[..., :8], v[..., :8])
    with pytest.raises(ValueError, match="head_dim"):
        big = torch.zeros(1, 2, 1, 300)
        attention(big, big, big)
    with pytest.raises(ValueError, match="Tk >= Tq"):
        attention(q, k[:, :3], v[:, :3])
    with pytest.raises(ValueError, match="batch"):
        attention(q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))
    with pytest.raises(ValueError, match="q must be"):
        attention(q[0], k, v)
    with pytest.raises(ValueError, match="key_start"):
        attention(q, k, v, key_start=torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="key_start"):
        attention(q, k, v, key_start=torch.zeros(1))
    with pytest.raises(ValueError, match="scale"):
        attention(q, k, v, scale=-1.0)
    cu = torch.tensor([0, 5], device=DEVICE)
    with pytest.raises(ValueError, match="together"):
        attention(q[0], k[0], v[0], cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        attention(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=torch.tensor([0, 4], device=DEVICE))
    with pytest.raises(ValueError, match="as many keys"):
        attention(q[0], k[0, :3], v[0, :3], cu_seqlens_q=cu, cu_seqlens_k=torch.tensor([0, 3], device=DEVICE))
    with pytest.raises(ValueError, match="key_start"):
        attention(
            q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, key_start=torch.zeros(1, dtype=torch.long)
        )
    if ON_GPU:
        with pytest.raises(ValueError, match="device"):
            attention(q, k.cpu(), v)


def test_torch_compile_fullgraph(monkeypatch):
    """The kernel path is an opaque torch.library op pair: traced without graph breaks, same bits."""
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")
    q, k, v = randn(2, 9, 4, 16), randn(2, 9, 2, 16, seed=1), randn(2, 9, 2, 16, seed=2)
    starts = torch.tensor([0, 3], device=DEVICE)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    compiled = torch.compile(
        lambda a, b, c: attention(a, b, c, key_start=starts), backend="aot_eager", fullgraph=True
    )
    out = compiled(*leaves)
    out.sum().backward()
    eager = _grads(lambda a, b, c: attention(a, b, c, key_start=starts), q, k, v, torch.ones_like(out))
    assert torch.equal(out, attention(q, k, v, key_start=starts))
    assert all(torch.equal(x.grad, e) for x, e in zip(leaves, eager, strict=True))


def test_edge_cases(backend):
    """A sequence that is all padding outputs zeros (no NaN, zero gradients); empty inputs work."""
    q, k, v = randn(2, 3, 4, 16), randn(2, 5, 2, 16, seed=1), randn(2, 5, 2, 16, seed=2)
    starts = torch.tensor([5, 4], device=DEVICE)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = attention(*leaves, key_start=starts)
    out.sum().backward()
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # key_start = Tk: no key at all
    assert torch.equal(out[1, :2], torch.zeros_like(out[1, :2]))  # query rows before key_start
    assert all(torch.isfinite(x.grad).all() for x in leaves)
    assert torch.equal(leaves[1].grad[1, :4], torch.zeros_like(leaves[1].grad[1, :4]))
    assert attention(q[:0], k[:0], v[:0]).shape == (0, 3, 4, 16)
    assert attention(q[:, :0], k, v).shape == (2, 0, 4, 16)
    cu_q, cu_k = torch.tensor([0, 0, 3], device=DEVICE), torch.tensor([0, 2, 5], device=DEVICE)
    packed = attention(q[0], k[0], v[0], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)  # an empty query sequence
    assert torch.equal(packed, attention(q[:1], k[:1, 2:], v[:1, 2:])[0])


def test_decode_tile_override_keeps_bits(monkeypatch):
    """The DECODE_TILES hook (filled only after a GPU proof) switches decode to a smaller tile;
    the rows must stay bitwise equal to the prefill's."""
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")
    monkeypatch.setitem(kern.DECODE_TILES, (16, torch.float32), (8, 2))
    assert kern.launch_config(16, torch.float32, 2).block_m == 8
    assert kern.launch_config(16, torch.float32, 40).block_m == kern.fwd_config(16, torch.float32).block_m
    q, k, v = make_seq(19, seed=11)
    full = attention(q[None], k[None], v[None])[0]
    step = attention(q[None, 18:], k[None], v[None])[0, 0]
    assert torch.equal(step, full[18])


@pytest.mark.parametrize("run_backend", ["reference", "triton"])
def test_invariance_with_production_blocks(monkeypatch, run_backend):
    """Padded, left-padded, packed and decode rows agree with the reference at its production
    BLOCK_N (the kernel always runs its own configuration)."""
    monkeypatch.setenv("RLKERNEL_BACKEND", run_backend)
    monkeypatch.setattr(ref, "BLOCK_N", PRODUCTION_BLOCK_N)  # seam: the reference's key block
    lens = [23, 9]
    seqs = [make_seq(t, seed=40 + 10 * i) for i, t in enumerate(lens)]
    alone = [attention(q[None], k[None], v[None])[0] for q, k, v in seqs]
    total = 25
    starts = torch.tensor([total - t for t in lens], device=DEVICE)
    left = attention(*(pad_batch([s[j] for s in seqs], total, "left") for j in range(3)), key_start=starts)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE)
    packed = attention(*(torch.cat([s[j] for s in seqs]) for j in range(3)), cu_seqlens_q=cu, cu_seqlens_k=cu)
    for i, t in enumerate(lens):
        assert torch.equal(left[i, total - t :], alone[i])
        assert torch.equal(packed[cu[i] : cu[i + 1]], alone[i])
        q, k, v = seqs[i]
        step = attention(q[None, t - 1 :], k[None], v[None])[0, 0]
        assert torch.equal(step, alone[i][t - 1])


def test_no_grad_fast_path_same_bits(backend):
    """Without gradients the forward op runs without the autograd Function: same bits, and with
    gradients the Function still runs (the output requires grad)."""
    q, k, v = (x[None] for x in make_seq(13, seed=21))
    with torch.no_grad():
        fast = attention(q, k, v)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    slow = attention(*leaves)
    assert slow.requires_grad and not fast.requires_grad
    assert torch.equal(fast, slow.detach())


@pytest.mark.parametrize("tq", [1, 5])  # a decode step against a cache; a chunk of prefill
def test_heads_first_entry_same_bits(backend, tq):
    """``attention_heads_first`` (HF's [B, H, T, D] layout, read through strides when no gradient
    is kept) equals ``attention`` on the transposed views bitwise, with and without key_start, and
    falls back to it (gradient kept) when an input requires grad."""
    from rlkernel.invariant.attention import attention_heads_first

    b, hq, hkv, tk, d = 3, 4, 2, 11, 16
    q = randn(b, hq, tq, d, dtype=torch.bfloat16, seed=31)
    k = randn(b, hkv, tk, d, dtype=torch.bfloat16, seed=32)
    v = randn(b, hkv, tk, d, dtype=torch.bfloat16, seed=33)
    scale = d**-0.5
    for key_start in (None, torch.tensor([0, 2, 9], device=DEVICE)):
        with torch.no_grad():
            got = attention_heads_first(q, k, v, scale=scale, key_start=key_start)
            want = attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, key_start=key_start
            )
        assert got.shape == (b, tq, hq, d)
        assert torch.equal(got, want)
    leaf = q.clone().requires_grad_(True)
    with_grad = attention_heads_first(leaf, k, v, scale=scale, key_start=None)
    assert with_grad.requires_grad
    with torch.no_grad():
        plain = attention_heads_first(q, k, v, scale=scale, key_start=None)
    assert torch.equal(with_grad.detach(), plain)
