"""Decode-shaped invariant GEMMs (M <= 64): which 16-row tile configs stay in the table's bitwise
class, and how fast each is against cuBLAS at the Qwen3-8B layer shapes.

    PYTHONPATH=src python3 scripts/gpu_decode_gemm_sweep.py           # H100: ~2 min
    PYTHONPATH=src python3 scripts/gpu_decode_gemm_sweep.py --fp16    # the same for fp16
    PYTHONPATH=src python3 scripts/gpu_decode_gemm_sweep.py --smoke   # CPU interpreter, tiny sizes
    PYTHONPATH=src python3 scripts/gpu_decode_gemm_sweep.py --candidates m16n32k128s4w2 m16n64k64s8w4

Why these candidates. At M <= 64 a GEMM is a weight stream (M = 1: q/o reads 32 MB for 8 MFLOP),
so its speed is the number of weight bytes in flight: programs × bytes per pipeline stage × stages.
The 16-row ``mma.sync`` tiles of the table keep BLOCK_K = 64 and 2-4 KB per stage, so k/v
(N = 1024: 32-64 programs on 132 SMs) cannot fill HBM's latency-bandwidth product. Bits are fixed
by the k16 instruction chain in increasing k, which a BLOCK_K = 128 or 256 tile runs in the same
order (the 64x64x128 wgmma tile was in the bf16 class on the H100), and the program order
(GROUP_M) changes no bit at all; this script finds out, per candidate, whether that holds here.

1. Class: each candidate's rows for M in MS equal the table config's (``mma16_n32``) rows of the
   full product, bitwise, at K = 4096 and at a K-tail shape (bf16, or fp16 with ``--fp16``
   against fp16's ``decode`` configuration).
2. Time: CUDA events around each call, queued behind a 1 GiB L2-evicting write (also hides launch
   latency; ``rlkernel.bench.timing.gpu_time_ms``),
   median of REPS, at M = 1, 8, 16, 32, 64 for the five Qwen3-8B GEMMs, against cuBLAS.

Ends with one table: per (shape, M) cuBLAS, the current table pick, the fastest in-class candidate.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from rlkernel.bench.invariant import GEMM_SHAPES  # noqa: E402
from rlkernel.bench.timing import gpu_time_ms  # noqa: E402
from rlkernel.kernels import matmul as km  # noqa: E402
from rlkernel.kernels import matmul_table as mt  # noqa: E402

DEV = torch.device("cpu" if SMOKE else "cuda")
BF16 = torch.bfloat16
# --fp16: the same sweep in fp16, against a configuration of fp16's table ("decode": 64x64x64).
DTYPE = torch.float16 if "--fp16" in sys.argv else BF16
REF = "decode" if DTYPE == torch.float16 else "mma16_n32"  # a table config: the class to join


def _candidates() -> list[mt.MatmulConfig]:
    out = []
    for bn, warps in ((16, 1), (16, 2), (32, 2), (32, 4), (64, 4)):
        for bk, stages in ((64, 8), (64, 12), (128, 4), (128, 6), (128, 8), (256, 3), (256, 4)):
            if bn == 64 and bk == 256:
                continue
            # GROUP_M = 8: the <= 4 row tiles of M <= 64 run side by side on one column tile (the
            # weight tile is read from HBM once); at M <= 16 there is one row tile either way.
            name = f"m16n{bn}k{bk}s{stages}w{warps}"
            out.append(mt.MatmulConfig(16, bn, bk, 8, warps, stages, name=name))
    return out


CANDIDATES = _candidates()
if SMOKE:
    CANDIDATES = [c for c in CANDIDATES if c.num_stages in (4, 8)][:6]
    SHAPES = {"q/o": (64, 64), "k/v": (64, 16), "down": (192, 64)}
    MS, PERF_MS, REPS, K_TAIL = (1, 5, 17, 64), (1, 8), 2, (40, 48)
else:
    # Qwen3-8B's layer GEMMs and LM head, as the bench suite has them: "q/o 4096->4096": (K, N)
    SHAPES = {f"{name.removesuffix('_proj')} {k}->{n}": (k, n) for n, k, name in GEMM_SHAPES}
    MS, PERF_MS, REPS, K_TAIL = (1, 5, 16, 17, 32, 64), (1, 8, 16, 32, 64), 20, (4072, 1000)


def bench(fn) -> float:
    if SMOKE:
        fn()
        return 0.0
    return gpu_time_ms(fn, DEV, reps=REPS)


def rand(*shape, dtype=BF16, seed=0, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=g) * scale).to(dtype)


def class_check(dtype, k, n, ref_cfg) -> dict[str, str]:
    """{candidate: "in" | "OUT (where)" | "ERROR ..."} against ``ref_cfg``'s rows."""
    x = rand(max(MS), k, dtype=dtype, seed=1)
    w = rand(n, k, dtype=dtype, seed=2, scale=k**-0.5)
    full = km.matmul(x, w.t(), config=ref_cfg)
    verdict = {}
    for cfg in CANDIDATES:
        try:
            bad = [m for m in MS if not torch.equal(km.matmul(x[:m], w.t(), config=cfg), full[:m])]
            # a slice that starts inside the batch (row offsets)
            if not torch.equal(km.matmul(x[3:20], w.t(), config=cfg), full[3:20]):
                bad.append("3:20")
            verdict[cfg.name] = "in" if not bad else f"OUT at M={bad}"
        except Exception as exc:
            verdict[cfg.name] = f"ERROR {type(exc).__name__}: {str(exc)[:80]}"
    return verdict


