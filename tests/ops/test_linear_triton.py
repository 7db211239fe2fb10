"""The chunked linear path (``rlkernel.ops._linear_function``) against the fp32 chunked reference.

Runs the Triton log-softmax kernels in the CPU interpreter (``TRITON_INTERPRET=1`` from the root
conftest) with ``torch.mm`` on CPU, at tiny sizes with tiny forced chunks so that every chunk
boundary case (full chunks, a padded tail, N < C, N = 0) is hit.
"""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk
from _linear_helpers import autograd_coef_fn, ppo_kl_chunk_loss
from rlkernel.ops import _dweight_accum as dweight_accum
from rlkernel.ops import _linear_engine as engine
from rlkernel.ops import _linear_function as lf
from rlkernel.reference import logprobs as ref

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
H, V = 16, 53  # V odd, not a power of two
# (atol logp/entropy, rtol of gradient norms). Half inputs: the logits are fp32 either way; the
# gradient is rounded to the input dtype before the two backward GEMMs (as autograd would).
TOLERANCES = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (2e-5, 1e-2), torch.float16: (2e-5, 2e-3)}


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")
    # The default chunk rule at a tiny budget: 16 rows of fp32 logits at V = 53 (the real budget
    # gives 4096 padded rows, minutes in the interpreter). test_chunk_rule checks the real rule.
    # fp32 dweight → weight dtype in slabs of 5 rows (slab 0 through a temporary, the rest in place)
    monkeypatch.setattr(dweight_accum, "CAST_SLAB_BYTES", 5 * 4 * H)  # seam: a memory bound, no switch
    # fp32 chunk logits (the default), so half inputs are held to fp32-reference tolerances; "input"
    # (half-precision logits) is tested on its own in test_input_dtype_logits_option.
    with rk.use_options(
        linear_chunk_bytes=16 * V * 4, linear_grad_bytes=16 * V * 4, linear_logits_dtype="fp32"
    ):
        yield


def make(n=37, dtype=torch.float32, bias=True, seed=0, ignore=(3, 20)):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype).to(DEVICE)
    b = (torch.randn(V, generator=g) * 0.1).to(dtype).to(DEVICE) if bias else None
    ids = torch.randint(0, V, (n,), generator=g).to(DEVICE)
    for i in ignore:
        if i < n:
            ids[i] = -100
    return h, w, b, ids


def leaves(*ts):
    return [t.requires_grad_(True) for t in ts if t is not None]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def run_primitive(h, w, b, ids, gl, ge, **kw):
    params = leaves(h, w, b)
    logp, ent = lf.linear_token_logprobs_triton(h, w, ids, bias=b, return_entropy=True, **kw)
    grads = torch.autograd.grad((logp, ent), params, (gl, ge))
    return logp.detach(), ent.detach(), grads


