"""``linear_token_logprobs(..., invariant=True)`` and ``fused_policy_loss(hidden=..., invariant=True)``
against ``token_logprobs`` of the batch-invariant LM head (``rlkernel.invariant.linear``: what the
``lm_head`` of ``patch_hf_model`` runs, with ``out_dtype=torch.float32`` for ``lm_head_dtype=fp32``).

The contract is bitwise, and both sides are our own deterministic code (the interpreter's
order-fixed ``dot`` for the Triton GEMM; the row-by-row GEMV of ``reference.matmul`` on the CPU,
computed by the same call on both sides), so the tests use ``torch.equal``: the full batch, row
subsets in another order, single rows (decode), other chunk sizes, garbage in the other rows. The
gradients are compared with the non-invariant path with tolerances (the backward is not
invariant, only deterministic). Backends: ``reference`` (the CPU path) and ``triton`` (the GPU
code in the interpreter, with the ``single`` GEMM table: the tuned table's 16-row decode tiles with
BLOCK_K = 256 take ~10x longer to interpret; one test runs the tuned table).
"""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk
from rlkernel.invariant import linear as invariant_linear
from rlkernel.ops import _linear_function as lf
from rlkernel.reference import logprobs as ref

H, V = 32, 100
BACKENDS = ["reference", "triton"]


@pytest.fixture(autouse=True)
def _small_chunks():
    # 16-row chunks and groups (the real budgets pad to thousands of rows: minutes in the interpreter).
    with rk.use_options(linear_chunk_bytes=1, linear_grad_bytes=1, matmul_table="single"):
        yield


def make(shape=(3, 13), dtype=torch.bfloat16, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.6).to(dtype)
    b = (torch.randn(V, generator=g) * 0.2).to(dtype) if bias else None
    ids = torch.randint(0, V, shape, generator=g)
    ids.view(-1)[:: 7] = -100  # ignored positions (prompt, padding)
    return h, w, b, ids


def head_logprobs(h, w, b, ids, logits_dtype, temperature, entropy=True):
    """``token_logprobs`` of the patched LM head's logits (what the rollout engine scores)."""
    logits = invariant_linear(h, w, b, out_dtype=logits_dtype)
    return rk.token_logprobs(logits, ids, temperature=temperature, return_entropy=entropy)


def fused(h, w, b, ids, logits_dtype, temperature, entropy=True, **kw):
    return rk.linear_token_logprobs(
        h, w, ids, bias=b, temperature=temperature, return_entropy=entropy, invariant=True,
        logits_dtype=logits_dtype, **kw,
    )  # fmt: skip


def equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


