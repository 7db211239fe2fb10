"""token_logprobs on the reference path: exact math, gradients, properties and bad input."""

import pytest
import torch

import rlkernel as rk
from rlkernel.reference import logprobs as ref

# (atol, rtol) of fp32 log-prob math against a float64 oracle on the same input values.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-5, 1e-5), torch.float16: (1e-5, 1e-5)}


def oracle(logits, ids, temperature=1.0, ignore_index=-100):
    """float64 log-softmax / entropy written from the definition, one row at a time."""
    x = logits.double().reshape(-1, logits.shape[-1]) / temperature
    flat = ids.reshape(-1)
    logp = torch.zeros(x.shape[0], dtype=torch.float64)
    ent = torch.zeros(x.shape[0], dtype=torch.float64)
    for i in range(x.shape[0]):
        if flat[i] == ignore_index:
            continue
        m = x[i].max()
        lse = m + torch.log(torch.exp(x[i] - m).sum())
        p = torch.exp(x[i] - lse)
        logp[i] = x[i, flat[i]] - lse
        ent[i] = -(p * (x[i] - lse)).sum()
    return logp.reshape(ids.shape), ent.reshape(ids.shape)


def make(n_lead=(3, 5), vocab=37, dtype=torch.float32, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*n_lead, vocab, generator=g) * scale).to(dtype)
    ids = torch.randint(0, vocab, n_lead, generator=g)
    return logits, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("vocab", [1, 3, 37, 300])
def test_matches_float64_oracle(dtype, temperature, vocab):
    logits, ids = make(vocab=vocab, dtype=dtype, seed=vocab)
    ids[0, 1] = -100
    logp, ent = rk.token_logprobs(logits, ids, temperature=temperature, return_entropy=True)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    exp_logp, exp_ent = oracle(logits, ids, temperature)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(logp.double(), exp_logp, atol=atol, rtol=rtol)
    torch.testing.assert_close(ent.double(), exp_ent, atol=atol, rtol=rtol)
    assert logp[0, 1] == 0 and ent[0, 1] == 0


def test_float64_in_float64_out():
    logits, ids = make(dtype=torch.float64)
    logp = rk.token_logprobs(logits, ids)
    assert logp.dtype == torch.float64
    torch.testing.assert_close(logp, oracle(logits, ids)[0], atol=1e-12, rtol=1e-12)


def test_properties_normalization_shift_entropy_bounds():
    logits, _ = make(n_lead=(4,), vocab=11)
    all_ids = torch.arange(11).expand(4, 11)
    logp_all = torch.stack([rk.token_logprobs(logits, all_ids[:, v]) for v in range(11)], -1)
    torch.testing.assert_close(logp_all.exp().sum(-1), torch.ones(4), atol=1e-6, rtol=0)
    ids = torch.randint(0, 11, (4,))
    shifted = rk.token_logprobs(logits + 5.0, ids)
    torch.testing.assert_close(shifted, rk.token_logprobs(logits, ids), atol=1e-5, rtol=0)
    _, ent = rk.token_logprobs(logits, ids, return_entropy=True)
    assert bool((ent >= 0).all()) and bool((ent <= torch.log(torch.tensor(11.0)) + 1e-5).all())


def test_strided_input_without_copy_semantics():
    logits, ids = make(n_lead=(2, 6), vocab=19)
    sliced = logits[:, :-1]
    assert not sliced.is_contiguous()
    out = rk.token_logprobs(sliced, ids[:, 1:])
    torch.testing.assert_close(out, rk.token_logprobs(sliced.contiguous(), ids[:, 1:]), atol=0, rtol=0)


def test_empty_input():
    logits = torch.randn(0, 7)
    ids = torch.zeros(0, dtype=torch.long)
    logp, ent = rk.token_logprobs(logits, ids, return_entropy=True)
    assert logp.shape == (0,) and ent.shape == (0,)


def test_neg_inf_logit_has_zero_probability_and_finite_entropy():
    logits = torch.tensor([[0.0, float("-inf"), 1.0]])
    logp, ent = rk.token_logprobs(logits, torch.tensor([2]), return_entropy=True)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()


def test_nan_propagates():
    logits, ids = make(n_lead=(3,), vocab=5)
    logits[1, 2] = float("nan")
    logp, ent = rk.token_logprobs(logits, ids, return_entropy=True)
    assert torch.isnan(logp[1]) and torch.isnan(ent[1]) and torch.isfinite(logp[0])