@pytest.mark.parametrize(
    "dtype,bias,chunk_rows,grad_rows,temperature",
    [
        (torch.float32, True, 16, 16, 0.7),
        (torch.float32, False, 64, None, 1.0),
        (torch.bfloat16, True, 8, 24, 0.9),
        (torch.float16, False, 8, 16, 1.3),
        (torch.bfloat16, False, None, None, 1.0),
    ],
)
def test_primitive_matches_reference(dtype, bias, chunk_rows, grad_rows, temperature):
    h, w, b, ids = make(dtype=dtype, bias=bias)
    g = torch.Generator().manual_seed(1)
    gl, ge = torch.randn(37, generator=g).to(DEVICE), torch.randn(37, generator=g).to(DEVICE)
    kw = dict(temperature=temperature, ignore_index=-100)
    logp, ent, grads = run_primitive(h, w, b, ids, gl, ge, chunk_rows=chunk_rows, grad_rows=grad_rows, **kw)
    rlogp, rent = ref.linear_token_logprobs(*leaves(h, w), ids, bias=b, return_entropy=True, **kw)
    rgrads = torch.autograd.grad((rlogp, rent), leaves(h, w, b), (gl, ge))
    atol, rtol = TOLERANCES[dtype]
    assert logp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(logp, rlogp, atol=atol, rtol=0)
    torch.testing.assert_close(ent, rent, atol=atol, rtol=0)
    for got, want in zip(grads, rgrads, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel(got, want) <= rtol
    for i in (3, 20):
        assert logp[i] == 0 and ent[i] == 0 and bool((grads[0][i] == 0).all())


def test_public_op_dispatches_here_and_keeps_leading_shape():
    h, w, b, ids = make(n=12)
    h3, ids3 = h.reshape(3, 4, H), ids.reshape(3, 4)
    got = rk.linear_token_logprobs(h3, w, ids3, bias=b, temperature=0.8)
    direct = lf.linear_token_logprobs_triton(h3, w, ids3, bias=b, temperature=0.8)
    assert got.shape == (3, 4) and torch.equal(got, direct)
    want = ref.linear_token_logprobs(h3, w, ids3, bias=b, temperature=0.8)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_logp_only_and_frozen_weight_and_frozen_hidden():
    h, w, b, ids = make(dtype=torch.bfloat16)
    gl = torch.randn(37).to(DEVICE)
    # weight frozen: dweight skipped, dhidden and dbias as the reference
    logp = lf.linear_token_logprobs_triton(
        h.requires_grad_(True), w, ids, bias=b.requires_grad_(True), chunk_rows=16
    )
    dh, db = torch.autograd.grad(logp, (h, b), gl)
    rlogp = ref.linear_token_logprobs(h, w, ids, bias=b)
    rdh, rdb = torch.autograd.grad(rlogp, (h, b), gl)
    assert rel(dh, rdh) < 1e-2 and rel(db, rdb) < 1e-2
    # hidden frozen: only dweight
    h2 = h.detach()
    logp2 = lf.linear_token_logprobs_triton(h2, w.requires_grad_(True), ids, chunk_rows=16)
    (dw,) = torch.autograd.grad(logp2, (w,), gl)
    (rdw,) = torch.autograd.grad(ref.linear_token_logprobs(h2, w, ids), (w,), gl)
    assert rel(dw, rdw) < 1e-2


@pytest.mark.parametrize("accum", ["fp32", "weight"])
def test_dweight_accumulation_modes_bf16(accum):
    h, w, b, ids = make(dtype=torch.bfloat16, bias=False)
    gl, ge = torch.randn(37).to(DEVICE), torch.randn(37).to(DEVICE)
    *_, grads = run_primitive(h, w, None, ids, gl, ge, chunk_rows=8, dweight_accum=accum)
    rlogp, rent = ref.linear_token_logprobs(h, w, ids, return_entropy=True)
    _, rdw = torch.autograd.grad((rlogp, rent), (h, w), (gl, ge))
    assert grads[1].dtype == torch.bfloat16
    assert rel(grads[1], rdw) < (1e-2 if accum == "fp32" else 2e-2)


def test_bf16_logits_option_is_close():
    h, w, b, ids = make(dtype=torch.bfloat16)
    got = lf.linear_token_logprobs_triton(h, w, ids, bias=b, chunk_rows=16, logits_dtype="input")
    want = ref.linear_token_logprobs(h, w, ids, bias=b)
    # bf16-rounded logits: |Δz| ≤ |z|·2^-9, a few 1e-2 in logp at these magnitudes
    torch.testing.assert_close(got, want, atol=1e-1, rtol=0)


def test_determinism_forward_and_backward_bitwise():
    h, w, b, ids = make(dtype=torch.bfloat16)
    gl, ge = torch.randn(37).to(DEVICE), torch.randn(37).to(DEVICE)
    a = run_primitive(h, w, b, ids, gl, ge, chunk_rows=16)
    c = run_primitive(h, w, b, ids, gl, ge, chunk_rows=16)
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])
    assert all(torch.equal(x, y) for x, y in zip(a[2], c[2], strict=True))