CASES = [
    (torch.bfloat16, None, True, 0.8),
    (torch.bfloat16, torch.float32, False, 1.0),
    (torch.float32, None, True, 1.3),
    (torch.float16, torch.float32, True, 1.0),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,logits_dtype,bias,temperature", CASES)
def test_bitwise_equal_to_token_logprobs_of_the_patched_lm_head(
    backend, dtype, logits_dtype, bias, temperature
):
    h, w, b, ids = make(dtype=dtype, bias=bias)
    with rk.use_backend(backend):
        want = head_logprobs(h, w, b, ids, logits_dtype, temperature)
        got = fused(h, w, b, ids, logits_dtype, temperature)
        assert got[0].shape == ids.shape and got[0].dtype == torch.float32
        assert equal(got, want)
        assert bool((got[0][ids == -100] == 0).all())
        # A row's result depends on that row only: a subset of rows in another order, decode-like
        # single rows, and the logp-only call (the entropy changes no logp bit).
        flat_h, flat_ids = h.reshape(-1, H), ids.reshape(-1)
        pick = torch.randperm(flat_ids.numel(), generator=torch.Generator().manual_seed(1))[:11]
        sub = fused(flat_h[pick], w, b, flat_ids[pick], logits_dtype, temperature)
        assert equal(sub, (want[0].reshape(-1)[pick], want[1].reshape(-1)[pick]))
        for i in (0, 8):
            one = fused(flat_h[i : i + 1], w, b, flat_ids[i : i + 1], logits_dtype, temperature)
            assert equal(one, (want[0].reshape(-1)[i : i + 1], want[1].reshape(-1)[i : i + 1]))
        logp_only = fused(h, w, b, ids, logits_dtype, temperature, entropy=False)
        assert torch.equal(logp_only, want[0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk_rows", [1, 5, 64])
def test_chunk_size_and_other_rows_change_no_bit(backend, chunk_rows):
    """Other chunk splits, and garbage (huge values, NaN at ignored positions) in the other rows."""
    h, w, b, ids = make(shape=(40,), dtype=torch.bfloat16)
    h2 = h.clone()
    h2[20:] = h2[20:] * 1e3
    h2[ids == -100] = float("nan")
    with rk.use_backend(backend):
        want = head_logprobs(h[:20], w, b, ids[:20], torch.float32, 0.9)
        if backend == "triton":
            got = lf.linear_token_logprobs_triton(
                h2, w, ids, bias=b, temperature=0.9, return_entropy=True, chunk_rows=chunk_rows,
                grad_rows=2 * chunk_rows, invariant_logits=torch.float32,
            )  # fmt: skip
        else:
            got = ref.linear_token_logprobs(
                h2, w, ids, bias=b, temperature=0.9, return_entropy=True, chunk_rows=chunk_rows,
                invariant_logits=torch.float32,
            )  # fmt: skip
    assert equal((got[0][:20], got[1][:20]), want)
    assert bool(torch.isfinite(got[0]).all())  # NaN hidden at ignored rows reaches no result


def test_tuned_table_decode_rows_equal_a_chunk():
    """The default (tuned) table: M = 1 (a decode step's LM head) and a 16-row chunk pick different
    launch configurations; the rows agree bitwise."""
    h, w, b, ids = make(shape=(17,), dtype=torch.bfloat16)
    with rk.use_backend("triton"), rk.use_options(matmul_table="tuned"):
        got = fused(h, w, b, ids, None, 1.0)
        for i in (0, 9):
            want = head_logprobs(h[i : i + 1], w, b, ids[i : i + 1], None, 1.0)
            assert equal((got[0][i : i + 1], got[1][i : i + 1]), want)


def test_bf16_head_logits_are_the_fp32_head_logits_rounded():
    """One accumulator, two roundings: the bf16 LM head's logits are the fp32 head's, rounded to
    nearest (CPU path here; the GPU test checks the kernel: the interpreter's fp32 -> bf16 cast
    truncates, the GPU's rounds to nearest)."""
    h, w, b, _ = make(dtype=torch.bfloat16)
    z16 = invariant_linear(h, w, b)
    z32 = invariant_linear(h, w, b, out_dtype=torch.float32)
    assert z16.dtype == torch.bfloat16 and z32.dtype == torch.float32
    assert torch.equal(z16, z32.to(torch.bfloat16)) and not torch.equal(z16.float(), z32)


def _grads(h, w, b, ids, gl, ge, **kw):
    params = [t.detach().clone().requires_grad_(True) for t in (h, w, b)]
    logp, ent = rk.linear_token_logprobs(
        *params[:2], ids, bias=params[2], temperature=0.9, return_entropy=True, **kw
    )
    return logp.detach(), torch.autograd.grad((logp, ent), params, (gl, ge))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# (logits dtype of the invariant path) -> (max |Δlogp|, max ‖Δgrad‖/‖grad‖) against the default
# (fp32-logits) path. bf16 logits: the softmax of rounded logits (|Δz| ≤ |z|·2^-8, truncation in
# the interpreter; measured 0.035 / 0.089 logp and 0.006-0.009 grads on the reference / interpreter);
# fp32: GEMM orders only (2e-6), and both sides round ∂L/∂z to bf16 before the bf16 backward GEMMs
# (measured: equal gradients).
TOLS = {None: (0.25, 3e-2), torch.float32: (1e-4, 1e-3)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("logits_dtype", [None, torch.float32])
def test_gradients_close_to_the_default_path_and_deterministic(backend, logits_dtype):
    h, w, b, ids = make(dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    gl, ge = torch.randn(ids.shape, generator=g), torch.randn(ids.shape, generator=g)
    with rk.use_backend(backend):
        logp, grads = _grads(h, w, b, ids, gl, ge, invariant=True, logits_dtype=logits_dtype)
        again = _grads(h, w, b, ids, gl, ge, invariant=True, logits_dtype=logits_dtype)
        want_logp, want = _grads(h, w, b, ids, gl, ge)
    assert torch.equal(logp, again[0]) and equal(grads, again[1])
    logp_tol, grad_tol = TOLS[logits_dtype]
    assert (logp - want_logp).abs().max() < logp_tol
    for got, exp in zip(grads, want, strict=True):
        assert got.dtype == exp.dtype and _rel(got, exp) < grad_tol
    assert bool((grads[0].reshape(-1, H)[ids.reshape(-1) == -100] == 0).all())


def test_fp32_gradients_match_the_reference_of_the_same_logits():
    """fp32 inputs: the invariant path's gradient is that of the same function, to fp32 rounding."""
    h, w, b, ids = make(dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    gl, ge = torch.randn(ids.shape, generator=g), torch.randn(ids.shape, generator=g)
    for backend in BACKENDS:
        with rk.use_backend(backend):
            _, grads = _grads(h, w, b, ids, gl, ge, invariant=True)
        with rk.use_backend("reference"):
            _, want = _grads(h, w, b, ids, gl, ge)
        for got, exp in zip(grads, want, strict=True):
            assert _rel(got, exp) < 1e-5


# ------------------------------------------------------------------------------ fused_policy_loss
def _rl_inputs(dtype=torch.bfloat16):
    B, T = 3, 9
    h, w, b, ids = make(shape=(B, T), dtype=dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    old = torch.randn(B, T, generator=g) * 0.3 - 4.0
    ref_lp = torch.randn(B, T, generator=g) * 0.3 - 4.0
    adv = torch.randn(B, T, generator=g)
    ids = torch.where(mask, ids.clamp(min=0), -7)  # garbage ids at masked positions
    return h, w, b, ids, mask, old, ref_lp, adv


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", ["dapo", "gspo"])
@pytest.mark.parametrize("logits_dtype", [None, torch.float32])
def test_fused_policy_loss_invariant_equals_policy_loss_of_the_patched_head(backend, preset, logits_dtype):
    """Every metric (ratio min/max/mean, clip fractions, KL, entropy mean) is bitwise that of
    ``policy_loss(token_logprobs(lm_head(hidden)))``: the per-token log-probs and entropies are the
    same bits (the metrics are the same code on them). Loss and gradients: close (other sum orders).
    dapo takes the fused token-level engine on the Triton backend, gspo the primitive."""
    h, w, b, ids, mask, old, ref_lp, adv = _rl_inputs()
    cfg = rk.PolicyLossConfig.preset(preset, kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01)
    kw = dict(old_logp=old, advantages=adv, mask=mask, ref_logp=ref_lp, temperature=0.9)
    params = [t.detach().clone().requires_grad_(True) for t in (h, w, b)]
    with rk.use_backend(backend):
        out = rk.fused_policy_loss(
            cfg, token_ids=ids, hidden=params[0], weight=params[1], bias=params[2], invariant=True,
            logits_dtype=logits_dtype, **kw,
        )  # fmt: skip
        grads = torch.autograd.grad(out.loss, params)
        lparams = [t.detach().clone().requires_grad_(True) for t in (h, w, b)]
        logits = invariant_linear(*lparams, out_dtype=logits_dtype)
        logp, ent = rk.token_logprobs(
            logits, torch.where(mask, ids, -100), temperature=0.9, return_entropy=True
        )
        want = rk.policy_loss(logp, old, adv, mask, cfg, ref_logp=ref_lp, entropy=ent)
        want_grads = torch.autograd.grad(want.loss, lparams)
    fused_engine = backend == "triton" and preset == "dapo"
    assert out.route.objective == ("token" if fused_engine else "composed"), str(out.route)
    assert out.route.gemm == ("invariant" if backend == "triton" else None)
    assert set(out.metrics) == set(want.metrics)
    for name, value in want.metrics.items():
        assert torch.equal(out.metrics[name], value), name
    torch.testing.assert_close(out.loss, want.loss, atol=1e-6, rtol=1e-5)
    for got, exp in zip(grads, want_grads, strict=True):
        assert _rel(got, exp) < 2e-2


# ------------------------------------------------------------------------------------- bad input
def test_bad_input():
    h, w, b, ids = make(dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="invariant"):
        rk.linear_token_logprobs(h, w, ids, invariant=1)
    with pytest.raises(ValueError, match="logits_dtype applies with invariant=True only"):
        rk.linear_token_logprobs(h, w, ids, logits_dtype=torch.float32)
    for bad in (torch.float16, torch.float64, "fp32"):
        with pytest.raises(ValueError, match="logits_dtype must be"):
            rk.linear_token_logprobs(h, w, ids, invariant=True, logits_dtype=bad)
    with pytest.raises(ValueError, match="logits_dtype must be"):
        rk.linear_token_logprobs(h.double(), w.double(), ids, invariant=True, logits_dtype=torch.float32)
    with pytest.raises(TypeError, match="bias dtype"):
        rk.linear_token_logprobs(h, w, ids, bias=b.float(), invariant=True)
    with pytest.raises(ValueError, match="not supported with tp_group"):
        rk.linear_token_logprobs(h, w, ids, invariant=True, tp_group=object())
    with pytest.raises(ValueError, match="out_dtype"):
        invariant_linear(h, w, out_dtype=torch.float16)


def test_fused_policy_loss_bad_input():
    h, w, b, ids, mask, old, ref_lp, adv = _rl_inputs()
    cfg = rk.PolicyLossConfig.preset("dapo")
    kw = dict(token_ids=ids, old_logp=old, advantages=adv, mask=mask)
    logits = invariant_linear(h, w, b)
    with pytest.raises(ValueError, match="hidden path only"):
        rk.fused_policy_loss(cfg, logits=logits, invariant=True, **kw)
    with pytest.raises(ValueError, match="hidden path only"):
        rk.fused_policy_loss(cfg, logits=logits, logits_dtype=torch.float32, **kw)
    with pytest.raises(TypeError, match="invariant"):
        rk.fused_policy_loss(cfg, hidden=h, weight=w, invariant="yes", **kw)
    with pytest.raises(ValueError, match="logits_dtype applies with invariant=True only"):
        rk.fused_policy_loss(cfg, hidden=h, weight=w, logits_dtype=torch.float32, **kw)
    with pytest.raises(ValueError, match="not supported with tp_group"):
        rk.fused_policy_loss(cfg, hidden=h, weight=w, invariant=True, tp_group=object(), **kw)


def test_fp64_takes_the_reference_invariant_path():
    h, w, b, ids = make(dtype=torch.float64)
    with rk.use_backend("triton"):
        got = fused(h, w, b, ids, None, 1.0)
        want = head_logprobs(h, w, b, ids, None, 1.0)
    assert got[0].dtype == torch.float64 and equal(got, want)
