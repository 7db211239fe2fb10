"""``scale_cast_into``: ``dst = (src · scale).to(dst.dtype)`` with the scale read on the device.

Why: the fused LM-head loss computes its gradients in the forward for an upstream gradient of 1
and scales them in the backward by the upstream scalar, a 0-dim CUDA tensor: ``dhidden`` in place
(16-bit) and the fp32 dweight accumulator into 16 bits, slab by slab
(``ops._dweight_accum``). PyTorch runs those mixed-dtype products
(a 16-bit or fp32 tensor times an fp32 0-dim CUDA tensor, written to a 16-bit tensor) on its
non-vectorized elementwise path: 0.9-1.2 TB/s on the H100 (N = 65,536, V = 151,936: ~4.4 ms of the
backward for ~3.7 GB of dweight slabs and ~1.2 GB of dhidden). This kernel is a plain streaming
pass (``BLOCK`` contiguous elements per program, 16-byte vector loads).

Numerics: the fp32 product of the fp32 value of ``src`` and the fp32 scale, one rounding (to
nearest even) to ``dst``'s dtype: the bits of ``(src.float() * scale).to(dst.dtype)``, and of
``torch.mul(src, scale, out=dst)`` for an fp32 ``src`` (for a 16-bit ``src`` PyTorch rounds the
scale to that dtype first, a relative error of up to 2⁻⁹ on every element for bf16, which this
kernel does not make); ``tests/kernels/test_scale_cast.py`` checks the bits on the GPU. ``src`` may
be ``dst`` (in place: each element is read before its own program writes it).

Caveats:
    * 1-D contiguous operands of one length (the callers pass ``.view(-1)`` of contiguous tensors).
    * The CPU interpreter rounds fp32 → bf16 by truncation (Triton 3.9): on the CPU the callers keep
      PyTorch's ops; the interpreter tests compare with a tolerance there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels._launch import FastLauncher, cdiv, device_guard

BLOCK = 4096
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["n"])
def _scale_cast_kernel(src_ptr, dst_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    scale = tl.load(scale_ptr)
    if (pid + 1) * BLOCK <= n:
        # Full blocks unmasked: with ``n`` unspecialized a mask ``offs < n`` has no known constancy,
        # so Triton would emit one scalar access per element (~1 TB/s on the H100 instead of ~2.8).
        x = tl.load(src_ptr + offs).to(tl.float32)
        tl.store(dst_ptr + offs, (x * scale).to(dst_ptr.dtype.element_ty))
    else:
        mask = offs < n
        x = tl.load(src_ptr + offs, mask=mask).to(tl.float32)
        tl.store(dst_ptr + offs, (x * scale).to(dst_ptr.dtype.element_ty), mask=mask)


_launch = FastLauncher(_scale_cast_kernel)


def scale_cast_into(src: torch.Tensor, dst: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``dst[:] = (src.float() * scale).to(dst.dtype)``; returns ``dst``.

    Args:
        src: ``[n]`` contiguous, fp32 / bf16 / fp16.
        dst: ``[n]`` contiguous, fp32 / bf16 / fp16, on ``src``'s device; may be ``src`` itself.
        scale: fp32 0-dim (or one-element) tensor on that device.

    Raises:
        ValueError: shapes, layouts, dtypes or devices outside the above.
    """
    for name, t in (("src", src), ("dst", dst)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or not t.is_contiguous() or t.dtype not in _DTYPES:
            raise ValueError(f"{name} must be a contiguous 1-D fp32/bf16/fp16 tensor, got {t!r:.80}")
    if dst.shape != src.shape or dst.device != src.device:
        raise ValueError(f"dst must match src's length and device: {tuple(dst.shape)} vs {tuple(src.shape)}")
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(f"scale must be a one-element fp32 tensor, got {scale!r:.80}")
    if scale.device != src.device:
        raise ValueError(f"scale must be on {src.device}, got {scale.device}")
    n = src.numel()
    if n == 0:
        return dst
    with device_guard(src):
        _launch((cdiv(n, BLOCK),), (src, dst, scale, n), {"BLOCK": BLOCK}, {"num_warps": 8})
    return dst