def test_row_invariance_bitwise():
    """A row's logp does not depend on N or the other rows (fixed chunk size, padded tail)."""
    h, w, b, ids = make(n=45, dtype=torch.bfloat16, ignore=())
    k = 5
    outs = [lf.linear_token_logprobs_triton(h[:n], w, ids[:n], bias=b, chunk_rows=16) for n in (k, 16, 45)]
    other = h.clone()
    other[k:] = torch.randn_like(other[k:])
    outs.append(lf.linear_token_logprobs_triton(other, w, ids, bias=b, chunk_rows=16))
    for o in outs[1:]:
        assert torch.equal(o[:k], outs[0])


def test_garbage_in_ignored_rows_does_not_leak():
    h, w, b, ids = make(dtype=torch.float32)
    h = h.clone()
    h[3] = float("nan")
    h[20] = float("inf")
    logp, ent, grads = run_primitive(
        h, w, b, ids, torch.randn(37).to(DEVICE), torch.randn(37).to(DEVICE), chunk_rows=16
    )
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    assert all(torch.isfinite(g).all() for g in grads)


def test_empty_and_fp64_fallback():
    h, w, b, ids = make(n=0)
    out = lf.linear_token_logprobs_triton(h.requires_grad_(True), w.requires_grad_(True), ids, bias=b)
    assert out.shape == (0,)
    dh, dw = torch.autograd.grad(out.sum(), (h, w), allow_unused=True)
    assert dh is None or dh.shape == (0, H)
    assert dw is None or bool((dw == 0).all())
    # the fused engine with no rows: loss 0, zero dweight (the accumulator is never written)
    loss, _ = lf.fused_linear_token_loss(
        h, w, None, ids, coef_fn=autograd_coef_fn(lambda rows, lp, e: lp.sum()), dweight_accum="fp32"
    )
    (dw2,) = torch.autograd.grad(loss, (w,))
    assert loss.item() == 0 and bool((dw2 == 0).all())
    hd, wd, bd, idsd = make(dtype=torch.float64, n=6)
    got = rk.linear_token_logprobs(hd, wd, idsd, bias=bd)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, ref.linear_token_logprobs(hd, wd, idsd, bias=bd))


def test_bad_options():
    h, w, b, ids = make(n=4)
    with pytest.raises(ValueError, match="logits_dtype"):
        lf.linear_token_logprobs_triton(h, w, ids, logits_dtype="fp8")
    with pytest.raises(ValueError, match="dweight_accum"):
        lf.linear_token_logprobs_triton(h, w, ids, dweight_accum="fp16")
    with pytest.raises(ValueError, match="chunk_rows"):
        lf.linear_token_logprobs_triton(h, w, ids, chunk_rows=0)
    with pytest.raises(ValueError, match="grad_rows"):
        lf.linear_token_logprobs_triton(h, w, ids, grad_rows=2.5)
    with pytest.raises(ValueError, match="token_ids"):
        rk.linear_token_logprobs(h, w, torch.full_like(ids, V))
        rk.raise_pending_errors()  # CUDA: the id check runs on the device and reports here
    with pytest.raises(TypeError, match="dtype"):
        rk.linear_token_logprobs(h, w.bfloat16(), ids)


def test_chunk_rule_depends_on_vocab_hidden_and_dtype_only(monkeypatch):
    monkeypatch.undo()  # the module's real budgets
    assert engine.chunk_rows_for(151936, torch.float32) == 2048
    assert engine.chunk_rows_for(151936, torch.bfloat16) == 4096
    assert engine.chunk_rows_for(32768, torch.bfloat16) == 4096
    assert engine.chunk_rows_for(10**9, torch.float32) == engine.MIN_CHUNK_ROWS
    assert engine.chunk_rows_for(151936, torch.float32, 1280 << 18) == 512  # the option's budget
    assert engine.grad_rows_for(151936, torch.bfloat16) == 4096
    # Capped at max(H_GROUP_FLOOR, H) rows given H: never more rows than the [V, H] weight gradient.
    assert engine.grad_rows_for(151936, torch.bfloat16, hdim=4096) == 4096
    assert engine.grad_rows_for(151936, torch.bfloat16, hdim=2048) == 2048
    assert engine.grad_rows_for(151936, torch.bfloat16, hdim=1536) == engine.H_GROUP_FLOOR == 1024
    assert engine.grad_rows_for(151936, torch.bfloat16, hdim=64) == 1024
    assert engine.grad_rows_for(151936, torch.bfloat16, 1280 << 18, hdim=8192) == 1024  # the budget


