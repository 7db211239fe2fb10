"""The linear path's whole-batch mode (``whole_batch``): every row in one gradient group, dweight from
one GEMM, and — in the fused loss — the dhidden/dweight GEMMs run in the backward with the upstream
gradient known. Checked against the float64 reference and against the grouped loop on the same
inputs, with padding compaction, bias, temperature, an upstream scale ≠ 1 and a retained graph.
CPU: ``torch.mm`` plus the Triton log-softmax kernels in the interpreter, tiny sizes."""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk
from _linear_helpers import autograd_coef_fn
from rlkernel.ops import _linear_engine as engine
from rlkernel.ops import _linear_function as lf
from rlkernel.reference import logprobs as ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
H, V, N = 16, 61, 45
CHUNK, GROUP = 8, 16  # the grouped loop runs 3 groups of 16 rows (the last one padded)


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")
    with rk.use_options(linear_logits_dtype="fp32"):
        yield


def make(dtype, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype).to(DEVICE)
    b = (torch.randn(V, generator=g) * 0.1).to(dtype).to(DEVICE) if bias else None
    ids = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    ids[[0, 7, 8, 30, N - 1]] = -100  # ignored rows: compacted away (first, chunk edges, last)
    ids[3], ids[4] = 0, V - 1
    return h, w, b, ids


def leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts if t is not None]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compact", [True, False])
def test_primitive_whole_batch_equals_grouped_and_reference(dtype, compact):
    h, w, b, ids = make(dtype)
    g = torch.Generator().manual_seed(1)
    gl, ge = torch.randn(N, generator=g).to(DEVICE), torch.randn(N, generator=g).to(DEVICE)
    kw = dict(bias=None, temperature=0.8, return_entropy=True, chunk_rows=CHUNK, grad_rows=GROUP)
    out = {}
    for whole in (True, False):
        params = leaves(h, w, b)
        kw["bias"] = params[2]
        logp, ent = lf.linear_token_logprobs_triton(
            params[0], params[1], ids, compact=compact, whole_batch=whole, **kw
        )
        out[whole] = (logp.detach(), ent.detach(), torch.autograd.grad((logp, ent), params, (gl, ge)))
    # The forward is the same loop either way: bitwise.
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])
    params = leaves(h, w, b)
    rlogp, rent = ref.linear_token_logprobs(
        params[0], params[1], ids, bias=params[2], temperature=0.8, return_entropy=True
    )
    rgrads = torch.autograd.grad((rlogp, rent), params, (gl, ge))
    for whole in (True, False):
        for got, want in zip(out[whole][2], rgrads, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert rel(got, want) <= TOL[dtype], whole
        assert bool((out[whole][2][0][[0, 7, 8, 30, N - 1]] == 0).all())  # ignored rows: exactly 0


def _fused(h, w, b, ids, coef, whole, scale, with_entropy=False, retain=False):
    params = leaves(h, w, b)

    def chunk_loss(rows, logp, entropy):
        part = (coef[rows] * logp).sum()
        return part - 0.05 * entropy.sum() if entropy is not None else part

    outs = lf.fused_linear_token_loss(
        params[0], params[1], params[2], ids, coef_fn=autograd_coef_fn(chunk_loss), temperature=0.9,
        with_entropy=with_entropy, chunk_rows=CHUNK, grad_rows=GROUP, whole_batch=whole,
    )  # fmt: skip
    loss = outs[0] * scale
    grads = torch.autograd.grad(loss, params, retain_graph=retain)
    if retain:  # a second backward through the retained graph: the same gradients again
        again = torch.autograd.grad(loss, params)
        for x, y in zip(grads, again, strict=True):
            assert torch.equal(x, y)
    return outs[0].detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_fused_loss_whole_batch_equals_grouped_and_reference(dtype, scale):
    h, w, b, ids = make(dtype, seed=2)
    coef = torch.randn(N, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    whole = _fused(h, w, b, ids, coef, True, scale, with_entropy=True)
    grouped = _fused(h, w, b, ids, coef, False, scale, with_entropy=True)
    assert torch.equal(whole[0], grouped[0])  # the loss: the same chunk loop
    params = leaves(h, w, b)
    rlogp, rent = ref.linear_token_logprobs(
        params[0], params[1], ids, bias=params[2], temperature=0.9, return_entropy=True
    )
    active = (ids != -100).to(torch.float64)
    rloss = ((coef.double() * rlogp.double() - 0.05 * rent.double()) * active).sum()
    rgrads = torch.autograd.grad(rloss * scale, params)
    torch.testing.assert_close(whole[0].double(), rloss.detach(), atol=1e-4, rtol=1e-5)
    for got_w, got_g, want in zip(whole[1], grouped[1], rgrads, strict=True):
        assert got_w.dtype == want.dtype and got_w.shape == want.shape
        assert rel(got_w, want) <= TOL[dtype]
        assert rel(got_w, got_g) <= TOL[dtype]


def test_fused_whole_batch_retained_graph_and_frozen_weight():
    h, w, b, ids = make(torch.float32, seed=4)
    coef = torch.randn(N, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    _fused(h, w, b, ids, coef, True, 0.5, retain=True)
    # A frozen weight has no accumulator to save: the grouped loop runs (dhidden per group).
    params = leaves(h)
    loss, _ = lf.fused_linear_token_loss(
        params[0], w, None, ids, coef_fn=autograd_coef_fn(lambda r, lp, e: (coef[r] * lp).sum()),
        chunk_rows=CHUNK, grad_rows=GROUP, whole_batch=True,
    )  # fmt: skip
    (dh,) = torch.autograd.grad(loss, params)
    rp = leaves(h)
    rloss = (coef * ref.linear_token_logprobs(rp[0], w, ids)).sum()
    assert rel(dh, torch.autograd.grad(rloss, rp)[0]) <= 1e-5


def test_whole_batch_rule():
    bf16, fp32 = torch.bfloat16, torch.float32
    # bf16 gradient, fp32 accumulator: rows ≤ group + H (the accumulator's extra half).
    assert engine.whole_batch_fits(8192, 4096, 4096, bf16, fp32)
    assert not engine.whole_batch_fits(8193, 4096, 4096, bf16, fp32)
    # accumulation in the weight's dtype, or fp32 inputs: rows ≤ group.
    assert engine.whole_batch_fits(4096, 4096, 4096, bf16, bf16)
    assert not engine.whole_batch_fits(4097, 4096, 4096, fp32, fp32)
    h, w, b, ids = make(torch.bfloat16)
    # cuBLAS chunks (the rule rounds the rows up to whole chunks; the epilogue kernel needs no padding)
    opts = rk.Options(linear_head_gemm="cublas")
    settings = engine.EngineSettings.from_options(opts, chunk_rows=CHUNK, grad_rows=GROUP)

    def eng(n, need_w, s=settings):
        return engine.make_engine(h[:n], w, None, ids[:n], 1.0, -100, s, need_dweight=need_w)

    # H = 16, group 16 rows, fp32 accumulator: whole batch up to 32 rows (4 chunks of 8).
    assert eng(32, True).whole_batch and eng(32, True).group_rows == 32
    assert not eng(33, True).whole_batch and eng(33, True).group_rows == GROUP
    assert not eng(8, False).whole_batch  # no dweight wanted
    assert not eng(0, True).whole_batch  # no rows
    never = engine.EngineSettings.from_options(opts, chunk_rows=CHUNK, whole_batch=False)
    always = engine.EngineSettings.from_options(opts, chunk_rows=CHUNK, grad_rows=8, whole_batch=True)
    assert not eng(8, True, never).whole_batch
    assert eng(N, True, always).whole_batch and eng(N, True, always).group_rows == 48
    with pytest.raises(ValueError, match="whole_batch"):
        engine.EngineSettings.from_options(rk.Options(), whole_batch="yes")


def test_second_backward_on_a_torch_that_cannot_tell_retained_graphs(monkeypatch):
    """torch < 2.5 (``graph_retained()`` is None): the grouped loop hands its buffers out and says why
    a second backward cannot run; the whole batch keeps its rows and runs it right."""
    import rlkernel.ops._autograd as autograd_state

    monkeypatch.setattr(autograd_state, "graph_retained", lambda: None)  # seam: fake torch < 2.5
    h, w, b, ids = make(torch.float32, seed=6)
    coef = torch.randn(N, generator=torch.Generator().manual_seed(7)).to(DEVICE)

    def loss_of(whole, params):
        return lf.fused_linear_token_loss(
            params[0], params[1], None, ids, coef_fn=autograd_coef_fn(lambda r, lp, e: (coef[r] * lp).sum()),
            chunk_rows=CHUNK, grad_rows=GROUP, whole_batch=whole,
        )[0]  # fmt: skip

    grouped = loss_of(False, leaves(h, w))
    grouped.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cannot tell whether a backward retains"):
        grouped.backward()
    params = leaves(h, w)
    whole = loss_of(True, params)
    whole.backward(retain_graph=True)
    once = [p.grad.clone() for p in params]
    whole.backward()
    for p, g in zip(params, once, strict=True):
        torch.testing.assert_close(p.grad, 2 * g)
