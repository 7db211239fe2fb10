"""Zero-size dimensions through every public op, on both backends: the mathematically right result
(what ``F.linear`` / an empty reduction gives) or a clear ValueError, never a reshape crash.

Walked: token_logprobs (N, B, T, V), linear_token_logprobs (N, B, T, H, V), policy_loss (B, T,
packed N, S), fused_policy_loss (logits: B, T, V; hidden: B, T, H, V), group_advantages, kl_penalty,
global_normalizers (B, T, packed N), invariant.linear/matmul (M, K, N and combinations),
rms_norm (M, heads, H), attention (B, Tq, Tk, Hq, Hkv, D, packed N), and the vocab-parallel
primitive (H) on a one-rank gloo group. The Triton backend runs in the interpreter on CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import rlkernel as rk
from rlkernel import invariant as inv
from rlkernel.distributed import global_normalizers

BACKENDS = ["reference", "triton"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "triton" and torch.cuda.is_available():
        pytest.skip("CPU tensors reach the Triton kernels only in the interpreter (CPU suite)")
    with rk.use_backend(request.param):
        yield request.param


pytestmark = pytest.mark.usefixtures("smallest_linear_chunks")  # tests/conftest.py


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def _grads(out, leaves):
    """Gradients of ``Σ out·r`` (r random) with respect to ``leaves``; zeros for unused leaves
    are not accepted (``allow_unused=False``): every input must stay in the graph."""
    r = torch.randn(out.shape, generator=_gen(99)).to(out.dtype)
    return torch.autograd.grad((out * r).sum(), leaves)


# ------------------------------------------------------------------------------- token_logprobs
@pytest.mark.parametrize("lead", [(0,), (0, 3), (2, 0)])
def test_token_logprobs_zero_tokens(backend, lead):
    g = _gen(1)
    logits = _randn(g, *lead, 7).requires_grad_()
    ids = torch.randint(0, 7, lead, generator=g)
    logp, ent = rk.token_logprobs(logits, ids, return_entropy=True)
    assert logp.shape == lead and ent.shape == lead and logp.dtype == torch.float32
    (grad,) = torch.autograd.grad(logp.sum() + ent.sum(), [logits])
    assert grad.shape == logits.shape


@pytest.mark.parametrize("lead", [(3,), (0,)])
def test_token_logprobs_zero_vocab_is_a_clear_error(backend, lead):
    with pytest.raises(ValueError, match="logits must have a vocabulary dimension >= 1"):
        rk.token_logprobs(torch.zeros(*lead, 0), torch.zeros(lead, dtype=torch.long))


# ------------------------------------------------------------------------ linear_token_logprobs
@pytest.mark.parametrize("lead", [(0,), (0, 3), (2, 0)])
def test_linear_token_logprobs_zero_tokens(backend, lead):
    g = _gen(2)
    hidden = _randn(g, *lead, 4).requires_grad_()
    weight = _randn(g, 9, 4).requires_grad_()
    ids = torch.randint(0, 9, lead, generator=g)
    logp, ent = rk.linear_token_logprobs(hidden, weight, ids, return_entropy=True)
    assert logp.shape == lead and ent.shape == lead
    dh, dw = torch.autograd.grad(logp.sum() + ent.sum(), [hidden, weight])
    assert dh.shape == hidden.shape and torch.equal(dw, torch.zeros_like(weight))


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_token_logprobs_zero_hidden_size(backend, with_bias, dtype):
    """H = 0: the logits are the bias (or 0), as ``F.linear`` gives; without a bias every token has
    logp = −log V and the entropy is log V."""
    g = _gen(3)
    n, vocab = 5, 11
    hidden = torch.empty(n, 0, dtype=dtype, requires_grad=True)
    weight = torch.empty(vocab, 0, dtype=dtype, requires_grad=True)
    bias = _randn(g, vocab, dtype=dtype).requires_grad_() if with_bias else None
    ids = torch.randint(0, vocab, (n,), generator=g)
    ids[2] = -100
    temperature = 0.7
    logp, ent = rk.linear_token_logprobs(
        hidden, weight, ids, bias=bias, temperature=temperature, return_entropy=True
    )
    logits = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    want_logp, want_ent = rk.token_logprobs(logits, ids, temperature=temperature, return_entropy=True)
    torch.testing.assert_close(logp.double(), want_logp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent.double(), want_ent, atol=1e-6, rtol=1e-6)
    if bias is None:
        active = ids != -100
        torch.testing.assert_close(logp[active], torch.full((4,), -math.log(vocab)))
        torch.testing.assert_close(ent[active], torch.full((4,), math.log(vocab)))
    assert logp[2] == 0 and ent[2] == 0
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    got = torch.autograd.grad(logp.sum() + 0.5 * ent.sum(), leaves)
    want = torch.autograd.grad(want_logp.sum() + 0.5 * want_ent.sum(), leaves)
    assert got[0].shape == (n, 0) and got[1].shape == (vocab, 0)
    if bias is not None:
        torch.testing.assert_close(got[2].double(), want[2].double(), atol=1e-2, rtol=1e-2)


def test_linear_token_logprobs_zero_vocab_is_a_clear_error(backend):
    with pytest.raises(ValueError, match="weight must have at least one vocabulary row"):
        rk.linear_token_logprobs(torch.randn(3, 4), torch.randn(0, 4), torch.full((3,), -100))


# ---------------------------------------------------------------------------------- policy_loss
@pytest.mark.parametrize("preset", ["dapo", "gspo", "gmpo", "cispo"])
@pytest.mark.parametrize("shape", [(0, 4), (3, 0)])
def test_policy_loss_empty_batch_gives_zero_loss(backend, preset, shape):
    g = _gen(4)
    b, _ = shape
    logp = (-_randn(g, *shape).abs()).requires_grad_()
    out = rk.policy_loss(
        logp, -_randn(g, *shape).abs(), _randn(g, b), torch.ones(shape), rk.PolicyLossConfig.preset(preset)
    )
    assert out.loss.item() == 0.0 and all(torch.isfinite(v) for v in out.metrics.values())
    (grad,) = torch.autograd.grad(out.loss, [logp], allow_unused=True)
    assert grad is None or grad.shape == shape


@pytest.mark.parametrize("cu", [[0], [0, 0, 0]])
def test_policy_loss_packed_empty(backend, cu):
    cfg = rk.PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01)
    e = torch.empty(0)
    out = rk.policy_loss(
        e, e, torch.zeros(len(cu) - 1), e, cfg, ref_logp=e, entropy=e, cu_seqlens=torch.tensor(cu)
    )
    assert out.loss.item() == 0.0


# ---------------------------------------------------------------------------- fused_policy_loss
def _fused_batch(g, b, t, vocab):
    return dict(
        token_ids=torch.randint(0, vocab, (b, t), generator=g),
        old_logp=-_randn(g, b, t).abs(),
        advantages=_randn(g, b),
        mask=torch.ones(b, t),
        ref_logp=-_randn(g, b, t).abs(),
    )


CFGS = {
    "ppo_kl_entropy": rk.PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01),
    "gspo": rk.PolicyLossConfig.preset("gspo"),
}


@pytest.mark.parametrize("cfg", list(CFGS))
@pytest.mark.parametrize("shape", [(0, 3), (2, 0)])
def test_fused_policy_loss_zero_tokens(backend, cfg, shape):
    g = _gen(5)
    batch = _fused_batch(g, *shape, 7)
    logits = _randn(g, *shape, 7).requires_grad_()
    out = rk.fused_policy_loss(CFGS[cfg], logits=logits, **batch)
    assert out.loss.item() == 0.0
    hidden = _randn(g, *shape, 4).requires_grad_()
    weight = _randn(g, 7, 4).requires_grad_()
    out = rk.fused_policy_loss(CFGS[cfg], hidden=hidden, weight=weight, **batch)
    assert out.loss.item() == 0.0
    dh, dw = torch.autograd.grad(out.loss, [hidden, weight], allow_unused=True)
    assert dh is None or torch.equal(dh, torch.zeros_like(hidden))
    assert dw is None or torch.equal(dw, torch.zeros_like(weight))


@pytest.mark.parametrize("cfg", list(CFGS))
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_policy_loss_zero_hidden_size(backend, cfg, with_bias):
    """H = 0: the same loss as the logits path on ``F.linear``'s logits (the bias, or zeros)."""
    g = _gen(6)
    b, t, vocab = 2, 3, 7
    batch = _fused_batch(g, b, t, vocab)
    hidden = torch.empty(b, t, 0, requires_grad=True)
    weight = torch.empty(vocab, 0, requires_grad=True)
    bias = _randn(g, vocab).requires_grad_() if with_bias else None
    out = rk.fused_policy_loss(CFGS[cfg], hidden=hidden, weight=weight, bias=bias, **batch)
    logits = F.linear(hidden, weight, bias)
    want = rk.fused_policy_loss(CFGS[cfg], logits=logits, **batch)
    torch.testing.assert_close(out.loss, want.loss, atol=1e-6, rtol=1e-6)
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    got = torch.autograd.grad(out.loss, leaves)
    exp = torch.autograd.grad(want.loss, leaves)
    for a, e in zip(got, exp, strict=True):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("cfg", list(CFGS))
