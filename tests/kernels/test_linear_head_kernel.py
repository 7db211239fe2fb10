"""The LM-head GEMM with a log-softmax epilogue (``kernels/linear_head.py``) against float64 math.

The oracle is float64 on the same operand values: ``x = h.double() @ w.double().T``, then
``rlkernel.reference.logprobs`` (log-prob, entropy) and float64 autograd for the gradient. Kernels
run on CUDA when present, else in the CPU interpreter at tiny sizes with small tiles (several row
and column tiles, a masked vocabulary tail, several persistent programs per launch).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rlkernel.reference import logprobs as ref

from .conftest import DEVICE, ON_GPU

# The interpreter evaluates numpy ops on −inf (masked columns) and on padded rows.
pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
]

# (atol, rtol) against float64 on the same operands. "fwd": logp/lse/entropy are fp32 results of an
# fp32-accumulated GEMM and fp32 reductions: a few fp32 roundings at the logits' magnitude (|z| ≲ 10
# here: ~1e-6). "grad32": the fp32 gradient, atol relative to the largest |∂L/∂x| of the case. "grad16":
# one rounding to the output dtype on top (bf16 2^-8, fp16 2^-10 relative); the Triton 3.9
# interpreter converts fp32 → bf16 by truncation, up to a full bf16 ulp (2^-7).
TOLERANCES = {
    "fwd": (1e-5, 1e-5),
    "grad32": (1e-5, 1e-5),
    torch.bfloat16: (1e-6, 2**-8 if ON_GPU else 2**-7),
    torch.float16: (1e-7, 2**-10),
}
IGNORE = -100


def kernels():
    # Imported inside tests so that the root conftest has set TRITON_INTERPRET before the kernels exist.
    from rlkernel.kernels import linear_head

    return linear_head


def small(block_m=16, block_n=32, **kw):
    """Tiny tiles for the interpreter: several row/column tiles and persistent programs per launch."""
    lh = kernels()
    kw = {"block_k": 16, "group_m": 2, "num_warps": 4, "num_stages": 2, "combine_rows": 16, **kw}
    return lh.LinearHeadConfig(block_m, block_n, **kw)


def make(m, hidden, vocab, dtype=torch.bfloat16, seed=0, scale=1.0, ignore=(3,)):
    """Random ``h [m, H]``, ``w [V, H]`` (logits of std ~``scale``·2) and ids with the first and last
    vocabulary entries and some ``ignore_index`` rows."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(m, hidden, generator=g) * scale).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * 2 / hidden**0.5).to(dtype)
    ids = torch.randint(0, vocab, (m,), generator=g)
    ids[0] = 0
    if m > 1:
        ids[1] = vocab - 1
    for r in ignore:
        if r < m:
            ids[r] = IGNORE
    return h.to(DEVICE), w.to(DEVICE), ids.to(DEVICE)


def exact(h, w, ids, temperature):
    """float64 ``(logp, lse, entropy)`` of the same operand values (ignored rows: 0)."""
    x = h.double() @ w.double().T
    logp, entropy = ref.token_logprobs(
        x, ids, temperature=temperature, ignore_index=IGNORE, return_entropy=True
    )
    active = ids != IGNORE
    lse = torch.where(active, torch.logsumexp(x / temperature, -1), 0.0)
    return logp, lse, entropy


def exact_grad(h, w, ids, temperature, g_logp, g_ent):
    """float64 autograd ∂(Σ g_logp·logp + g_ent·entropy)/∂x at x = h @ w.T."""
    x = (h.double() @ w.double().T).requires_grad_(True)
    logp, entropy = ref.token_logprobs(
        x, ids, temperature=temperature, ignore_index=IGNORE, return_entropy=True
    )
    loss = 0.0
    if g_logp is not None:
        loss = loss + (g_logp.double() * logp).sum()
    if g_ent is not None:
        loss = loss + (g_ent.double() * entropy).sum()
    loss.backward()
    return x.grad


def assert_close(actual, expected, tol):
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol[0], rtol=tol[1])


def row_grads(m, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, generator=g).to(DEVICE), torch.randn(m, generator=g).to(DEVICE)


