"""``kernels.scale_cast.scale_cast_into``: ``(src · scale)`` in fp32, rounded once to ``dst``'s dtype.

On the GPU its bits are ``(src.float() * scale).to(dst.dtype)`` (for an fp32 ``src`` also
``torch.mul(src, scale, out=dst)``'s: the fused LM-head loss's backward swapped one for the other);
in the CPU interpreter (fp32 → bf16 by truncation in Triton 3.9) within one bf16 unit of the last
place; fp32 / fp16 outputs match exactly there too.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import DEVICE, ON_GPU

# The interpreter evaluates 0 · inf with numpy.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def kernels():
    from rlkernel.kernels import scale_cast

    return scale_cast


CASES = [
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
]


@pytest.mark.parametrize(("src_dtype", "dst_dtype"), CASES)
@pytest.mark.parametrize("scale", [1.0, 0.37, -3.0])
def test_matches_torch_mul(src_dtype, dst_dtype, scale):
    sc = kernels()
    g = torch.Generator().manual_seed(7)
    n = 3 * sc.BLOCK + 123 if ON_GPU else 2 * 4096 + 37  # several programs and a masked tail
    src = (torch.randn(n, generator=g) * 50).to(src_dtype).to(DEVICE)
    s = torch.tensor(scale, dtype=torch.float32, device=DEVICE)
    out = sc.scale_cast_into(src, torch.empty(n, dtype=dst_dtype, device=DEVICE), s)
    expected = (src.float() * s).to(dst_dtype)
    if src_dtype == torch.float32:
        assert torch.equal(expected, torch.mul(src, s, out=torch.empty(n, dtype=dst_dtype, device=DEVICE)))
    if ON_GPU or dst_dtype != torch.bfloat16:
        assert torch.equal(out, expected)
    else:  # the interpreter truncates to bf16: within one bf16 ulp
        torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=0)


def test_in_place_and_scale_one_is_exact():
    sc = kernels()
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5000, generator=g).to(torch.bfloat16).to(DEVICE)
    keep = x.clone()
    one = torch.ones((), device=DEVICE)
    assert sc.scale_cast_into(x, x, one) is x
    assert torch.equal(x, keep)
    two = torch.full((), 2.0, device=DEVICE)
    sc.scale_cast_into(x, x, two)
    assert torch.equal(x, keep * 2)  # powers of two: exact in any rounding


def test_nan_and_inf_scale_propagate():
    sc = kernels()
    x = torch.tensor([0.0, 1.0, -2.0], device=DEVICE)
    out = sc.scale_cast_into(x, torch.empty(3, device=DEVICE), torch.tensor(float("inf"), device=DEVICE))
    assert out[0].isnan() and out[1] == float("inf") and out[2] == float("-inf")
    out = sc.scale_cast_into(x, torch.empty(3, device=DEVICE), torch.tensor(float("nan"), device=DEVICE))
    assert out.isnan().all()


def test_empty_is_a_no_op():
    sc = kernels()
    x = torch.empty(0, device=DEVICE)
    assert sc.scale_cast_into(x, x, torch.ones((), device=DEVICE)).numel() == 0


def test_bad_inputs_raise():
    sc = kernels()
    x = torch.randn(8, device=DEVICE)
    one = torch.ones((), device=DEVICE)
    cases = [
        (lambda: sc.scale_cast_into(x.view(2, 4), x.view(2, 4), one), "contiguous 1-D"),
        (lambda: sc.scale_cast_into(x[::2], torch.empty(4, device=DEVICE), one), "contiguous 1-D"),
        (lambda: sc.scale_cast_into(x.long(), x, one), "fp32/bf16/fp16"),
        (lambda: sc.scale_cast_into(x, torch.empty(7, device=DEVICE), one), "length"),
        (lambda: sc.scale_cast_into(x, x, one.double()), "one-element fp32"),
        (lambda: sc.scale_cast_into(x, x, torch.ones(2, device=DEVICE)), "one-element fp32"),
        (lambda: sc.scale_cast_into(x, x, 2.0), "one-element fp32"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match):
            fn()


@pytest.mark.skipif(not ON_GPU, reason="the scale on another device needs a GPU")
def test_scale_on_another_device_raises():
    sc = kernels()
    x = torch.randn(8, device=DEVICE)
    with pytest.raises(ValueError, match="scale must be on"):
        sc.scale_cast_into(x, x, torch.ones(()))


def test_scaled_helper_is_the_fp32_product_everywhere():
    """``ops._linear_grads.scaled`` (the kernel on CUDA, torch ops elsewhere): bitwise the fp32
    product rounded once; a 16-bit tensor's scale is not rounded to 16 bits first (a CUDA
    ``torch.mul`` of a bf16 tensor by an fp32 0-dim tensor does: bf16(0.37) = 0.369140625)."""
    from rlkernel.ops._linear_grads import scaled

    g = torch.Generator().manual_seed(9)
    x = torch.randn(4096 + 5, generator=g).to(torch.bfloat16).to(DEVICE)
    s = torch.tensor(0.37, device=DEVICE)
    expected = (x.float() * 0.37).to(torch.bfloat16)
    got = scaled(x, s)
    assert torch.equal(got, expected)
    if ON_GPU:
        assert not torch.equal(expected, x * s)  # the rounded scale's result differs
    y = x.clone()
    assert scaled(y, s, out=y) is y and torch.equal(y, got)
    strided = x.view(-1)[:4096].view(64, 64).t()  # not contiguous: the torch ops
    assert torch.equal(scaled(strided, s), (strided.float() * 0.37).to(torch.bfloat16))
