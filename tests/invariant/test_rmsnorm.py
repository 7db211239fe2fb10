"""Batch-invariant ``rms_norm``: kernel == reference bit for bit, HF cast order, invariance across
rows, deterministic two-stage ``dweight``, backward against fp64 autograd, bad input.

Kernels run on CUDA when present, else in the CPU interpreter at tiny sizes; each test picks its
backend with ``RLKERNEL_BACKEND`` via monkeypatch.
"""

from __future__ import annotations

import pytest
import torch

from rlkernel.invariant.rmsnorm import _bwd_op, _fwd_op, rms_norm
from rlkernel.kernels import rmsnorm as kr
from rlkernel.reference import rmsnorm as ref

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BACKENDS = ["triton", "reference"]
# ||grad - exact|| / ||exact|| for the backward
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# One rounding step of each output dtype (the HF module uses rsqrt and torch.mean; we use IEEE
# 1/sqrt and a pairwise tree: the fp32 scale may differ by an ulp, the output by one rounding).
ULP = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _inputs(shape, dtype, wdtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 3).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(DEVICE, wdtype or dtype)
    return x, w


@pytest.fixture
def backend(request, monkeypatch):
    monkeypatch.setenv("RLKERNEL_BACKEND", request.param)
    return request.param


@pytest.mark.parametrize("hidden", [96, 128, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_equals_reference(dtype, hidden, monkeypatch):
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")
    x, w = _inputs((37, hidden), dtype)
    out = rms_norm(x, w)
    expected = ref.rms_norm(x, w)
    if ON_GPU or dtype != torch.bfloat16:
        assert torch.equal(out, expected)
    else:  # the CPU interpreter casts fp32 -> bf16 by truncation (triton 3.9), twice: two bf16 steps
        torch.testing.assert_close(out, expected, rtol=2**-6, atol=0)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
def test_close_to_hf_module_formula(backend, dtype):
    x, w = _inputs((33, 64), dtype, seed=1)
    # The CPU interpreter's fp32 -> bf16 cast truncates (triton 3.9): one more rounding step there.
    steps = 2 if backend == "triton" and not ON_GPU and dtype == torch.bfloat16 else 1
    torch.testing.assert_close(
        rms_norm(x, w, eps=1e-5), ref.rms_norm_hf(x, w, eps=1e-5), rtol=steps * ULP[dtype], atol=0
    )


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_output_dtype_promotes_like_hf(backend):
    x, w = _inputs((4, 32), torch.bfloat16, wdtype=torch.float32, seed=2)
    out = rms_norm(x, w)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref.rms_norm_hf(x, w), rtol=2**-6, atol=0)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_bitwise_independent_of_batch(backend, dtype):
    x, w = _inputs((70, 48), dtype, seed=3)
    full = rms_norm(x, w)
    for m in (1, 3, 17, 64):
        assert torch.equal(rms_norm(x[:m], w), full[:m])
        assert torch.equal(rms_norm(x[5 : 5 + m], w), full[5 : 5 + m])
    # QK-norm layout: [tokens, heads, head_dim], normalized over head_dim
    q, wq = _inputs((9, 4, 16), dtype, seed=4)
    full_q = rms_norm(q, wq)
    assert full_q.shape == q.shape
    assert torch.equal(rms_norm(q[2:3], wq), full_q[2:3])
    assert torch.equal(rms_norm(q[:, 1], wq), full_q[:, 1])  # a strided head slice


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_fp64_autograd(backend, dtype):
    x, w = _inputs((41, 80), dtype, seed=5)
    x.requires_grad_()
    w.requires_grad_()
    gy = torch.randn(41, 80, device=DEVICE).to(dtype)
    rms_norm(x, w).backward(gy)
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    ref.rms_norm_hf(xd, wd).backward(gy.double())
    assert x.grad.dtype == dtype and w.grad.dtype == dtype
    for ours, exact in ((x.grad, xd.grad), (w.grad, wd.grad)):
        assert ((ours.double() - exact).norm() / exact.norm()).item() <= REL_TOL[dtype]


def test_reference_closed_form_backward_matches_autograd():
    x, w = _inputs((12, 24), torch.float64, seed=6)
    gy = torch.randn(12, 24, dtype=torch.float64, device=DEVICE)
    dx, dw = ref.rms_norm_backward(gy, x, w)
    xd, wd = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref.rms_norm(xd, wd).backward(gy)
    torch.testing.assert_close(dx, xd.grad)
    torch.testing.assert_close(dw, wd.grad)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_forward_backward_deterministic(backend):
    def run():
        x, w = _inputs((150, 32), torch.bfloat16, seed=7)  # several backward programs
        x.requires_grad_()
        w.requires_grad_()
        out = rms_norm(x, w)
        out.backward(torch.linspace(-1, 1, out.numel(), device=DEVICE).reshape(out.shape).to(out.dtype))
        return out.detach(), x.grad, w.grad

    for a, b in zip(run(), run(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("sms", [1, 3, 64])
def test_two_stage_dweight_any_program_count(sms, monkeypatch):
    """The fp32 partials over row ranges sum to the full dweight whatever the split (1 … 100 programs)."""
    monkeypatch.setattr(kr, "_num_sms", lambda device: sms)  # seam: fake SM count
    x, w = _inputs((100, 16), torch.float32, seed=8)
    gy = torch.randn(100, 16, device=DEVICE)
    _, rstd = kr.rms_norm_fwd(x, w, 1e-6)
    dx, dw = kr.rms_norm_bwd(gy, x, w, rstd)
    dx_ref, dw_ref = ref.rms_norm_backward(gy, x, w)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_empty_and_fp64(backend):
    x, w = _inputs((0, 16), torch.float32)
    assert rms_norm(x, w).shape == (0, 16)
    x, w = _inputs((3, 16), torch.float64)
    torch.testing.assert_close(
        rms_norm(x, w), ref.rms_norm_hf(x.float(), w.float()).double(), rtol=1e-6, atol=0
    )


def test_custom_ops_opcheck_and_compile(monkeypatch):
    monkeypatch.setenv("RLKERNEL_BACKEND", "triton")
    x, w = _inputs((6, 32), torch.float32, seed=9)
    out, rstd = _fwd_op(x, w, 1e-6)
    torch.library.opcheck(_fwd_op, (x, w, 1e-6), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(
        _bwd_op, (torch.randn_like(out), x, w, rstd), test_utils=("test_schema", "test_faketensor")
    )
    compiled = torch.compile(lambda a: rms_norm(a, w), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), rms_norm(x, w))


def test_config_depends_on_hidden_only():
    cfg = kr.config_for(4096)
    assert cfg.block_h == 4096 and cfg.rows >= 1
    assert kr.config_for(128).block_h == 128
    assert kr.config_for(96).block_h == 128


def test_bad_input():
    x, w = _inputs((4, 16), torch.float32)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, w[:15])
    with pytest.raises(ValueError, match="weight must be on"):
        rms_norm(x, w.to("meta"))
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, eps=0.0)
    with pytest.raises(TypeError, match="eps"):
        rms_norm(x, w, eps="1e-6")
    with pytest.raises(TypeError, match="x must be a floating-point"):
        rms_norm(x.long(), w)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        rms_norm(x, None)
    with pytest.raises(ValueError, match="hidden dimension"):
        rms_norm(x[:, :0], w[:0])


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("shape", [(5, 24), (2, 3, 24), (2, 1, 3, 24)])
def test_no_grad_fast_path_same_bits(backend, shape):
    """Without gradients the forward runs on x as it is (``kernels.rmsnorm.rms_norm_forward``, no
    autograd Function, no reshape; rank 4 = the QK-norm's [B, T, H, D]): same bits."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    w = torch.randn(24, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        fast = rms_norm(x, w)
        strided = rms_norm(torch.stack([x, x], dim=-1)[..., 0], w)  # not contiguous: the reshape path
    slow = rms_norm(x.clone().requires_grad_(True), w)
    assert slow.requires_grad and not fast.requires_grad
    assert torch.equal(fast, slow.detach())
    assert torch.equal(strided, fast)