@pytest.mark.parametrize("which", ["logp", "entropy", "both"])
def test_gradient_matches_analytic_formula(which):
    logits, ids = make(n_lead=(6,), vocab=13, dtype=torch.float64)
    ids[2] = -100
    logits.requires_grad_(True)
    t = 0.8
    logp, ent = rk.token_logprobs(logits, ids, temperature=t, return_entropy=True)
    g_logp = torch.randn(6, dtype=torch.float64) if which != "entropy" else None
    g_ent = torch.randn(6, dtype=torch.float64) if which != "logp" else None
    loss = (logp * g_logp).sum() if g_logp is not None else 0
    loss = loss + ((ent * g_ent).sum() if g_ent is not None else 0)
    loss.backward()
    active = ids != -100
    safe = torch.where(active, ids, 0)
    zero = torch.zeros(6, dtype=torch.float64)
    expected = ref.logprob_grad_from_logits(
        logits.detach() / t,
        safe,
        None if g_logp is None else torch.where(active, g_logp, zero),
        None if g_ent is None else torch.where(active, g_ent, zero),
        t,
    )
    torch.testing.assert_close(logits.grad, expected, atol=1e-12, rtol=1e-10)
    assert bool((logits.grad[2] == 0).all())


def test_gradcheck_float64():
    logits, ids = make(n_lead=(2, 3), vocab=7, dtype=torch.float64)
    ids[1, 0] = -100
    logits.requires_grad_(True)

    def f(x):
        logp, ent = rk.token_logprobs(x, ids, temperature=1.1, return_entropy=True)
        return logp, ent

    assert torch.autograd.gradcheck(f, (logits,))


def test_bf16_gradient_dtype_and_values():
    logits, ids = make(n_lead=(4,), vocab=50, dtype=torch.bfloat16)
    logits.requires_grad_(True)
    rk.token_logprobs(logits, ids).sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    expected = ref.logprob_grad_from_logits(logits.detach().float(), ids, torch.ones(4), None, 1.0)
    torch.testing.assert_close(logits.grad.float(), expected, atol=4e-3, rtol=1e-2)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(logits=torch.randn(3, 5).long()), TypeError, "logits"),
        (dict(token_ids=torch.zeros(3)), TypeError, "token_ids"),
        (dict(token_ids=torch.zeros(4, dtype=torch.long)), ValueError, "token_ids must have shape"),
        (dict(token_ids=torch.tensor([0, 5, 1])), ValueError, r"outside \[0, 5\)"),
        (dict(token_ids=torch.tensor([0, -1, 1])), ValueError, "token_ids has 1 id"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(logits=torch.randn(3, 0)), ValueError, "vocabulary"),
        (dict(logits=torch.randn(())), ValueError, "logits must have at least 1"),
        (dict(logits=[[1.0]]), TypeError, "logits must be a torch.Tensor"),
        (dict(token_ids=torch.zeros(3, dtype=torch.long, device="meta")), ValueError, "device"),
    ],
)
def test_bad_input(kwargs, exc, match):
    args = dict(logits=torch.randn(3, 5), token_ids=torch.tensor([0, 4, 1]))
    temperature = kwargs.pop("temperature", 1.0)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        rk.token_logprobs(args["logits"], args["token_ids"], temperature=temperature)


def test_validate_false_skips_only_the_range_check():
    # Out-of-range ids are the caller's responsibility with validate=False; shapes are still checked.
    with pytest.raises(ValueError, match="token_ids must have shape"):
        rk.token_logprobs(torch.randn(3, 5), torch.zeros(2, dtype=torch.long), validate=False)
    out = rk.token_logprobs(torch.randn(3, 5), torch.tensor([0, 1, 2]), validate=False)
    assert out.shape == (3,)


def test_custom_ignore_index():
    logits, ids = make(n_lead=(4,), vocab=9)
    ids[3] = 7
    logp = rk.token_logprobs(logits, ids, ignore_index=7)
    assert logp[3] == 0 and logp[0] != 0


def test_ignored_rows_with_garbage_get_exact_zero_gradient():
    logits, ids = make(n_lead=(4,), vocab=9)
    logits[1] = float("nan")
    logits[2, 3] = float("inf")
    ids[1] = ids[2] = -100
    logits.requires_grad_(True)
    logp, ent = rk.token_logprobs(logits, ids, return_entropy=True)
    (logp.sum() + ent.sum()).backward()
    assert torch.isfinite(logits.grad).all()
    assert bool((logits.grad[1:3] == 0).all()) and bool((logits.grad[0] != 0).any())