def test_fused_policy_loss_zero_vocab_is_a_clear_error(backend, cfg):
    g = _gen(7)
    batch = _fused_batch(g, 2, 3, 1)  # active ids (0) that no vocabulary of size 0 can hold
    with pytest.raises(ValueError, match="logits must have a vocabulary dimension >= 1"):
        rk.fused_policy_loss(CFGS[cfg], logits=torch.zeros(2, 3, 0), **batch)
    with pytest.raises(ValueError, match="weight must have at least one vocabulary row"):
        rk.fused_policy_loss(CFGS[cfg], hidden=torch.zeros(2, 3, 4), weight=torch.zeros(0, 4), **batch)


# ------------------------------------------------------------ advantages, KL, global normalizers
def test_group_advantages_kl_and_normalizers_empty(backend):
    for estimator in ("grpo", "dr_grpo", "rloo"):
        assert rk.group_advantages(torch.empty(0), 4, estimator=estimator).shape == (0,)
    assert rk.group_advantages(torch.empty(0), group_ids=torch.empty(0, dtype=torch.long)).shape == (0,)
    assert rk.kl_penalty(torch.empty(0, 3), torch.empty(0, 3)).shape == (0, 3)
    for mask, cu in ((torch.ones(0, 4), None), (torch.ones(3, 0), None), (torch.ones(0), torch.tensor([0]))):
        tokens, seqs = global_normalizers(mask, cu_seqlens=cu)
        assert tokens.item() == 0 and seqs.item() == 0


