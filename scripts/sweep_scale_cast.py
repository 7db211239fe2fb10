"""GPU bandwidth of ``kernels.scale_cast.scale_cast_into`` next to a plain ``copy_`` of the same bytes.

    PYTHONPATH=src python3 scripts/sweep_scale_cast.py

The fused LM head's backward runs it on the fp32 dweight accumulator (fp32 → bf16, 1.24 GB per
half at V = 151,936, H = 4096) and on dhidden in place (bf16, N·H). Prints ms and TB/s (bytes read
+ written) per case, median of 20 calls (``bench.timing.gpu_time_ms``: each behind an L2-evicting
write), and whether the output's bits equal ``(src.float() * scale).to(dst.dtype)``.
"""

from __future__ import annotations

import torch

from rlkernel.bench.timing import gpu_time_ms
from rlkernel.kernels.scale_cast import scale_cast_into


def main() -> None:
    dev = torch.device("cuda")
    scale = torch.tensor(0.3712, device=dev)
    cases = [
        ("fp32 -> bf16, dweight half", torch.float32, torch.bfloat16, 75968 * 4096, False),
        ("fp32 -> bf16, one 64 MiB slab", torch.float32, torch.bfloat16, 4096 * 4096, False),
        ("bf16 in place, dhidden 65k", torch.bfloat16, torch.bfloat16, 65536 * 4096, True),
        ("bf16 in place, odd length", torch.bfloat16, torch.bfloat16, 65536 * 4096 - 5, True),
    ]
    print(f"{'case':34s} {'scale_cast ms':>13s} {'TB/s':>6s} {'copy_ ms':>9s} {'TB/s':>6s}  bits")
    for name, sdt, ddt, n, inplace in cases:
        src = (torch.randn(n, device=dev) * 3).to(sdt)
        expect = (src.float() * scale).to(ddt)
        out = src.clone() if inplace else torch.empty(n, dtype=ddt, device=dev)
        scale_cast_into(out if inplace else src, out, scale)
        same = torch.equal(out, expect)
        nbytes = n * (sdt.itemsize + ddt.itemsize)
        dst = src if inplace else out  # timed in place: the values shrink, the bytes do not
        t = gpu_time_ms(lambda s=src, d=dst: scale_cast_into(s, d, scale), dev, reps=20)
        other = torch.empty(n, dtype=ddt, device=dev)
        tc = gpu_time_ms(lambda s=src, o=other: o.copy_(s), dev, reps=20)
        print(f"{name:34s} {t:13.3f} {nbytes / t / 1e9:6.2f} {tc:9.3f} {nbytes / tc / 1e9:6.2f}  {same}")


if __name__ == "__main__":
    main()
