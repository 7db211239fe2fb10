"""linear_token_logprobs on the reference path: equals token_logprobs of the explicit logits."""

import pytest
import torch

import rlkernel as rk
from rlkernel.reference import logprobs as ref


def make(n=(2, 5), hidden=8, vocab=23, dtype=torch.float64, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*n, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(dtype)
    b = (torch.randn(vocab, generator=g) * 0.1).to(dtype) if bias else None
    ids = torch.randint(0, vocab, n, generator=g)
    return h, w, b, ids


def explicit(h, w, b, ids, **kw):
    logits = h @ w.t() + (b if b is not None else 0)
    return rk.token_logprobs(logits, ids, **kw)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("chunk_rows", [None, 1, 3, 100])
def test_forward_backward_match_explicit_logits(bias, chunk_rows):
    h, w, b, ids = make(bias=bias)
    ids[1, 2] = -100
    leaves = [t.requires_grad_(True) for t in (h, w, b) if t is not None]
    kw = dict(temperature=0.9, return_entropy=True)
    logp, ent = ref.linear_token_logprobs(h, w, ids, bias=b, chunk_rows=chunk_rows, **kw)
    g1, g2 = torch.randn_like(logp), torch.randn_like(ent)
    grads = torch.autograd.grad((logp * g1).sum() + (ent * g2).sum(), leaves)
    exp_logp, exp_ent = explicit(h, w, b, ids, **kw)
    exp_grads = torch.autograd.grad((exp_logp * g1).sum() + (exp_ent * g2).sum(), leaves)
    torch.testing.assert_close(logp, exp_logp, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ent, exp_ent, atol=1e-12, rtol=1e-12)
    for got, want in zip(grads, exp_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    assert logp[1, 2] == 0 and ent[1, 2] == 0 and bool((grads[0][1, 2] == 0).all())


def test_public_op_float32_and_bf16():
    h, w, b, ids = make(dtype=torch.float32)
    got = rk.linear_token_logprobs(h, w, ids, bias=b)
    expected = explicit(h.double(), w.double(), b.double(), ids).float()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    hb, wb, bb = h.bfloat16(), w.bfloat16(), b.bfloat16()
    got_bf16 = rk.linear_token_logprobs(hb, wb, ids, bias=bb)
    assert got_bf16.dtype == torch.float32
    # fp32 logits from the bf16 operands (no half-precision rounding of the logits)
    want = explicit(hb.double(), wb.double(), bb.double(), ids)
    torch.testing.assert_close(got_bf16.double(), want, atol=1e-5, rtol=1e-5)


def test_gradcheck_float64():
    h, w, b, ids = make(n=(4,), hidden=5, vocab=7)
    ids[0] = -100
    for t in (h, w, b):
        t.requires_grad_(True)

    def f(h_, w_, b_):
        return ref.linear_token_logprobs(h_, w_, ids, bias=b_, chunk_rows=3, return_entropy=True)

    assert torch.autograd.gradcheck(f, (h, w, b))


def test_frozen_weight_gets_no_gradient():
    h, w, b, ids = make(bias=False)
    h.requires_grad_(True)
    rk.linear_token_logprobs(h, w, ids).sum().backward()
    assert w.grad is None and h.grad is not None


def test_chunk_rule_bounds_rows():
    assert ref.chunk_rows_for(151936, 10**6) == 110
    assert ref.chunk_rows_for(32768, 10**6) == 512
    assert ref.chunk_rows_for(32768, 7) == 7
    assert ref.chunk_rows_for(10**9, 5) == 1


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda a: a.update(weight=a["weight"][:, :-1]), ValueError, "weight must be"),
        (lambda a: a.update(weight=a["weight"].float()), TypeError, "dtype"),
        (lambda a: a.update(bias=a["bias"][:-1]), ValueError, "bias must have shape"),
        (lambda a: a.update(token_ids=a["token_ids"][:, :-1]), ValueError, "token_ids must have shape"),
        (lambda a: a.update(token_ids=a["token_ids"] + 100), ValueError, "outside"),
        (lambda a: a.update(hidden=a["hidden"].long()), TypeError, "hidden"),
        (lambda a: a.update(weight=a["weight"].to("meta")), ValueError, "weight must be on"),
    ],
)
def test_bad_input(mutate, exc, match):
    h, w, b, ids = make()
    args = dict(hidden=h, weight=w, bias=b, token_ids=ids)
    mutate(args)
    with pytest.raises(exc, match=match):
        rk.linear_token_logprobs(args["hidden"], args["weight"], args["token_ids"], bias=args["bias"])


@pytest.mark.parametrize("group", [object(), "world", 0])
def test_tp_group_must_be_a_process_group(group):
    """Raised locally, before any collective (the vocab-parallel path itself: tests/distributed)."""
    h, w, b, ids = make()
    with pytest.raises(TypeError, match="tp_group must be a torch.distributed ProcessGroup"):
        rk.linear_token_logprobs(h, w, ids, tp_group=group)


def test_ignored_rows_with_garbage_hidden_do_not_reach_any_gradient():
    h, w, b, ids = make(n=(5,), dtype=torch.float32)
    h[2] = float("nan")
    ids[2] = -100
    for t in (h, w, b):
        t.requires_grad_(True)
    logp, ent = rk.linear_token_logprobs(h, w, ids, bias=b, return_entropy=True)
    (logp.sum() + ent.sum()).backward()
    assert torch.isfinite(logp).all() and logp[2] == 0
    assert bool((h.grad[2] == 0).all()) and torch.isfinite(h.grad).all()
    assert torch.isfinite(w.grad).all() and torch.isfinite(b.grad).all()
