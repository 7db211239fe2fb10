"""The options of the vocab-parallel path (``tp_gemm``, ``tp_elementwise``): defaults, how they
resolve for given tensors, and that a ``use_options`` block reaches the op (one-rank gloo group in
this process; the 2- and 3-process checks are ``check_tp_gemm_option_takes_effect`` in
``_workers.py``)."""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk
from rlkernel._dispatch import interpreter_enabled, triton_available
from rlkernel.distributed import vocab_parallel_linear_token_logprobs
from rlkernel.ops._vocab_parallel_function import half_gemm, use_kernels


def test_defaults_are_auto():
    options = rk.current_options()
    assert (options.tp_gemm, options.tp_elementwise) == ("auto", "auto")
    assert (rk.Options().tp_gemm, rk.Options().tp_elementwise) == ("auto", "auto")


@pytest.mark.parametrize(
    "dtype, mode, half",
    [
        (torch.bfloat16, "auto", False),  # auto: half-operand GEMMs on CUDA only
        (torch.bfloat16, "half", True),
        (torch.bfloat16, "fp32", False),
        (torch.float16, "half", True),
        (torch.float32, "half", False),  # fp32/fp64 inputs always run fp32 (fp64) GEMMs
        (torch.float64, "half", False),
    ],
)
def test_tp_gemm_resolves_on_cpu(dtype, mode, half):
    assert half_gemm(torch.zeros(3, 4, dtype=dtype), mode) is half


def test_tp_elementwise_resolves():
    h = torch.zeros(2, 4, dtype=torch.bfloat16)
    kernels_run_here = triton_available() and interpreter_enabled()
    assert use_kernels(h, True, "auto") is kernels_run_here
    assert use_kernels(h, True, "torch") is False
    assert use_kernels(h, False, "auto") is False  # the kernels only follow half-operand GEMMs


def _grads(call, **options):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 8, generator=g).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(11, 8, generator=g) / 3).to(torch.bfloat16).requires_grad_(True)
    ids = torch.randint(0, 11, (6,), generator=g)
    with rk.use_options(**options):
        logp, ent = call(h, w, ids, return_entropy=True)
        (logp * torch.linspace(-1, 1, 6) + ent).sum().backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("route", ["vocab_parallel_linear_token_logprobs", "linear_token_logprobs"])
def test_tp_gemm_takes_effect(one_rank_group, route):
    """ "half" rounds ∂z to bf16 for the two backward GEMMs: other gradient bits than "fp32"; the
    default ("auto" on the CPU) is "fp32". Directly and through ``linear_token_logprobs(tp_group=)``."""
    fn = vocab_parallel_linear_token_logprobs if route.startswith("vocab") else rk.linear_token_logprobs

    def call(*args, **kw):
        return fn(*args, tp_group=one_rank_group, **kw)

    auto, fp32 = _grads(call), _grads(call, tp_gemm="fp32")
    half = _grads(call, tp_gemm="half", tp_elementwise="torch")
    assert all(torch.equal(a, b) for a, b in zip(auto, fp32, strict=True))
    assert not torch.equal(half[2], fp32[2]) and not torch.equal(half[3], fp32[3])
    torch.testing.assert_close(half[2], fp32[2], atol=2e-2, rtol=2e-2)  # the bf16 rounding, no more


def test_tp_elementwise_takes_effect(one_rank_group):
    """With half-operand GEMMs, "auto" runs the Triton chunk math where it runs (the interpreter
    here) and "torch" the PyTorch one: the same values to fp32 rounding, other bits."""
    if not (triton_available() and interpreter_enabled()):
        pytest.skip("the Triton chunk math runs on CPU tensors only under TRITON_INTERPRET=1")

    def call(*args, **kw):
        return vocab_parallel_linear_token_logprobs(*args, tp_group=one_rank_group, **kw)

    kern = _grads(call, tp_gemm="half")
    torch_ = _grads(call, tp_gemm="half", tp_elementwise="torch")
    torch.testing.assert_close(kern[0], torch_[0], atol=2e-6, rtol=2e-6)
    assert any(not torch.equal(a, b) for a, b in zip(kern, torch_, strict=True))