# --------------------------------------------------------------------------- invariant.linear
MKN = [(0, 4, 3), (2, 0, 3), (2, 4, 0), (0, 0, 3), (2, 0, 0), (0, 4, 0), (0, 0, 0)]


@pytest.mark.parametrize("m, k, n", MKN)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_zero_size(backend, m, k, n, with_bias, dtype):
    """Exactly ``F.linear``: K = 0 gives the bias (or zeros), any other zero gives an empty result;
    gradients have the inputs' shapes (dbias = Σ_rows dy, the rest zeros or empty)."""
    g = _gen(8)
    x = _randn(g, m, k, dtype=dtype).requires_grad_()
    w = _randn(g, n, k, dtype=dtype).requires_grad_()
    b = _randn(g, n, dtype=dtype).requires_grad_() if with_bias else None
    out = inv.linear(x, w, b)
    want = F.linear(x, w, b)
    assert out.shape == want.shape and out.dtype == dtype
    assert torch.equal(out, want)
    leaves = [t for t in (x, w, b) if t is not None]
    for got, exp in zip(_grads(out, leaves), _grads(want, leaves), strict=True):
        assert got.shape == exp.shape
        torch.testing.assert_close(got, exp)
    # without autograd (the decode fast path) and with a 3-D x
    with torch.no_grad():
        assert torch.equal(inv.linear(x.detach(), w.detach(), b), want.detach())
        x3 = x.detach().reshape(1, m, k)
        assert torch.equal(inv.linear(x3, w.detach(), b), want.detach().reshape(1, m, n))


@pytest.mark.parametrize("m, k, n", MKN)
def test_matmul_zero_size(backend, m, k, n):
    g = _gen(9)
    a = _randn(g, m, k).requires_grad_()
    bm = _randn(g, k, n).requires_grad_()
    out = inv.matmul(a, bm)
    want = a @ bm
    assert torch.equal(out, want)
    for got, exp in zip(_grads(out, [a, bm]), _grads(want, [a, bm]), strict=True):
        assert got.shape == exp.shape
        torch.testing.assert_close(got, exp)


