"""The chunked linear path (hidden states → log-probs / DAPO-KL loss, no ``[N, V]`` logits) at real
sizes: against the fp32 chunked reference, the fused loss against the composed path, a batch with
N·V > 2^31, bitwise row invariance across N, bitwise determinism.

Inputs: hidden ``randn [N, H]`` bf16, weight ``2·randn/√H [V, H]`` bf16 (logits of std ≈ 2), bias
``0.1·randn [V]``, ids uniform with every 97th ``ignore_index``; N = 8192, H = 4096, V = 151,936;
temperature 0.9. The loss inputs are ``[B, T]`` with T = 1024, lengths uniform in [0.8 T, T],
old/ref log-probs = the true log-probs + 0.1·randn, per-sequence advantages ``randn``.

Tolerances (logp/entropy max |Δ|, gradients ‖Δ‖/‖ref‖): fp32 chunk logits give log-probs within
1e-4 of the fp32 reference (a bf16 GEMM with fp32 output sums K = 4096 products in another order;
measured 6e-5); bf16 chunk logits (``linear_logits_dtype="input"``) are rounded to bf16 first
(~|z|·2^-9: 1e-1); every bf16 gradient within 1e-2 (DESIGN, bf16 matmul-bearing ops). The fused
loss against the composed GPU path (same bf16 rounding of ∂L/∂z before the backward GEMMs): loss
1e-5, gradients 2e-3 relative; against the fp32 reference, whose backward GEMMs run in fp32, the
bf16 rounding is amplified by tokens that cross a clip boundary: loss 1e-4, gradients 2e-2.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import rlkernel as rk
from _linear_helpers import autograd_coef_fn, ppo_kl_chunk_loss
from rlkernel.ops import _linear_function as lf
from rlkernel.reference import logprobs as ref

from .conftest import DEVICE, SIZES, SMOKE, generator, no_tf32, real_size_only, rel_err

pytestmark = pytest.mark.gpu

S = SIZES.linear
T = 0.9
KL = 1e-3
# (logits dtype option) -> max |Δ| of logp and entropy against the fp32 reference
LOGP_ATOL = {"fp32": 1e-4, "input": 1e-1}
GRAD_RTOL = 1e-2
FUSED_TOL = {"composed": (1e-5, 2e-3), "reference": (1e-4, 2e-2)}  # (loss rel, grad rel)


@pytest.fixture(autouse=True)
def small_chunks_in_smoke_mode(request):
    """Smoke mode: 16-row chunks (the real budgets pad every call to thousands of rows, minutes in
    the interpreter). On the GPU the production chunk rule runs."""
    if SMOKE:
        request.getfixturevalue("smallest_linear_chunks")


@pytest.fixture(autouse=True)
def fp32_references_without_tf32():
    """The fp32 reference's GEMMs in true fp32 (with TF32 it would be a 1e-3 reference)."""
    with no_tf32():
        yield


def make_inputs(n: int, seed: int, bias: bool = True) -> SimpleNamespace:
    g = generator(seed)
    h, v = S.hidden, S.vocab
    hidden = torch.randn(n, h, device=DEVICE, generator=g, dtype=torch.bfloat16)
    weight = torch.randn(v, h, device=DEVICE, generator=g, dtype=torch.bfloat16).mul_(2 * h**-0.5)
    b = torch.randn(v, device=DEVICE, generator=g, dtype=torch.bfloat16).mul_(0.1) if bias else None
    ids = torch.randint(0, v, (n,), device=DEVICE, generator=g)
    ids[::97] = -100
    return SimpleNamespace(hidden=hidden, weight=weight, bias=b, ids=ids)


def leaves(inp, *, weight=True):
    """Fresh leaf copies of (hidden, weight, bias), the weight frozen unless ``weight``."""
    return [
        inp.hidden.detach().requires_grad_(True),
        inp.weight.detach().requires_grad_(weight),
        None if inp.bias is None else inp.bias.detach().requires_grad_(True),
    ]


def upstream(n: int):
    """Random upstream gradients of logp and entropy (entropy's scaled by 0.1)."""
    g = generator(5)
    return torch.randn(n, device=DEVICE, generator=g), 0.1 * torch.randn(n, device=DEVICE, generator=g)


def logp_entropy_grads(fn, inp, gl, ge):
    """``fn(hidden, weight, ids, bias=...) -> (logp, entropy)``, and the (hidden, weight, bias)
    gradients of Σ gl·logp + Σ ge·entropy."""
    hl, wl, bl = leaves(inp)
    logp, ent = fn(hl, wl, inp.ids, bias=bl, temperature=T, return_entropy=True)
    grads = torch.autograd.grad((logp, ent), [hl, wl, bl], (gl, ge))
    return logp.detach(), ent.detach(), grads


