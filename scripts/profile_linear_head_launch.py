"""Host time per launch of the LM-head kernels (``rlkernel.kernels.linear_head``), fast launch on and off.

    PYTHONPATH=src python3 scripts/profile_linear_head_launch.py [--calls 300]

Each kernel module function (the statistics GEMM with the shifted exponents stored, the combine, the
shifted gradient, the recomputing gradient GEMM) is called ``--calls`` times in a loop without a
sync on small operands (M = 128, H = 256, V = 4096: the GPU time per call is below the host time),
wall time of the loop before the final sync divided by the calls, median of 5 loops; with
``FastLauncher`` (``rlkernel.kernels._launch``) and with Triton's own launch (option
``fast_launch=False``). The GEMMs take TMA descriptor arguments: this is what their fast launch saves
per call on this host. Needs a CUDA GPU with TMA (sm90+).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import rlkernel as rk
from rlkernel.kernels import linear_head as lh


def _host_us(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    loops = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        loops.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(loops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    m, hdim, vocab = 128, 256, 4096
    h = torch.randn(m, hdim, device=dev, generator=g).bfloat16()
    w = torch.randn(vocab, hdim, device=dev, generator=g).bfloat16()
    ids = torch.randint(0, vocab, (m,), device=dev, generator=g)
    out = torch.empty(m, vocab, device=dev, dtype=torch.bfloat16)
    logp, lse, entropy, tile_max = lh.linear_head_stats_shifted(h, w, ids, out, with_entropy=True)
    parts, z_y = lh.stats_partials(h, w, ids, with_entropy=True, store_z=out, shifted=True)
    gl, ge = torch.randn(m, device=dev, generator=g), torch.randn(m, device=dev, generator=g)
    calls = {
        "stats_partials (GEMM, TMA descriptors)": lambda: lh.stats_partials(
            h, w, ids, with_entropy=True, store_z=out, shifted=True
        ),
        "combine_partials": lambda: lh.combine_partials(parts, z_y, ids, vocab_size=vocab),
        "linear_head_grad_from_shifted": lambda: lh.linear_head_grad_from_shifted(
            out, tile_max, ids, lse, entropy, gl, ge
        ),
        "linear_head_grad_into (GEMM, TMA descriptors)": lambda: lh.linear_head_grad_into(
            h, w, ids, lse, entropy, gl, ge, out
        ),
    }
    print(f"host us per call (M = {m}, H = {hdim}, V = {vocab}; median of 5 loops of {args.calls})")
    print(f"{'function':48s} {'fast':>8s} {'triton':>8s}")
    for name, fn in calls.items():
        fast = _host_us(fn, args.calls)
        with rk.use_options(fast_launch=False):
            slow = _host_us(fn, args.calls)
        print(f"{name:48s} {fast:8.1f} {slow:8.1f}")


if __name__ == "__main__":
    main()