# ---------------------------------------------------------------------------------- rms_norm
def test_rms_norm_zero_rows_and_heads(backend):
    g = _gen(10)
    for shape in ((0, 8), (3, 0, 8), (0, 2, 8)):
        x = _randn(g, *shape).requires_grad_()
        w = _randn(g, 8).requires_grad_()
        out = inv.rms_norm(x, w)
        assert out.shape == shape
        dx, dw = torch.autograd.grad(out.sum(), [x, w])
        assert dx.shape == shape and torch.equal(dw, torch.zeros(8))
    with pytest.raises(ValueError, match="x must have a hidden dimension >= 1"):
        inv.rms_norm(torch.zeros(3, 0), torch.zeros(0))


# --------------------------------------------------------------------------------- attention
ATTN = {  # (B, Tq, Tk, Hq, Hkv, D)
    "B=0": (0, 3, 3, 2, 1, 8),
    "Tq=Tk=0": (2, 0, 0, 2, 1, 8),
    "Tq=0": (2, 0, 3, 2, 1, 8),
    "Hq=0": (2, 3, 3, 0, 1, 8),
}


@pytest.mark.parametrize("case", list(ATTN))
def test_attention_zero_size(backend, case):
    """Empty outputs, and gradients of the inputs' shapes (zeros: nothing reaches them) on both
    backends; the reference used to return a result with no autograd history for Tq = 0."""
    b, tq, tk, hq, hkv, d = ATTN[case]
    g = _gen(11)
    q = _randn(g, b, tq, hq, d).requires_grad_()
    k = _randn(g, b, tk, hkv, d).requires_grad_()
    v = _randn(g, b, tk, hkv, d).requires_grad_()
    out = inv.attention(q, k, v)
    assert out.shape == q.shape and out.numel() == 0
    for grad, t in zip(torch.autograd.grad(out.sum(), [q, k, v]), (q, k, v), strict=True):
        assert torch.equal(grad, torch.zeros_like(t))


@pytest.mark.parametrize("cu_q, cu_k", [([0], [0]), ([0, 0, 0], [0, 0, 0]), ([0, 0], [0, 3])])
def test_attention_packed_zero_queries(backend, cu_q, cu_k):
    g = _gen(12)
    q = _randn(g, 0, 2, 8).requires_grad_()
    k = _randn(g, cu_k[-1], 1, 8).requires_grad_()
    v = _randn(g, cu_k[-1], 1, 8).requires_grad_()
    out = inv.attention(q, k, v, cu_seqlens_q=torch.tensor(cu_q), cu_seqlens_k=torch.tensor(cu_k))
    assert out.shape == (0, 2, 8)
    for grad, t in zip(torch.autograd.grad(out.sum(), [q, k, v]), (q, k, v), strict=True):
        assert torch.equal(grad, torch.zeros_like(t))


def test_attention_zero_heads_or_head_dim_is_a_clear_error(backend):
    with pytest.raises(ValueError, match="head_dim"):
        inv.attention(torch.zeros(1, 2, 2, 0), torch.zeros(1, 2, 1, 0), torch.zeros(1, 2, 1, 0))
    with pytest.raises(ValueError, match="number of kv heads"):
        inv.attention(torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 0, 8), torch.zeros(1, 2, 0, 8))


# ------------------------------------------------------------------------ vocab-parallel (H = 0)


def test_vocab_parallel_zero_hidden_size(one_rank_group):
    g = _gen(13)
    vocab = 6
    hidden = torch.empty(4, 0, requires_grad=True)
    weight = torch.empty(vocab, 0, requires_grad=True)
    bias = _randn(g, vocab).requires_grad_()
    ids = torch.randint(0, vocab, (4,), generator=g)
    logp, ent = rk.linear_token_logprobs(
        hidden, weight, ids, bias=bias, tp_group=one_rank_group, return_entropy=True
    )
    want_logp, want_ent = rk.token_logprobs(F.linear(hidden, weight, bias), ids, return_entropy=True)
    torch.testing.assert_close(logp, want_logp)
    torch.testing.assert_close(ent, want_ent)
    dh, dw, db = torch.autograd.grad(logp.sum() + ent.sum(), [hidden, weight, bias])
    (want_db,) = torch.autograd.grad(want_logp.sum() + want_ent.sum(), [bias])
    assert dh.shape == (4, 0) and dw.shape == (vocab, 0)
    torch.testing.assert_close(db, want_db)