@pytest.fixture(scope="module")
def primitive_case():
    """The N = 8192 inputs, upstream gradients and the fp32 reference (shared: ~1 s of fp32 GEMMs)."""
    inp = make_inputs(S.n, seed=0)
    gl, ge = upstream(S.n)
    with no_tf32():
        expected = logp_entropy_grads(ref.linear_token_logprobs, inp, gl, ge)
    return inp, gl, ge, expected


@pytest.mark.parametrize("dweight_accum", ["fp32", "weight"])
@pytest.mark.parametrize("logits_dtype", ["fp32", "input"])
def test_primitive_matches_fp32_reference(primitive_case, logits_dtype, dweight_accum):
    """``linear_token_logprobs`` with bias, temperature 0.9 and entropy, under each chunk-logits
    dtype and dweight accumulation option: logp, entropy and the hidden/weight/bias gradients."""
    inp, gl, ge, (r_logp, r_ent, r_grads) = primitive_case
    with rk.use_options(linear_logits_dtype=logits_dtype, linear_dweight_accum=dweight_accum):
        logp, ent, grads = logp_entropy_grads(rk.linear_token_logprobs, inp, gl, ge)
    lim = LOGP_ATOL[logits_dtype]
    assert (logp - r_logp).abs().max().item() <= lim
    assert (ent - r_ent).abs().max().item() <= lim
    for name, got, want in zip(("dhidden", "dweight", "dbias"), grads, r_grads, strict=True):
        assert rel_err(got, want) <= GRAD_RTOL, name
    ignored = inp.ids == -100
    assert bool((logp[ignored] == 0).all()) and bool((grads[0][ignored] == 0).all())


@pytest.mark.cpu_smoke
def test_frozen_weight_matches_reference(primitive_case):
    """Weight without gradient: dhidden and dbias of Σ gl·logp against the reference's."""
    inp, gl, _, _ = primitive_case
    grads = {}
    for name, fn in (("ours", rk.linear_token_logprobs), ("reference", ref.linear_token_logprobs)):
        hl, wl, bl = leaves(inp, weight=False)
        logp = fn(hl, wl, inp.ids, bias=bl, temperature=T)
        grads[name] = torch.autograd.grad(logp, [hl, bl], gl)
    for what, got, want in zip(("dhidden", "dbias"), grads["ours"], grads["reference"], strict=True):
        assert rel_err(got, want) <= GRAD_RTOL, what


# ---------------------------------------------------------------------------------- the fused loss
def dapo_kl():
    return rk.PolicyLossConfig.preset("dapo", kl_coef=KL, kl_estimator="k3")


@pytest.fixture(scope="module")
def loss_case():
    """``[B, T]`` DAPO inputs on the N = 8192 hidden states; old/ref near the true log-probs."""
    inp = make_inputs(S.n, seed=0)
    g = generator(7)
    t = S.seq_len
    b = S.n // t
    lengths = torch.randint(int(0.8 * t), t + 1, (b,), device=DEVICE, generator=g)
    mask = torch.arange(t, device=DEVICE)[None] < lengths[:, None]
    ids = torch.where(mask, inp.ids.view(b, t).clamp(min=0), -100)
    with torch.no_grad():
        true = rk.linear_token_logprobs(inp.hidden, inp.weight, ids.view(-1), bias=inp.bias, temperature=T)
    true = true.view(b, t)
    return SimpleNamespace(
        inp=inp,
        b=b,
        t=t,
        mask=mask,
        ids=ids,
        old=true + 0.1 * torch.randn(b, t, device=DEVICE, generator=g),
        ref=true + 0.1 * torch.randn(b, t, device=DEVICE, generator=g),
        adv=torch.randn(b, device=DEVICE, generator=g)[:, None].expand(b, t).contiguous(),
    )


def fused_public(c, params):
    """``fused_policy_loss(hidden=...)``: the fused linear path, its coefficients from the plan."""
    h, w, bias = params
    with rk.use_options(token_level_fusion=True):
        out = rk.fused_policy_loss(
            dapo_kl(), token_ids=c.ids, old_logp=c.old, advantages=c.adv, mask=c.mask,
            hidden=h.view(c.b, c.t, -1), weight=w, bias=bias, temperature=T, ref_logp=c.ref,
        )  # fmt: skip
    return out.loss


def fused_engine_autograd_coefs(c, params):
    """The fused engine driven by per-chunk coefficients from autograd on a plain-torch DAPO-KL
    chunk loss (clip 0.2/0.28, dual clip 10, k3 KL) instead of the plan."""
    h, w, bias = params
    chunk_loss = ppo_kl_chunk_loss(
        c.old.view(-1), c.adv.view(-1), c.mask.view(-1), clip_low=0.2, clip_high=0.28, kl_coef=KL,
        ref_logp=c.ref.view(-1), dual_clip=10.0,
    )  # fmt: skip
    loss, _ = lf.fused_linear_token_loss(
        h, w, bias, c.ids.view(-1), coef_fn=autograd_coef_fn(chunk_loss), temperature=T
    )
    return loss


