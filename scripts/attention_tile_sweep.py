"""Launch configurations of the batch-invariant attention kernels against SDPA, in one GPU call.

    PYTHONPATH=src python3 scripts/attention_tile_sweep.py                 # D = 128, H100: ~2-3 min
    PYTHONPATH=src python3 scripts/attention_tile_sweep.py --head-dim 64 --heads 16 8
    PYTHONPATH=src python3 scripts/attention_tile_sweep.py --kernels bwd --shapes 1x8192 1x32768
    PYTHONPATH=src python3 scripts/attention_tile_sweep.py --kernels fwd --block-n 128   # another formula
    PYTHONPATH=src python3 scripts/attention_tile_sweep.py --smoke        # CPU interpreter, tiny

What it answers (the sweep behind ``benchmarks/results/attn_bwd_sweep_h100_2026-11-28.log``):

* forward (``--kernels fwd``): each candidate ``FwdConfig`` (rows per tile, warps, stages; the key
  block BLOCK_N stays the default's: it is part of the formula) is timed and compared bitwise with
  the default configuration's output and lse2. Only a candidate that is ``bitwise=True`` at every
  shape may replace the default (``kernels.attention_config``); the GPU attention tests decide.
* backward (``--kernels bwd``): each candidate tile of one backward kernel (dK/dV or dQ, the other
  at the default) is timed, run twice (``det``: bitwise repeatable) and compared with the default's
  gradients (``relerr``: max |g − g_default| / max |g_default| over dq, dk, dv). Any tile is allowed
  (the backward is deterministic for every choice); the fastest at every shape wins
  (``kernels.attention_bwd.bwd_config``).
* SDPA (HF's layout, KV heads repeated to Hq, causal) forward and forward + backward in the same run.
* other key blocks (``--block-n 128``): forward candidates with that BLOCK_N (the default's rows,
  warps and stages, and 128 rows at 8 warps). BLOCK_N sets the order of a row's sums, so these are
  another formula, not a tile of this one: each is compared with SDPA's output (``vs_sdpa``: max
  |o − o_sdpa|, the default's own shown alike) instead of bitwise, and adopting one changes the bits
  of every path at once (forward, split-decode and their tests: a change of ``fwd_config``, not of
  the tile table).

Timing: ``rlkernel.bench.timing.gpu_time_ms`` (CUDA events, each call queued behind an
L2-evicting write). TF/s counts the causal forward's 2·B·Hq·T²·D flops, 2.5× that for the backward
and 3.5× for SDPA's forward + backward. Ends with one table.
"""

from __future__ import annotations

import argparse
import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rlkernel.kernels import attention as ka  # noqa: E402
from rlkernel.kernels import attention_bwd as kab  # noqa: E402

# (rows per tile, warps, stages)
FWD_CANDIDATES = ((64, 4, 3), (64, 4, 2), (64, 4, 4), (128, 8, 2), (128, 8, 3), (128, 4, 3))
BWD_TILES = ((64, 64), (32, 64), (64, 32), (32, 128), (64, 128), (128, 64), (128, 32), (16, 128))
BWD_WARPS_STAGES = ((4, 2), (4, 3), (8, 2), (8, 3))


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("HQ", "HKV"))
    p.add_argument("--shapes", nargs="+", default=["1x8192", "4x8192", "1x32768"], help="BxT, causal")
    p.add_argument("--kernels", default="fwd,bwd", help="fwd, bwd or both (comma-separated)")
    p.add_argument("--block-n", type=int, nargs="*", default=[], metavar="BN",
                   help="also time forward candidates with these key blocks (another formula)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny sizes in the CPU interpreter")
    args = p.parse_args()
    if args.smoke:
        args.shapes, args.reps, args.head_dim, args.heads = ["1x40"], 1, 16, (4, 2)
    return args


def _time(fn, device: torch.device, reps: int) -> float:
    if device.type != "cuda":  # the smoke run: one call, no timing
        fn()
        return float("nan")
    from rlkernel.bench.timing import gpu_time_ms

    return gpu_time_ms(fn, device, reps=reps)


def _tflops(b: int, hq: int, t: int, d: int, ms: float, mult: float) -> float:
    return mult * 2 * b * hq * t * t * d / ms / 1e9


def _fwd_candidates(head_dim: int, dtype: torch.dtype) -> list[ka.FwdConfig]:
    base = ka.fwd_config(head_dim, dtype)
    if SMOKE:
        return [base, ka.FwdConfig(32, base.block_n, 1, 1)]
    return [base] + [ka.FwdConfig(m, base.block_n, w, s) for m, w, s in FWD_CANDIDATES
                     if (m, w, s) != (base.block_m, base.num_warps, base.num_stages)]  # fmt: skip


def _bwd_candidates(head_dim: int, dtype: torch.dtype) -> list[tuple[str, kab.BwdConfig]]:
    base = kab.bwd_config(head_dim, dtype)
    if SMOKE:
        tiles = [kab.KernelTiles(16, 16, 1, 1), kab.KernelTiles(32, 16, 1, 1)]
    else:
        tiles = [kab.KernelTiles(m, n, w, s) for m, n in BWD_TILES for w, s in BWD_WARPS_STAGES]
    out = [("default", base)]
    out += [("dkdv", kab.BwdConfig(t, base.dq)) for t in tiles if t != base.dkdv]
    out += [("dq", kab.BwdConfig(base.dkdv, t)) for t in tiles if t != base.dq]
    return out