# ------------------------------------------------------------------------------------- forward
FWD_CASES = [  # (M, H, V, dtype, temperature, config kwargs)
    (37, 64, 300, torch.bfloat16, 0.7, {"block_n": 64}),
    (37, 16, 100, torch.float32, 1.0, {}),
    (5, 64, 100, torch.bfloat16, 1.0, {"block_m": 32}),
    (1, 16, 300, torch.float16, 0.7, {"block_n": 64}),
    (5, 16, 100, torch.float32, 0.7, {"block_n": 16}),
]


@pytest.mark.parametrize("case", FWD_CASES, ids=lambda c: f"M{c[0]}H{c[1]}V{c[2]}-{c[3]}-T{c[4]}")
def test_stats_match_float64(case):
    m, hidden, vocab, dtype, temperature, cfg_kw = case
    lh = kernels()
    h, w, ids = make(m, hidden, vocab, dtype)
    cfg = small(**cfg_kw)
    logp, lse, entropy = lh.linear_head_stats(
        h, w, ids, temperature=temperature, ignore_index=IGNORE, with_entropy=True, config=cfg
    )
    e_logp, e_lse, e_entropy = exact(h, w, ids, temperature)
    for out in (logp, lse, entropy):
        assert out.dtype == torch.float32 and out.shape == (m,)
    assert_close(logp, e_logp, TOLERANCES["fwd"])
    assert_close(lse, e_lse, TOLERANCES["fwd"])
    assert_close(entropy, e_entropy, TOLERANCES["fwd"])
    ignored = ids == IGNORE
    assert (logp[ignored] == 0).all() and (lse[ignored] == 0).all() and (entropy[ignored] == 0).all()
    assert (entropy[~ignored] > 0).all() and (logp[~ignored] < 0).all()
    # Without the entropy: the same logp and lse bits (the entropy adds a partial, changes no other).
    logp2, lse2, none = lh.linear_head_stats(
        h, w, ids, temperature=temperature, ignore_index=IGNORE, with_entropy=False, config=cfg
    )
    assert none is None
    assert torch.equal(logp2, logp) and torch.equal(lse2, lse)


def test_stats_extreme_logits():
    """|z| up to ~60 at T = 0.7 (large shifts, exp2 far from 0), and rows of all-equal logits
    (every tile's partials equal: logp = −log V, entropy = log V)."""
    lh = kernels()
    m, hidden, vocab = 7, 16, 100
    h, w, ids = make(m, hidden, vocab, torch.float32, seed=3, scale=10.0)
    h[4] = h[4].abs() * 3  # push one row's logits far up
    w[:, :8] = w[:, :8].abs()
    x = h.double() @ w.double().T
    assert x.abs().max() / 0.7 > 40
    logp, lse, entropy = lh.linear_head_stats(
        h, w, ids, temperature=0.7, ignore_index=IGNORE, with_entropy=True, config=small()
    )
    e_logp, e_lse, e_entropy = exact(h, w, ids, 0.7)
    # fp32 roundings at |z| ~ 60 (ulp 2^-18 ≈ 3.8e-6): a few ulps of the largest logit, absolute.
    tol = (16 * 2**-24 * (x.abs().max().item() / 0.7), 1e-5)
    assert_close(logp, e_logp, tol)
    assert_close(lse, e_lse, tol)
    assert_close(entropy, e_entropy, tol)

    w_equal = w[:1].expand(vocab, hidden).contiguous()  # every logit of a row equal
    logp, lse, entropy = lh.linear_head_stats(
        h, w_equal, ids, temperature=0.7, ignore_index=IGNORE, with_entropy=True, config=small()
    )
    active = ids != IGNORE
    log_v = torch.log(torch.tensor(float(vocab), dtype=torch.float64, device=logp.device))
    assert_close(logp[active], (-log_v).expand(int(active.sum())), tol)
    assert_close(entropy[active], log_v.expand(int(active.sum())), (1e-5, 1e-5))