def composed(c, params, logprobs_fn):
    """``policy_loss`` of the log-probs of ``logprobs_fn`` (the GPU primitive or the reference)."""
    h, w, bias = params
    logp = logprobs_fn(h, w, c.ids.view(-1), bias=bias, temperature=T).view(c.b, c.t)
    return rk.policy_loss(logp, c.old, c.adv, c.mask, dapo_kl(), ref_logp=c.ref).loss


def composed_gpu(c, params):
    return composed(c, params, rk.linear_token_logprobs)


def composed_reference(c, params):
    return composed(c, params, ref.linear_token_logprobs)


@pytest.mark.parametrize("against", ["composed", "reference"])
@pytest.mark.parametrize("coefs", ["plan", "autograd"])
def test_fused_dapo_kl_matches_composed_loss(loss_case, coefs, against):
    """The fused DAPO-KL loss from hidden states (3 GEMMs, the gradient computed in the forward)
    and its hidden/weight/bias gradients, against ``policy_loss`` of the log-probs of the GPU
    primitive (``composed``) or of the fp32 reference (``reference``)."""
    fused = fused_public if coefs == "plan" else fused_engine_autograd_coefs
    want_fn = composed_gpu if against == "composed" else composed_reference
    p = leaves(loss_case.inp)
    loss = fused(loss_case, p)
    grads = torch.autograd.grad(loss, p)
    pr = leaves(loss_case.inp)
    want = want_fn(loss_case, pr)
    want_grads = torch.autograd.grad(want, pr)
    loss_tol, grad_tol = FUSED_TOL[against]
    assert abs(loss.item() - want.item()) <= loss_tol * max(1.0, abs(want.item())), (loss.item(), want.item())
    for name, got, exp in zip(("dhidden", "dweight", "dbias"), grads, want_grads, strict=True):
        assert rel_err(got, exp) <= grad_tol, name


@pytest.mark.skipif(SMOKE, reason="the deferral is CUDA's (the CPU raises inside the call)")
def test_fused_public_bad_id_is_nan_now_and_raised_by_the_next_call(loss_case):
    """``fused_policy_loss(hidden=...)`` with ``validate=True`` and an active id >= V on CUDA: the
    masking / compaction / check launch's one host read brings the check's numbers back with the
    count; the loss is NaN at once and the ValueError (count, first bad id) comes from the next
    checking call, once, as on the logits path (tests/gpu/test_loss.py); a clean call leaves
    nothing pending."""
    c = loss_case
    vocab = c.inp.weight.shape[0]
    rk.raise_pending_errors()
    assert torch.isfinite(fused_public(c, leaves(c.inp)))
    rk.raise_pending_errors()  # nothing pending: no error
    ids = c.ids.clone()
    ids[0, 0], ids[1, 0] = vocab + 12345, vocab + 7  # active: lengths >= 0.8 T
    bad = SimpleNamespace(**{**vars(c), "ids": ids})
    assert bool(torch.isnan(fused_public(bad, leaves(c.inp))))
    with pytest.raises(ValueError, match=rf"active mask positions\) has 2 id\(s\) outside \[0, {vocab}\)"
                       rf".*first: {vocab + 12345}"):  # fmt: skip
        rk.raise_pending_errors(wait=False)
    rk.raise_pending_errors()  # raised once