def main() -> int:
    global CANDIDATES
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fp16", action="store_true", help="the sweep in fp16 (against fp16's decode table)")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes, 6 candidates")
    names = [c.name for c in CANDIDATES]
    parser.add_argument("--candidates", nargs="+", choices=names, default=names, help="a subset to sweep")
    args = parser.parse_args()
    CANDIDATES = [c for c in CANDIDATES if c.name in args.candidates]
    t0 = time.perf_counter()
    ref = mt.CANDIDATES_16[REF]
    verdicts: dict[str, list[str]] = {c.name: [] for c in CANDIDATES}
    for dtype in (DTYPE,):
        for k, n in ((4096, 4096), K_TAIL) if not SMOKE else ((64, 64), K_TAIL):
            try:
                for name, v in class_check(dtype, k, n, ref).items():
                    verdicts[name].append(f"{str(dtype)[6:]} K={k}: {v}")
            except Exception:
                traceback.print_exc(limit=3)
    in_class = [c for c in CANDIDATES if verdicts[c.name] and all(": in" in v for v in verdicts[c.name])]
    for c in CANDIDATES:
        status = "IN   " if c in in_class else "OUT  "
        print(f"CLASS {status}{c.name:24s} {'; '.join(v for v in verdicts[c.name] if ': in' not in v)}")
    print(f"class check done in {time.perf_counter() - t0:.0f} s: {len(in_class)}/{len(CANDIDATES)} in class")

    rows = []
    for label, (k, n) in SHAPES.items():
        w = rand(n, k, dtype=DTYPE, seed=3, scale=k**-0.5)
        for m in PERF_MS:
            x = rand(m, k, dtype=DTYPE, seed=4)
            try:
                t_cublas = bench(lambda x=x, w=w: torch.nn.functional.linear(x, w))
                table_cfg = mt.config_for(m, n, k, DTYPE)
                t_table = bench(lambda x=x, w=w: km.matmul(x, w.t()))
                times = {}
                for cfg in in_class:
                    times[cfg.name] = bench(lambda x=x, w=w, cfg=cfg: km.matmul(x, w.t(), config=cfg))
                ranked = sorted(times.items(), key=lambda kv: kv[1])
                best = ranked[0] if ranked else ("-", float("nan"))
                top3 = ", ".join(f"{nm} {ms * 1e3:.1f}" for nm, ms in ranked[:3])
                rows.append((label, m, t_cublas, table_cfg.name, t_table, best[0], best[1], top3))
                print(
                    f"PERF {label:22s} M={m:<3d} cuBLAS {t_cublas * 1e3:7.1f} us | table {table_cfg.name} "
                    f"{t_table * 1e3:7.1f} us | top: {top3}",
                    flush=True,
                )
            except Exception:
                traceback.print_exc(limit=3)
    # Per candidate: the geometric-mean ratio to cuBLAS over every cell of a weight class, so one
    # config per (M bucket, class) can be picked from the same run.
    print("\n=== decode GEMM table (us; ratio = time / cuBLAS)")
    head = ("shape", "M", "cuBLAS", "table", "ratio", "best in class", "us", "ratio")
    print("{:22s} {:>3s} {:>8s} {:>8s} {:>6s} {:>26s} {:>8s} {:>6s}".format(*head))
    for label, m, tc, _, tt, bname, bt, _ in rows:
        print(
            f"{label:22s} {m:3d} {tc * 1e3:8.1f} {tt * 1e3:8.1f} {tt / tc if tc else 0:6.2f} "
            f"{bname:>26s} {bt * 1e3:8.1f} {bt / tc if tc else 0:6.2f}"
        )
    print(f"done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