def test_nan_hidden_state_stays_visible():
    """A NaN in h makes its row's logp, lse and entropy NaN (not silently dropped by a max or a
    floor) and leaves every other row's bits unchanged."""
    lh = kernels()
    h, w, ids = make(7, 16, 100, ignore=())
    clean = lh.linear_head_stats(h, w, ids, with_entropy=True, config=small())
    h[2, 5] = float("nan")
    dirty = lh.linear_head_stats(h, w, ids, with_entropy=True, config=small())
    others = [0, 1, 3, 4, 5, 6]
    for a, b in zip(dirty, clean, strict=True):
        assert torch.isnan(a[2])
        assert torch.equal(a[others], b[others])
    # One NaN logit per row (a NaN weight row): a max that skips NaN would leave the row max finite,
    # and the exponent floor must then keep the NaN rather than floor it to an exact 0.
    h[2, 5] = 1.0
    w[37, 3] = float("nan")
    _, lse, entropy = lh.linear_head_stats(h, w, ids, with_entropy=True, config=small())
    assert torch.isnan(lse).all() and torch.isnan(entropy).all()


def test_out_of_vocab_id_gives_nan_logp():
    lh = kernels()
    h, w, ids = make(5, 16, 100, ignore=())
    ids[2] = 100  # == V
    ids[4] = -7  # negative, not ignore_index
    logp, lse, _ = lh.linear_head_stats(h, w, ids, ignore_index=IGNORE, config=small())
    assert torch.isnan(logp[2]) and torch.isnan(logp[4])
    assert torch.isfinite(logp[[0, 1, 3]]).all() and torch.isfinite(lse).all()


# (dtype of z, the config's store_bytes, tma_store): a 16x32 tile is 2 KB in fp32, 1 KB in bf16.
STORES = [
    (torch.float32, 1024, True),  # two column slices
    (torch.float32, 512, True),  # four
    (torch.bfloat16, 1024, True),  # one piece
    (torch.bfloat16, 512, True),  # two
    (torch.float32, 2048, False),  # pointer store although TMA could
]


@pytest.mark.parametrize("store", STORES, ids=lambda s: f"{s[0]}-{s[1]}-{'tma' if s[2] else 'ptr'}")
@pytest.mark.parametrize("vocab", [100, 104])
def test_store_z(store, vocab):
    """STORE_Z writes the raw logits x (not x / T) rounded once from fp32: TMA stores in 1, 2 or 4
    column slices where the row pitch is 16-byte aligned (fp32; bf16 at V = 104), pointer stores
    otherwise (bf16 at V = 100); the statistics do not change by a bit."""
    z_dtype, store_bytes, tma_store = store
    lh = kernels()
    h, w, ids = make(21, 16, vocab)
    cfg = small(store_bytes=store_bytes, tma_store=tma_store)
    z = torch.full((21, vocab), float("nan"), dtype=z_dtype, device=DEVICE)
    with_z = lh.linear_head_stats(h, w, ids, temperature=0.7, with_entropy=True, store_z=z, config=cfg)
    without = lh.linear_head_stats(h, w, ids, temperature=0.7, with_entropy=True, config=cfg)
    for a, b in zip(with_z, without, strict=True):
        assert torch.equal(a, b)
    x = h.double() @ w.double().T
    if z_dtype == torch.float32:
        assert_close(z, x, (1e-6, 1e-6))
    else:
        assert_close(z, x, TOLERANCES[torch.bfloat16])