# ------------------------------------------------------------------------------------- fused loss
def make_rl(n, seed=2):
    g = torch.Generator().manual_seed(seed)
    h, w, b, ids = make(n=n, dtype=torch.float32, seed=seed, ignore=())
    mask = torch.rand(n, generator=g) > 0.2
    old = (torch.randn(n, generator=g) * 0.3 - 3.0).to(DEVICE)
    ref_lp = (torch.randn(n, generator=g) * 0.3 - 3.0).to(DEVICE)
    adv = torch.randn(n, generator=g).to(DEVICE)
    return h, w, b, ids, mask.to(DEVICE), old, ref_lp, adv


@pytest.mark.parametrize("kind", ["reinforce", "dapo_kl"])
@pytest.mark.parametrize("frozen_weight", [False, True])
def test_fused_loss_matches_policy_loss_of_reference(kind, frozen_weight):
    n, B = 40, 4
    h, w, b, ids, mask, old, ref_lp, adv = make_rl(n)
    ids_m = torch.where(mask, ids, torch.full_like(ids, -100))
    if kind == "reinforce":
        cfg = rk.PolicyLossConfig(loss_type="reinforce")
        den = mask.float().sum()

        def chunk_loss(rows, logp, entropy):
            return (-adv[rows] * logp * mask[rows].float()).sum() / den

        kw = {}
    else:
        cfg = rk.PolicyLossConfig.preset("dapo", kl_coef=0.1, kl_estimator="k3")
        chunk_loss = ppo_kl_chunk_loss(
            old, adv, mask, clip_low=0.2, clip_high=0.28, kl_coef=0.1, ref_logp=ref_lp, dual_clip=10.0
        )
        kw = {"ref_logp": ref_lp.reshape(B, -1)}
    params = leaves(h, None if frozen_weight else w, b)
    loss, logp = lf.fused_linear_token_loss(
        h, w, b, ids_m, coef_fn=autograd_coef_fn(chunk_loss), temperature=0.9, chunk_rows=8, grad_rows=16
    )
    grads = torch.autograd.grad(loss * 2.5, params)
    rlogp = ref.linear_token_logprobs(h, w, ids_m, bias=b, temperature=0.9)
    out = rk.policy_loss(
        rlogp.reshape(B, -1), old.reshape(B, -1), adv.reshape(B, -1), mask.reshape(B, -1), cfg, **kw
    )
    rgrads = torch.autograd.grad(out.loss * 2.5, params)
    torch.testing.assert_close(loss, out.loss.float(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(logp, rlogp, atol=2e-5, rtol=0)
    assert not logp.requires_grad
    for got, want in zip(grads, rgrads, strict=True):
        assert rel(got, want) < 1e-5


def test_fused_loss_entropy_bf16_and_determinism():
    n = 37
    h, w, b, ids = make(n=n, dtype=torch.bfloat16)
    coef = torch.randn(n).to(DEVICE)

    def chunk_loss(rows, logp, entropy):
        return (coef[rows] * logp).sum() - 0.1 * entropy.sum()

    def fused():
        params = leaves(h, w, b)
        loss, logp, ent = lf.fused_linear_token_loss(
            h, w, b, ids, coef_fn=autograd_coef_fn(chunk_loss), with_entropy=True, chunk_rows=8
        )
        return loss.detach(), logp, ent, torch.autograd.grad(loss, params)

    loss, logp, ent, grads = fused()
    again = fused()
    assert torch.equal(loss, again[0]) and all(
        torch.equal(x, y) for x, y in zip(grads, again[3], strict=True)
    )
    rlogp, rent = ref.linear_token_logprobs(
        *leaves(h, w), ids, bias=b.requires_grad_(True), return_entropy=True
    )
    rloss = (coef * rlogp).sum() - 0.1 * rent.sum()
    rgrads = torch.autograd.grad(rloss, (h, w, b))
    torch.testing.assert_close(loss, rloss.detach(), atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(ent, rent.detach(), atol=2e-5, rtol=0)
    for got, want in zip(grads, rgrads, strict=True):
        assert rel(got, want) < 1e-2


def test_fused_loss_no_grad_and_bad_dtype():
    h, w, b, ids = make(n=20)
    coef = autograd_coef_fn(lambda rows, lp, e: lp.sum())
    leaves(h, w)
    with torch.no_grad():
        loss, logp = lf.fused_linear_token_loss(h, w, b, ids, coef_fn=coef, chunk_rows=16)
    want = ref.linear_token_logprobs(h.detach(), w.detach(), ids, bias=b)
    torch.testing.assert_close(logp, want, atol=2e-5, rtol=0)
    torch.testing.assert_close(loss, want.sum(), atol=1e-4, rtol=1e-5)
    assert not loss.requires_grad
    with pytest.raises(TypeError, match="fp64"):
        lf.fused_linear_token_loss(h.double(), w.double(), None, ids, coef_fn=coef)
    with pytest.raises(TypeError, match="dtype"):
        lf.fused_linear_token_loss(h, w.bfloat16(), None, ids, coef_fn=coef)


def test_input_dtype_logits_option():
    """``linear_logits_dtype="input"`` rounds each chunk's logits to the input dtype (as the model's
    LM head does): bf16 logp within bf16 rounding of the logits (|z| ~ 5: ulp 2^-5) of the fp32
    reference, and the fp32 option much closer."""
    h, w, b, ids = make(dtype=torch.bfloat16)
    want = ref.linear_token_logprobs(h, w, ids, bias=b)
    with rk.use_options(linear_logits_dtype="input"):
        half = lf.linear_token_logprobs_triton(h, w, ids, bias=b)
    full = lf.linear_token_logprobs_triton(h, w, ids, bias=b, logits_dtype="fp32")
    assert 0 < (half - want).abs().max() < 0.1
    assert (full - want).abs().max() < 2e-5


@pytest.mark.parametrize(
    "preset", ["ppo", "grpo", "dapo", "dr_grpo", "gspo", "luspo", "cispo", "sapo", "gmpo"]
)
def test_fused_policy_loss_hidden_path_matches_reference_backend(preset):
    """rk.fused_policy_loss(hidden=...) on the Triton backend (token-level configs: the chunk engine
    driven by the token-loss plan; gspo: the primitive) equals the reference backend: loss, grads
    and metrics."""
    n, B = 40, 4
    h, w, b, ids, mask, old, ref_lp, adv = make_rl(n)
    cfg = rk.PolicyLossConfig.preset(preset, kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01)
    garbage_ids = torch.where(mask, ids, torch.full_like(ids, -7)).reshape(B, -1)
    kw = dict(
        token_ids=garbage_ids,
        old_logp=old.reshape(B, -1),
        advantages=adv.reshape(B, -1),
        mask=mask.reshape(B, -1),
        ref_logp=ref_lp.reshape(B, -1),
        temperature=0.9,
    )

    def run():
        hh, ww, bb = (t.detach().clone().requires_grad_(True) for t in (h, w, b))
        out = rk.fused_policy_loss(cfg, hidden=hh.reshape(B, n // B, H), weight=ww, bias=bb, **kw)
        grads = torch.autograd.grad(out.loss, (hh, ww, bb))
        return out, grads

    out, grads = run()
    sequence_level = preset in ("gspo", "luspo", "gmpo")  # the primitive path
    assert out.route.objective == ("composed" if sequence_level else "token"), str(out.route)
    with rk.use_backend("reference"):
        want, want_grads = run()
    torch.testing.assert_close(out.loss, want.loss, atol=2e-6, rtol=1e-5)
    for got, exp in zip(grads, want_grads, strict=True):
        assert rel(got, exp) < 1e-4
    for name, value in want.metrics.items():
        torch.testing.assert_close(out.metrics[name], value, atol=1e-5, rtol=1e-4)