def _key_block_candidates(head_dim: int, dtype: torch.dtype, block_ns: list[int]) -> list[ka.FwdConfig]:
    """The default configuration (its own row, compared with SDPA alike), then for each other key
    block the default's rows, warps and stages and, on the GPU, 128 rows at 8 warps."""
    base = ka.fwd_config(head_dim, dtype)
    shapes = [(base.block_m, base.num_warps, base.num_stages)] + ([] if SMOKE else [(128, 8, 3)])
    return [base] + [ka.FwdConfig(m, bn, w, st) for bn in block_ns for m, w, st in shapes]


Row = tuple[str, str, float, float, str]


def _sweep_shape(b: int, t: int, args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                 gen: torch.Generator) -> list[Row]:  # fmt: skip
    """SDPA, then the forward and backward candidates at one (B, T)."""
    hq, hkv = args.heads
    d = args.head_dim
    scale = d**-0.5
    kernels = set(args.kernels.split(","))
    q, k, v = (torch.randn(b, t, h, d, device=device, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    tag = f"B={b} T={t}"
    rows: list[Row] = []
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    kh, vh = (x.repeat_interleave(hq // hkv, 1) for x in (kh, vh))
    leaves = [x.detach().clone().requires_grad_() for x in (qh, kh, vh)]
    go_h = torch.randn(qh.shape, device=device, generator=gen).to(dtype)

    def sdpa_fwd_bwd():
        F.scaled_dot_product_attention(*leaves, is_causal=True).backward(go_h)

    ms = _time(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True), device, args.reps)
    rows.append((tag, "sdpa fwd", ms, _tflops(b, hq, t, d, ms, 1), ""))
    ms = _time(sdpa_fwd_bwd, device, args.reps)
    rows.append((tag, "sdpa fwd+bwd", ms, _tflops(b, hq, t, d, ms, 3.5), ""))
    out, lse = ka.attention_fwd(q, k, v, scale=scale)
    if "fwd" in kernels:
        for c in _fwd_candidates(d, dtype):
            o2, l2 = ka.attention_fwd(q, k, v, scale=scale, config=c)
            same = torch.equal(o2, out) and torch.equal(l2, lse)
            ms = _time(lambda c=c: ka.attention_fwd(q, k, v, scale=scale, config=c), device, args.reps)
            label = f"fwd {c.block_m}/{c.block_n} w{c.num_warps} s{c.num_stages}"
            rows.append((tag, label, ms, _tflops(b, hq, t, d, ms, 1), f"bitwise={same}"))
        if args.block_n:
            o_sdpa = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2).float()
            for c in _key_block_candidates(d, dtype, args.block_n):
                o2, _ = ka.attention_fwd(q, k, v, scale=scale, config=c)
                err = (o2.float() - o_sdpa).abs().max().item()
                ms = _time(lambda c=c: ka.attention_fwd(q, k, v, scale=scale, config=c), device, args.reps)
                label = f"fwd {c.block_m}/{c.block_n} w{c.num_warps} s{c.num_stages} (formula)"
                rows.append((tag, label, ms, _tflops(b, hq, t, d, ms, 1), f"vs_sdpa={err:.1e}"))
    if "bwd" in kernels:
        go = torch.randn(q.shape, device=device, generator=gen).to(dtype)
        ref = kab.attention_bwd(go, q, k, v, out, lse, scale=scale)
        for kind, c in _bwd_candidates(d, dtype):
            g1 = kab.attention_bwd(go, q, k, v, out, lse, scale=scale, config=c)
            g2 = kab.attention_bwd(go, q, k, v, out, lse, scale=scale, config=c)
            det = all(torch.equal(x, y) for x, y in zip(g1, g2, strict=True))
            err = max(
                ((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-30)).item()
                for x, y in zip(g1, ref, strict=True)
            )
            ms = _time(lambda c=c: kab.attention_bwd(go, q, k, v, out, lse, scale=scale, config=c), device,
                       args.reps)  # fmt: skip
            tiles = c.dkdv if kind == "dkdv" else c.dq
            label = f"bwd[{kind}] {tiles.block_m}/{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages}"
            rows.append((tag, label, ms, _tflops(b, hq, t, d, ms, 2.5), f"det={det} relerr={err:.1e}"))
    return rows


def main() -> int:
    args = _parse()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    rows: list[Row] = []
    for shape in args.shapes:
        b, t = (int(x) for x in shape.split("x"))
        rows += _sweep_shape(b, t, args, device, dtype, gen)
        print(f"done B={b} T={t}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU interpreter (smoke)"
    hq, hkv = args.heads
    print(f"=== attention tiles: {name}, torch {torch.__version__}, Hq/Hkv = {hq}/{hkv}, "
          f"D = {args.head_dim}, {dtype}")  # fmt: skip
    for tag, label, ms, tf, note in rows:
        print(f"{tag:14s} {label:30s} {ms:9.3f} ms {tf:6.0f} TF/s  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