def test_partials_per_column_tile():
    """``stats_partials``' planes are, per column tile and row, max z, Σ exp(z − max) and
    Σ (z − max)·exp(z − max) over the tile's columns < V (the last tile is 4 of 32 wide), and
    ``combine_partials`` of them is ``linear_head_stats``."""
    lh = kernels()
    m, vocab, t = 9, 100, 0.7
    h, w, ids = make(m, 16, vocab, torch.float32, seed=11)
    cfg = small()
    parts, z_y = lh.stats_partials(h, w, ids, temperature=t, with_entropy=True, config=cfg)
    assert parts.shape == (3, 4, m) and parts.dtype == torch.float32
    z = (h.double() @ w.double().T) / t
    for tile in range(4):
        zt = z[:, tile * 32 : (tile + 1) * 32]
        mx = zt.max(-1).values
        e = torch.exp(zt - mx[:, None])
        expected = torch.stack([mx, e.sum(-1), ((zt - mx[:, None]) * e).sum(-1)])
        assert_close(parts[:, tile], expected, TOLERANCES["fwd"])
    active = ids != IGNORE
    assert_close(z_y[active], z[active, ids[active]], TOLERANCES["fwd"])
    combined = lh.combine_partials(parts, z_y, ids, vocab_size=vocab, ignore_index=IGNORE, config=cfg)
    direct = lh.linear_head_stats(h, w, ids, temperature=t, with_entropy=True, config=cfg)
    for a, b in zip(combined, direct, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("tiles_per_step", [8, 64])
def test_combine_folds_many_tiles_like_float64(tiles_per_step):
    """``combine_partials`` on random partials of 37 column tiles (several steps of
    ``combine_tiles``, a masked tail, rows beyond the last program's): lse, entropy and logp match
    the float64 fold; a row's bits do not depend on how many rows are combined with it."""
    lh = kernels()
    g = torch.Generator().manual_seed(3)
    n_tiles, m, vocab = 37, 19, 37 * 32
    mx = torch.randn(n_tiles, m, generator=g, dtype=torch.float64) * 4
    s = torch.rand(n_tiles, m, generator=g, dtype=torch.float64) * 31 + 1  # Σ over a tile: in [1, 32]
    w_ = -torch.rand(n_tiles, m, generator=g, dtype=torch.float64) * s * 3  # Σ (z − m)·e^{z−m} ≤ 0
    z_y = mx[5] - torch.rand(m, generator=g, dtype=torch.float64)
    ids = torch.randint(0, vocab, (m,), generator=g)
    ids[4] = IGNORE
    parts = torch.stack([mx, s, w_]).float().to(DEVICE)
    z_y, ids = z_y.to(DEVICE), ids.to(DEVICE)
    cfg = small(combine_tiles=tiles_per_step)
    logp, lse, entropy = lh.combine_partials(
        parts, z_y.float(), ids, vocab_size=vocab, ignore_index=IGNORE, config=cfg
    )
    p64 = parts.double()
    top = p64[0].max(0).values
    scale = torch.exp(p64[0] - top)
    big_s = (p64[1] * scale).sum(0)
    big_w = (scale * (p64[2] + (p64[0] - top) * p64[1])).sum(0)
    ref_lse = top + torch.log(big_s)
    ref_ent = torch.log(big_s) - big_w / big_s
    active = ids != IGNORE
    tol = {"rtol": 0, "atol": 2e-5}
    torch.testing.assert_close(lse[active].double(), ref_lse[active], **tol)
    torch.testing.assert_close(entropy[active].double(), ref_ent[active], **tol)
    torch.testing.assert_close(logp[active].double(), (z_y.float().double() - ref_lse)[active], **tol)
    assert logp[4] == 0 and lse[4] == 0 and entropy[4] == 0
    few = lh.combine_partials(
        parts[:, :, :7].contiguous(), z_y.float()[:7], ids[:7], vocab_size=vocab, ignore_index=IGNORE,
        config=cfg,
    )
    for a, b in zip(few, (logp, lse, entropy), strict=True):
        assert torch.equal(a, b[:7])


def test_zero_rows():
    lh = kernels()
    h, w, ids = make(4, 16, 100)
    logp, lse, entropy = lh.linear_head_stats(h[:0], w, ids[:0], with_entropy=True, config=small())
    assert logp.shape == lse.shape == entropy.shape == (0,)
    grad = torch.empty(0, 100, dtype=torch.bfloat16, device=DEVICE)
    lh.linear_head_grad_into(h[:0], w, ids[:0], lse, entropy, lse, lse, grad, config=small())


# ------------------------------------------------------------------------------------ gradient
GRAD_CASES = [  # (M, H, V, dtype, out dtype, temperature, which upstream gradients)
    (37, 64, 300, torch.bfloat16, torch.bfloat16, 0.7, "both"),
    (37, 16, 100, torch.float32, torch.float32, 1.0, "both"),
    (5, 16, 100, torch.bfloat16, torch.float32, 0.7, "logp"),
    (5, 64, 100, torch.bfloat16, torch.bfloat16, 1.0, "entropy"),
    (1, 16, 300, torch.float16, torch.float16, 0.7, "both"),
]


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: f"M{c[0]}H{c[1]}V{c[2]}-{c[4]}-T{c[5]}-{c[6]}")
def test_grad_matches_float64_autograd(case):
    m, hidden, vocab, dtype, out_dtype, temperature, which = case
    lh = kernels()
    h, w, ids = make(m, hidden, vocab, dtype, seed=5)
    cfg = small(block_n=64) if vocab == 300 else small()
    _, lse, entropy = lh.linear_head_stats(
        h, w, ids, temperature=temperature, ignore_index=IGNORE, with_entropy=True, config=cfg
    )
    g_logp, g_ent = row_grads(m)
    g_logp = g_logp if which in ("both", "logp") else None
    g_ent = g_ent if which in ("both", "entropy") else None
    grad = torch.full((m, vocab), float("nan"), dtype=out_dtype, device=DEVICE)
    lh.linear_head_grad_into(
        h, w, ids, lse, entropy if g_ent is not None else None, g_logp, g_ent, grad,
        temperature=temperature, ignore_index=IGNORE, config=cfg,
    )  # fmt: skip
    expected = exact_grad(h, w, ids, temperature, g_logp, g_ent)
    if out_dtype == torch.float32:
        atol, rtol = TOLERANCES["grad32"]
        assert_close(grad, expected, (atol * expected.abs().max().item(), rtol))
    else:
        assert_close(grad, expected, TOLERANCES[out_dtype])
    ignored = ids == IGNORE
    assert torch.equal(grad[ignored], torch.zeros_like(grad[ignored]))  # exact zeros, not NaN