@pytest.mark.parametrize(
    "mode", ["default fp32", "default input", pytest.param("invariant", marks=pytest.mark.cpu_smoke)]
)
def test_fused_loss_padding_compaction(mode):
    """The fused DAPO-KL loss from hidden states on ragged responses (T = 1024, lengths uniform in
    [T/4, T]: ~37 % padding, at the end of each sequence), compacted (the default: only the
    active rows are staged and projected) vs ``compact=False``: the active rows' logp bitwise
    (the same chunk GEMMs, the rows at other positions: by construction for the invariant GEMM,
    and what tests/gpu/test_linear_invariant.py checks for cuBLAS); the loss to fp32 rounding and
    the gradients to bf16 rounding (sums over rows in another order); masked rows' dhidden exactly
    0. In the CPU smoke run only the invariant mode runs (the default path's CPU GEMMs are BLAS
    calls whose bits may depend on a row's position)."""
    from rlkernel.ops import token_loss as tl_ops
    from rlkernel.rl import token_loss as tl

    inp = make_inputs(S.n, seed=8)
    g = generator(9)
    t = S.seq_len
    b = S.n // t
    lengths = torch.randint(t // 4, t + 1, (b, 1), device=DEVICE, generator=g)
    mask = torch.arange(t, device=DEVICE) < lengths
    ids = torch.where(mask, inp.ids.view(b, t).clamp(min=0), -100)
    old = -5.0 + 0.5 * torch.randn(b, t, device=DEVICE, generator=g)
    plan = tl.build_plan(
        dapo_kl(), token_ids=ids, old_logp=old, advantages=torch.randn(b, device=DEVICE, generator=g),
        mask=mask, ref_logp=old + 0.1 * torch.randn(b, t, device=DEVICE, generator=g),
    )  # fmt: skip
    if mode == "invariant":
        kw = {"invariant_logits": torch.bfloat16}
    else:
        kw = {"logits_dtype": mode.split()[1]}
    table = {"matmul_table": "single"} if SMOKE else {}  # the tuned table's tiles are slow to interpret
    runs = []
    for compact in (True, False):
        params = leaves(inp)
        with rk.use_options(**table):
            loss, logp = lf.fused_linear_token_loss(
                *params, plan.ids, coef_fn=tl_ops.as_coef_fn(plan), temperature=T, compact=compact, **kw
            )
        runs.append((loss.detach(), logp, torch.autograd.grad(loss, params)))
    (loss, logp, grads), (loss_full, logp_full, grads_full) = runs
    assert torch.equal(logp, logp_full), "compaction changed a log-prob bit"
    assert abs(loss.item() - loss_full.item()) <= 1e-5 * max(1.0, abs(loss_full.item()))
    for name, got, want in zip(("dhidden", "dweight", "dbias"), grads, grads_full, strict=True):
        assert rel_err(got, want) <= 1e-3, name
    ignored = (plan.ids == -100).view(-1)
    assert 0.2 < ignored.float().mean().item() < 0.6
    assert bool((grads[0][ignored] == 0).all()) and bool((logp[ignored] == 0).all())


# -------------------------------------------------------------------- size, invariance, determinism
@real_size_only
def test_more_than_2_pow_31_logits_first_and_last_rows():
    """N = 16,384 rows at V = 151,936 (2.5e9 logits > 2^31, never materialized): logp of the first
    and last rows against the reference."""
    inp = make_inputs(S.large_n, seed=3)
    assert S.large_n * S.vocab > 2**31
    k = S.large_rows
    idx = torch.cat([torch.arange(k, device=DEVICE), torch.arange(S.large_n - k, S.large_n, device=DEVICE)])
    with torch.no_grad():
        logp = rk.linear_token_logprobs(inp.hidden, inp.weight, inp.ids, bias=inp.bias, temperature=T)
        want = ref.linear_token_logprobs(
            inp.hidden[idx], inp.weight, inp.ids[idx], bias=inp.bias, temperature=T
        )
    assert (logp[idx] - want).abs().max().item() <= LOGP_ATOL["fp32"]


@pytest.mark.parametrize("logits_dtype", ["fp32", "input"])
def test_row_invariance_across_batch_sizes(logits_dtype):
    """The logp of rows 0..k are bitwise the same alone and inside batches of N rows whose other
    rows are random (every logits GEMM has the same chunk rows, the tail padded)."""
    ns = S.invariance_n
    k, n_max = ns[0], max(ns)
    inp = make_inputs(n_max, seed=4)
    g = generator(44)
    with torch.no_grad(), rk.use_options(linear_logits_dtype=logits_dtype):
        base = rk.linear_token_logprobs(inp.hidden[:k], inp.weight, inp.ids[:k], bias=inp.bias, temperature=T)
        differ = []
        for n in ns[1:]:
            other = inp.hidden[:n].clone()
            other[k:] = torch.randn(n - k, S.hidden, device=DEVICE, generator=g, dtype=other.dtype)
            got = rk.linear_token_logprobs(other, inp.weight, inp.ids[:n], bias=inp.bias, temperature=T)
            if not torch.equal(got[:k], base):
                differ.append(n)
    assert not differ, f"rows 0..{k} differ inside batches of N = {differ}"


def test_determinism_fwd_bwd_twice_bitwise():
    """Two forward + backward runs: logp, entropy and the hidden/weight/bias gradients bitwise equal."""
    inp = make_inputs(S.n, seed=6)
    gl, ge = upstream(S.n)
    runs = []
    for _ in range(2):
        logp, ent, grads = logp_entropy_grads(rk.linear_token_logprobs, inp, gl, ge)
        runs.append((logp, ent, *grads))
    names = ("logp", "entropy", "dhidden", "dweight", "dbias")
    differ = [name for name, a, b in zip(names, *runs, strict=True) if not torch.equal(a, b)]
    assert not differ, f"not bitwise equal across two runs: {differ}"