def test_grad_without_upstream_is_zero():
    lh = kernels()
    h, w, ids = make(5, 16, 100)
    grad = torch.full((5, 100), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    lse = torch.randn(5, device=DEVICE)
    lh.linear_head_grad_into(h, w, ids, lse, None, None, None, grad, config=small())
    assert torch.equal(grad, torch.zeros_like(grad))


# ---------------------------------------------------------------- shifted exponents (fused loss)
SHIFTED_CASES = [  # (M, H, V, dtype, temperature, config kwargs)
    (37, 64, 300, torch.bfloat16, 0.7, {"block_n": 64}),
    (5, 16, 100, torch.float16, 1.0, {}),
]


@pytest.mark.parametrize("case", SHIFTED_CASES, ids=lambda c: f"M{c[0]}V{c[2]}-{c[3]}-T{c[4]}")
def test_shifted_exponents_and_their_gradient(case):
    """linear_head_stats_shifted: the statistics bitwise those of linear_head_stats, the tile maxima
    and (z − m_t)·log2 e against float64; linear_head_grad_from_shifted (in place or not) against
    float64 autograd, closer to it than the same formula on bf16-rounded logits."""
    m, hidden, vocab, dtype, t, kw = case
    lh = kernels()
    cfg = small(**kw)
    h, w, ids = make(m, hidden, vocab, dtype, seed=11, scale=3.0)  # |z| up to ~20: rounding z hurts
    plain = lh.linear_head_stats(h, w, ids, temperature=t, ignore_index=IGNORE, with_entropy=True, config=cfg)
    d = torch.full((m, vocab), float("nan"), dtype=dtype, device=DEVICE)
    logp, lse, ent, tile_max = lh.linear_head_stats_shifted(
        h, w, ids, d, temperature=t, ignore_index=IGNORE, with_entropy=True, config=cfg
    )
    for got, want in zip((logp, lse, ent), plain, strict=True):
        assert torch.equal(got, want)
    z = (h.double() @ w.double().T) / t
    n_t = -(-vocab // cfg.block_n)
    zt = torch.nn.functional.pad(z, (0, n_t * cfg.block_n - vocab), value=float("-inf")).view(m, n_t, -1)
    m_t = zt.amax(-1, keepdim=True)
    assert_close(tile_max, m_t[..., 0].T, TOLERANCES["fwd"])
    d_exact = ((zt - m_t) * 1.4426950408889634).clamp_min(-200.0).reshape(m, -1)[:, :vocab]
    assert_close(d, d_exact, (1e-5, 2**-8 if dtype == torch.float16 else 2**-7))

    g_logp, g_ent = row_grads(m, seed=12)
    out = torch.full((m, vocab), float("nan"), dtype=dtype, device=DEVICE)
    kw = {"temperature": t, "ignore_index": IGNORE, "config": cfg}
    lh.linear_head_grad_from_shifted(d, tile_max, ids, lse, ent, g_logp, g_ent, out, **kw)
    lh.linear_head_grad_from_shifted(d, tile_max, ids, lse, ent, g_logp, g_ent, **kw)  # in place
    assert torch.equal(d, out)
    expected = exact_grad(h, w, ids, t, g_logp, g_ent)
    scale = expected.abs().max().item()
    assert_close(out, expected, (2**-7 * scale, 2**-6))
    # The same formula on logits rounded to the 16-bit dtype (what storing z itself would give).
    z16 = (h.double() @ w.double().T).to(dtype).double().requires_grad_(True)
    lp16, en16 = ref.token_logprobs(z16, ids, temperature=t, ignore_index=IGNORE, return_entropy=True)
    (g16,) = torch.autograd.grad((g_logp.double() * lp16 + g_ent.double() * en16).sum(), (z16,))
    assert (out.double() - expected).norm() < (g16 - expected).norm()
    ignored = ids == IGNORE
    assert torch.equal(out[ignored], torch.zeros_like(out[ignored]))


def test_shifted_bad_inputs():
    lh = kernels()
    h, w, ids = make(5, 16, 100)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        lh.linear_head_stats_shifted(h, w, ids, torch.empty(5, 100, device=DEVICE), config=small())
    d = torch.zeros(5, 100, dtype=torch.bfloat16, device=DEVICE)
    tile_max, row = torch.zeros(4, 5, device=DEVICE), torch.zeros(5, device=DEVICE)
    with pytest.raises(ValueError, match="entropy must be given"):
        lh.linear_head_grad_from_shifted(d, tile_max, ids, row, None, None, row, config=small())
    with pytest.raises(ValueError, match="tile_max"):
        lh.linear_head_grad_from_shifted(d, tile_max[:3], ids, row, None, row, None, config=small())
    with pytest.raises(ValueError, match="bf16/fp16"):
        lh.linear_head_grad_from_shifted(d.float(), tile_max, ids, row, None, row, None, config=small())


# ---------------------------------------------------------------------------------- invariance
def test_rows_bitwise_independent_of_batch():
    """A row's logp/lse/entropy and gradient row are the same bits at M = 37, alone (M = 1, row 0 of
    its tile) and inside another batch (another position in its tile, other neighbours)."""
    lh = kernels()
    m, hidden, vocab, t = 37, 16, 100, 0.7
    h, w, ids = make(m, hidden, vocab, seed=7)
    cfg = small()
    g_logp, g_ent = row_grads(m, seed=8)

    def run(rows_h, rows_ids, gl, ge):
        logp, lse, ent = lh.linear_head_stats(
            rows_h, w, rows_ids, temperature=t, ignore_index=IGNORE, with_entropy=True, config=cfg
        )
        grad = torch.empty(rows_h.shape[0], vocab, dtype=torch.bfloat16, device=DEVICE)
        lh.linear_head_grad_into(
            rows_h, w, rows_ids, lse, ent, gl, ge, grad, temperature=t, ignore_index=IGNORE, config=cfg
        )
        return logp, lse, ent, grad

    full = run(h, ids, g_logp, g_ent)
    for r in (0, 5, 20, 36):
        alone = run(h[r : r + 1], ids[r : r + 1], g_logp[r : r + 1], g_ent[r : r + 1])
        for a, b in zip(alone, full, strict=True):
            assert torch.equal(a[0], b[r]), r
    # Row 5 and row 20 at positions 3 and 4 of a 24-row batch of fresh rows.
    other_h, _, other_ids = make(22, hidden, vocab, seed=9)
    sel = [5, 20]
    mixed_h = torch.cat([other_h[:3], h[sel], other_h[3:]])
    mixed_ids = torch.cat([other_ids[:3], ids[sel], other_ids[3:]])
    gl_o, ge_o = row_grads(22, seed=10)
    mixed_gl = torch.cat([gl_o[:3], g_logp[sel], gl_o[3:]])
    mixed_ge = torch.cat([ge_o[:3], g_ent[sel], ge_o[3:]])
    mixed = run(mixed_h, mixed_ids, mixed_gl, mixed_ge)
    for a, b in zip(mixed, full, strict=True):
        assert torch.equal(a[3:5], b[sel])


# ------------------------------------------------------------------------------ sm_90 compile
H100_SHARED = 232448  # bytes of shared memory one H100 block may use (227 KB)
# Every default-config launch variant, compiled to an sm_90 cubin through the real launchers
# (``rlkernel._sm90_compile`` intercepts the launch; it must run without TRITON_INTERPRET: a
# subprocess). V = 1000 bf16 is a 2000-byte row pitch: TMA stores; V = 1001: pointer stores; fp32
# operands: the IEEE (FMA) product.
_COMPILE_SCRIPT = """
import sys, torch, triton
from rlkernel import _sm90_compile
results, shared = [], []
_sm90_compile._compile_instead_of_launch(results)
compile_ = triton.compile
def compile_and_record(*args, **kwargs):
    compiled = compile_(*args, **kwargs)
    shared.append(compiled.metadata.shared)
    return compiled
triton.compile = compile_and_record
from rlkernel.kernels import linear_head as lh
for dtype, vocab in ((torch.bfloat16, 1000), (torch.bfloat16, 1001), (torch.float32, 1000)):
    h, w = torch.randn(256, 512).to(dtype), torch.randn(vocab, 512).to(dtype)
    ids, row = torch.randint(0, vocab, (256,)), torch.zeros(256)
    lh.linear_head_stats(h, w, ids, with_entropy=True, store_z=torch.empty(256, vocab))
    lh.linear_head_stats(h, w, ids, store_z=torch.empty(256, vocab, dtype=dtype))
    lh.linear_head_grad_into(h, w, ids, row, row, row, row, torch.empty(256, vocab, dtype=dtype))
for (status, label, _), nbytes in zip(results, shared + [None] * len(results)):
    print(status.split()[0], nbytes, label)
sys.exit(0 if results and all(r[0].startswith("ok ") for r in results) else 1)
"""


@pytest.mark.skipif(
    "nvidia" not in getattr(pytest.importorskip("triton").backends, "backends", {}),
    reason="this Triton has no NVIDIA backend (ptxas) to compile with",
)
def test_kernels_compile_for_sm90_within_shared_memory():
    """The compiled path (which the interpreter never takes) builds for the H100 with every
    constexpr branch the launchers pass, and each kernel's shared memory fits one block."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RLKERNEL_BACKEND")}
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_COMPILE_SCRIPT)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    report = proc.stdout[-4000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    lines = [line.split(" ", 2) for line in proc.stdout.splitlines() if line.startswith("ok ")]
    kernels_seen = {label.split()[0] for _, _, label in lines}
    expected = {f"linear_head_{m}._linear_head_{k}_kernel" for m, k in (("stats", "stats"), ("grad", "grad"),
                                                                       ("stats", "combine"))}  # fmt: skip
    assert kernels_seen == expected, report
    assert any("Z_TMA=True STORE_SPLIT=2" in label for *_, label in lines), report  # fp32 z in halves
    assert any("Z_TMA=False" in label and "STORE_Z=True" in label for *_, label in lines), report
    assert all(int(nbytes) <= H100_SHARED for _, nbytes, _ in lines), report


# ---------------------------------------------------------------------------------- bad input
def test_bad_inputs_raise():
    lh = kernels()
    h, w, ids = make(4, 16, 100)
    h12, w12 = h[:, :12].contiguous(), w[:, :12].contiguous()  # H = 12 bf16: a 24-byte row pitch
    stats = lh.linear_head_stats
    cases = [
        (TypeError, "h", lambda: stats(h.double(), w.double(), ids)),
        (TypeError, "w must have h's dtype", lambda: stats(h, w.float(), ids)),
        (TypeError, "ids", lambda: stats(h, w, ids.float())),
        (TypeError, "h must be a torch.Tensor", lambda: stats(h.tolist(), w, ids)),
        (ValueError, "h must be 2-D", lambda: stats(h[None], w, ids)),
        (ValueError, "h must be contiguous", lambda: stats(h.t().contiguous().t(), w, ids)),
        (ValueError, "w must be", lambda: stats(h, w[:, :8].contiguous(), ids)),
        (ValueError, "ids", lambda: stats(h, w, ids[:3])),
        (ValueError, "h must have a 16-byte aligned", lambda: stats(h12, w12, ids)),
        (ValueError, "temperature", lambda: stats(h, w, ids, temperature=0.0)),
        (ValueError, "temperature", lambda: stats(h, w, ids, temperature=float("nan"))),
        (TypeError, "temperature", lambda: stats(h, w, ids, temperature=True)),
        (TypeError, "ignore_index", lambda: stats(h, w, ids, ignore_index=1.5)),
        (TypeError, "with_entropy", lambda: stats(h, w, ids, with_entropy=1)),
        (ValueError, "store_z", lambda: stats(h, w, ids, store_z=torch.empty(4, 99, device=DEVICE))),
        (TypeError, "store_z", lambda: stats(h, w, ids, store_z=torch.empty(4, 100, dtype=torch.int32))),
        (TypeError, "config", lambda: stats(h, w, ids, config={"block_m": 16})),
    ]  # fmt: skip
    lse = torch.zeros(4, device=DEVICE)
    grad = torch.empty(4, 100, dtype=torch.bfloat16, device=DEVICE)

    def grad_into(**kw):
        args = {"lse": lse, "entropy": lse, "g_logp": lse, "g_ent": lse, "grad_out": grad, **kw}
        lh.linear_head_grad_into(h, w, ids, args["lse"], args["entropy"], args["g_logp"], args["g_ent"],
                                 args["grad_out"], config=small())  # fmt: skip

    cases += [
        (TypeError, "lse must be fp32", lambda: grad_into(lse=lse.double())),
        (ValueError, "g_logp", lambda: grad_into(g_logp=lse[:3])),
        (ValueError, "entropy must be given", lambda: grad_into(entropy=None)),
        (ValueError, "grad_out", lambda: grad_into(grad_out=grad.t())),
        (TypeError, "grad_out", lambda: grad_into(grad_out=grad.to(torch.int16))),
        (ValueError, "grad_out must be contiguous",
         lambda: grad_into(grad_out=torch.empty(100, 4, device=h.device).t())),  # fmt: skip
    ]
    parts, z_y = lh.stats_partials(h, w, ids, config=small())
    combine = lh.combine_partials
    cases += [
        (ValueError, "parts must be fp32", lambda: combine(parts[:1], z_y, ids, vocab_size=100)),
        (ValueError, "parts must be contiguous", lambda: combine(parts.mT, z_y, ids, vocab_size=100)),
        (ValueError, "z_y", lambda: combine(parts, z_y[:2], ids, vocab_size=100)),
        (TypeError, "ids", lambda: combine(parts, z_y, z_y, vocab_size=100)),
        (ValueError, "vocab_size", lambda: combine(parts, z_y, ids, vocab_size=0)),
    ]
    for error, words, call in cases:
        with pytest.raises(error, match=words):
            call()


def test_config_validation():
    lh = kernels()
    with pytest.raises(ValueError, match="block_n"):
        lh.LinearHeadConfig(block_n=96)
    with pytest.raises(ValueError, match="store_bytes"):
        lh.LinearHeadConfig(store_bytes=3000)
    # The default stages a 128x256 bf16 gradient tile in one piece, an fp32 logits tile in halves.
    assert [lh.LinearHeadConfig().store_split(size) for size in (2, 4)] == [1, 2]
    with pytest.raises(ValueError, match=">= 16"):
        lh.LinearHeadConfig(block_k=8)
    # The default depends on the dtype alone (never on M): one config per dtype.
    assert lh.default_config(torch.bfloat16) == lh.LinearHeadConfig(name="bf16_128x256x64")
    assert {lh.default_config(d).block_n for d in (torch.bfloat16, torch.float16)} == {256}
