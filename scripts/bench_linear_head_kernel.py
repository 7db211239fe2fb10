"""The fused LM head's kernels on one GPU: the LM-head GEMM with a log-softmax epilogue
(``rlkernel.kernels.linear_head``) against cuBLAS and the unfused path (cuBLAS fp32 logits +
``kernels/logprobs.py``), the host time of their launches, and the backward's scale pass.

    PYTHONPATH=src python3 scripts/bench_linear_head_kernel.py                  # H100: ~2 min
    PYTHONPATH=src python3 scripts/bench_linear_head_kernel.py --m 2048 --configs n256_s3 n256_s3_ws
    PYTHONPATH=src python3 scripts/bench_linear_head_kernel.py --sections launch scale_cast
    PYTHONPATH=src python3 scripts/bench_linear_head_kernel.py --smoke          # CPU interpreter, tiny

``--sections`` (default ``tables``):

``tables``: h ``[M, 4096]``, W ``[151936, 4096]`` bf16 (Qwen3-8B's head), T = 0.7, ~6% ignored rows.
Per M one table: each row is a timed call (CUDA events, each call queued behind a 1 GiB L2-evicting
write, median of ``--reps`` after 3 warmup calls: ``rlkernel.bench.timing.gpu_time_ms``) with its
time, the GEMM's TFLOP/s (2·M·V·H / time; "-" for the calls that run no GEMM: the unfused softmax
kernels and the combine), time ÷ cuBLAS bf16, and a correctness column:

    * ``stats`` rows: max |Δlogp| and |Δentropy| against the unfused path (fp32 logits from
      ``torch.mm(..., out_dtype=float32)``, then ``token_logprobs_fwd_into``); both are fp32
      evaluations of the same exact value, so a few 1e-6 is agreement, anything near 1e-3 is a bug;
    * ``grad`` rows: max |Δ| / max |grad| against ``token_logprobs_bwd_into`` on those fp32 logits
      (bf16 outputs: ~2^-8 is one rounding apart);
    * ``inv`` (first M only): rows 0, 5, 777 and M−1 alone (M = 1) and inside a shuffled 300-row
      batch give the same bits as in the full batch (logp, lse, entropy and the gradient row).

A config that fails to compile or launch (``OutOfResources``: shared memory) is a row with its error,
not a crash. Before the tables: the float64 error of ours and of the unfused path on 64 rows.

``launch``: host µs per call of each kernel function the engine calls per chunk (the statistics GEMM
storing the shifted exponents, the combine, the shifted gradient, the recomputing gradient GEMM) on
small operands (M = 128, H = 256, V = 4096: the GPU keeps up), ``--launch-calls`` calls in a loop
without a sync, median of 5 loops (``rlkernel.bench.timing.host_loop_us``), with the fast launcher
(``rlkernel.kernels._launch``) and with Triton's own launch (option ``fast_launch=False``). The GEMMs
take TMA descriptor arguments: this is what their fast launch saves per call on this host (sm90+).

``scale_cast``: ``kernels.scale_cast.scale_cast_into`` (the backward's scale by the upstream
gradient: fp32 → bf16 over the dweight accumulator's halves, bf16 in place over dhidden) next to a
plain ``copy_`` of the same bytes: ms and TB/s (read + written), median of 20 calls
(``gpu_time_ms``), and whether its bits equal ``(src.float() * scale).to(dst.dtype)``.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

import rlkernel as rk  # noqa: E402
from rlkernel.bench.timing import gpu_time_ms, host_loop_us  # noqa: E402
from rlkernel.kernels import linear_head as lh  # noqa: E402
from rlkernel.kernels import logprobs as klp  # noqa: E402
from rlkernel.kernels.scale_cast import scale_cast_into  # noqa: E402
from rlkernel.reference import logprobs as ref  # noqa: E402

DEV = torch.device("cpu" if SMOKE else "cuda")
BF16 = torch.bfloat16
T = 0.7
IGNORE = -100
HIDDEN, VOCAB = (64, 1000) if SMOKE else (4096, 151936)

Cfg = lh.LinearHeadConfig
# The sweep: the matmul table's large-M vocab tile (128x256x64, 8 warps, 3 stages) and variants.
# 4 stages (4 x 48 KB) leave room only for a 32 KB store staging buffer.
CONFIGS = {
    "n256_s3": Cfg(name="n256_s3"),
    "n256_s3_ws": Cfg(warp_specialize=True, name="n256_s3_ws"),
    "n256_s3_flat": Cfg(flatten=True, name="n256_s3_flat"),
    "n256_s3_ptr": Cfg(tma_store=False, name="n256_s3_ptr"),
    "n256_s4": Cfg(num_stages=4, store_bytes=32768, name="n256_s4"),
    "n128_s4": Cfg(128, 128, 64, 8, 4, 4, name="n128_s4"),
    "n128_s4_ws": Cfg(128, 128, 64, 8, 4, 4, warp_specialize=True, name="n128_s4_ws"),
}
if SMOKE:
    CONFIGS = {
        "small": Cfg(16, 64, 16, 2, 4, 2, name="small"),
        "small_ptr": Cfg(16, 64, 16, 2, 4, 2, tma_store=False, name="small_ptr"),
    }


def bench(fn, reps: int) -> float:
    if SMOKE:
        fn()
        return float("nan")
    return gpu_time_ms(fn, DEV, reps=reps)


def inputs(m: int, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    h = torch.randn(m, HIDDEN, device=DEV, generator=g).to(BF16)
    w = (torch.randn(VOCAB, HIDDEN, device=DEV, generator=g) * (2 / HIDDEN**0.5)).to(BF16)
    ids = torch.randint(0, VOCAB, (m,), device=DEV, generator=g)
    ids[::17] = IGNORE
    ids[1 % m], ids[2 % m] = 0, VOCAB - 1
    g_logp = torch.randn(m, device=DEV, generator=g)
    g_ent = torch.randn(m, device=DEV, generator=g)
    return h, w, ids, g_logp, g_ent


def fp32_logits(h, w):
    """cuBLAS bf16 x bf16 -> fp32 logits (no rounding to bf16); the fp32 product on the CPU."""
    if SMOKE:
        return h.float() @ w.float().T
    return torch.mm(h, w.T, out_dtype=torch.float32)


def unfused(z32, ids, g_logp, g_ent):
    """The current path on stored fp32 logits: (logp, lse, entropy, bf16 gradient)."""
    m = z32.shape[0]
    logp, lse, ent = (torch.empty(m, device=DEV) for _ in range(3))
    klp.token_logprobs_fwd_into(z32, ids, logp, ent, lse, temperature=T, ignore_index=IGNORE)
    grad = torch.empty(z32.shape, dtype=BF16, device=DEV)
    klp.token_logprobs_bwd_into(
        z32, ids, lse, ent, g_logp, g_ent, grad, temperature=T, ignore_index=IGNORE
    )
    return logp, lse, ent, grad


def float64_check(h, w, ids, ours, theirs, rows: int = 64) -> None:
    """max |error| against float64 of the same bf16 operands, on the first ``rows`` rows."""
    x64 = h[:rows].double() @ w.double().T
    logp64, ent64 = ref.token_logprobs(
        x64, ids[:rows], temperature=T, ignore_index=IGNORE, return_entropy=True
    )
    for name, (logp, ent) in (("ours (fused)", ours), ("unfused (cuBLAS fp32 + logprobs)", theirs)):
        print(
            f"float64 check, {rows} rows, {name:34s} max|Δlogp| {(logp[:rows] - logp64).abs().max():.2e}"
            f"  max|Δentropy| {(ent[:rows] - ent64).abs().max():.2e}"
        )


def invariance(h, w, ids, g_logp, g_ent, cfg, full) -> str:
    """Whether rows alone and inside a shuffled batch equal the full batch's bits ("ok" or where not)."""
    m = h.shape[0]
    rows = sorted({0, 5 % m, 777 % m, m - 1})
    bad = []

    def run(sel):
        idx = torch.tensor(sel, device=DEV)
        hs, ids_s = h[idx].contiguous(), ids[idx].contiguous()
        logp, lse, ent = lh.linear_head_stats(
            hs, w, ids_s, temperature=T, ignore_index=IGNORE, with_entropy=True, config=cfg
        )
        grad = torch.empty(len(sel), w.shape[0], dtype=BF16, device=DEV)
        lh.linear_head_grad_into(hs, w, ids_s, lse, ent, g_logp[idx], g_ent[idx], grad,
                                 temperature=T, ignore_index=IGNORE, config=cfg)  # fmt: skip
        return logp, lse, ent, grad

    for r in rows:
        if not all(torch.equal(a[0], b[r]) for a, b in zip(run([r]), full, strict=True)):
            bad.append(f"row {r} alone")
    others = torch.randperm(m, generator=torch.Generator().manual_seed(1))[: min(300, m)].tolist()
    sel = [i for i in others if i not in rows]
    for j, r in enumerate(rows):
        sel.insert(min(len(sel), 7 + 61 * j), r)  # at positions other than r % BLOCK_M
    mixed = run(sel)
    pos = [sel.index(r) for r in rows]
    if not all(torch.equal(a[pos], b[rows]) for a, b in zip(mixed, full, strict=True)):
        bad.append("rows in a shuffled batch")
    return "inv ok" if not bad else "inv FAIL: " + ", ".join(bad)


def max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def run_m(m: int, first: bool, configs: list, reps: int, t0: float) -> list[tuple[str, float, str, bool]]:
    """Time and check every call at M = ``m``: rows ``(call, ms, check, runs the GEMM)``."""
    h, w, ids, g_logp, g_ent = inputs(m)
    z32 = fp32_logits(h, w)
    ref_logp, ref_lse, ref_ent, ref_grad = unfused(z32, ids, g_logp, g_ent)
    grad_buf = torch.empty(m, VOCAB, dtype=BF16, device=DEV)
    fwd_out = tuple(torch.empty(m, device=DEV) for _ in range(3))
    table: list[tuple[str, float, str, bool]] = []

    def row(name, fn, check=None, gemm=True) -> bool:
        try:
            ms = bench(fn, reps)
            table.append((name, ms, check() if check is not None else "", gemm))
            ok = True
        except Exception as exc:  # a config that does not compile or fit: a row, not a crash
            first_line = (str(exc).splitlines() or [""])[0][:90]
            table.append((name, float("nan"), f"ERROR {type(exc).__name__}: {first_line}", gemm))
            ok = False
        print(f"  ... M = {m}: {name} ({time.perf_counter() - t0:.0f} s)", flush=True)
        return ok

    row("cuBLAS bf16 out", lambda: torch.mm(h, w.T) if not SMOKE else h @ w.T)
    row("cuBLAS fp32 out", lambda: fp32_logits(h, w))
    kw = {"temperature": T, "ignore_index": IGNORE}
    row("unfused fwd kernel (fp32 z)", lambda: klp.token_logprobs_fwd_into(
        z32, ids, fwd_out[0], fwd_out[2], fwd_out[1], **kw), gemm=False)  # fmt: skip
    row("unfused bwd kernel (fp32 z)", lambda: klp.token_logprobs_bwd_into(
        z32, ids, ref_lse, ref_ent, g_logp, g_ent, grad_buf, **kw), gemm=False)  # fmt: skip
    z32 = None  # 4·M·V bytes: not needed from here on
    if first:
        try:
            ours = lh.linear_head_stats(h, w, ids, with_entropy=True, config=configs[0], **kw)
            float64_check(h, w, ids, (ours[0], ours[2]), (ref_logp, ref_ent))
        except Exception as exc:  # reported, the tables still follow
            print(f"float64 check with {configs[0].name} failed: {type(exc).__name__}: {exc}"[:300])

    def check_stats(out):
        logp, _, ent = out["stats"]
        text = f"|Δlogp| {max_diff(logp, ref_logp):.1e}"
        return text + (f" |Δent| {max_diff(ent, ref_ent):.1e}" if ent is not None else "")

    def check_grad():
        return f"|Δ|/max {max_diff(grad_buf, ref_grad) / ref_grad.abs().max().item():.1e}"

    for cfg in configs:
        out: dict[str, object] = {}

        def stats(cfg=cfg, out=out, **extra):
            out["stats"] = lh.linear_head_stats(h, w, ids, config=cfg, **kw, **extra)

        def grad(cfg=cfg, out=out):
            _, lse, ent = out["stats"]
            lh.linear_head_grad_into(h, w, ids, lse, ent, g_logp, g_ent, grad_buf, config=cfg, **kw)

        def partials(cfg=cfg):
            return lh.stats_partials(h, w, ids, temperature=T, with_entropy=True, config=cfg)

        name = cfg.name
        if not row(f"{name}: stats+entropy (GEMM + combine)", lambda s=stats: s(with_entropy=True),
                   lambda out=out: check_stats(out)):  # fmt: skip
            continue
        row(f"{name}:   GEMM alone (partials)", partials)
        parts = partials()
        row(f"{name}:   combine alone", lambda cfg=cfg, parts=parts: lh.combine_partials(
            *parts, ids, vocab_size=VOCAB, ignore_index=IGNORE, config=cfg), gemm=False)  # fmt: skip
        parts = None
        if row(f"{name}: grad (bf16 out)", grad, check_grad) and first:
            full = (*out["stats"], grad_buf.clone())
            verdict = invariance(h, w, ids, g_logp, g_ent, cfg, full)
            table.append((f"{name}: invariance", float("nan"), verdict, False))
            full = None
        if cfg is configs[0]:
            row(f"{name}: stats, no entropy", lambda s=stats: s(with_entropy=False),
                lambda out=out: check_stats(out))  # fmt: skip
            for z_dtype in (torch.float32, BF16):
                z_buf = torch.empty(m, VOCAB, dtype=z_dtype, device=DEV)
                row(f"{name}: stats+entropy + store_z {str(z_dtype)[6:]}",
                    lambda s=stats, z_buf=z_buf: s(with_entropy=True, store_z=z_buf),
                    lambda out=out: check_stats(out))  # fmt: skip
                z_buf = None
    return table


def print_table(m: int, table: list[tuple[str, float, str, bool]]) -> None:
    flops = 2.0 * m * VOCAB * HIDDEN
    base = table[0][1]
    print(f"\n=== M = {m} (H = {HIDDEN}, V = {VOCAB}); TFLOP/s = 2·M·V·H / time; x = time / cuBLAS bf16")
    print(f"{'call':52s} {'ms':>8s} {'TFLOP/s':>8s} {'x cuBLAS':>9s}  check")
    for name, ms, note, gemm in table:
        if math.isnan(ms):
            cells = f"{'-':>8s} {'-':>8s} {'-':>9s}"
        else:
            tflops = f"{flops / (ms * 1e-3) / 1e12:8.1f}" if gemm else f"{'-':>8s}"
            cells = f"{ms:8.3f} {tflops} {ms / base:9.2f}"
        print(f"{name:52s} {cells}  {note}")


def launch_section(calls: int) -> None:
    """Host µs per call of the engine's per-chunk kernel functions, fast launch on and off."""
    m, hdim, vocab = (16, 64, 1000) if SMOKE else (128, 256, 4096)
    g = torch.Generator(device=DEV).manual_seed(0)
    h = torch.randn(m, hdim, device=DEV, generator=g).to(BF16)
    w = torch.randn(vocab, hdim, device=DEV, generator=g).to(BF16)
    ids = torch.randint(0, vocab, (m,), device=DEV, generator=g)
    out = torch.empty(m, vocab, device=DEV, dtype=BF16)
    cfg = CONFIGS[next(iter(CONFIGS))] if SMOKE else None
    kw = {"config": cfg} if cfg is not None else {}
    _, lse, entropy, tile_max = lh.linear_head_stats_shifted(h, w, ids, out, with_entropy=True, **kw)
    parts, z_y = lh.stats_partials(h, w, ids, with_entropy=True, store_z=out, shifted=True, **kw)
    gl, ge = torch.randn(m, device=DEV, generator=g), torch.randn(m, device=DEV, generator=g)
    functions = {
        "stats_partials (GEMM, TMA descriptors)": lambda: lh.stats_partials(
            h, w, ids, with_entropy=True, store_z=out, shifted=True, **kw
        ),
        "combine_partials": lambda: lh.combine_partials(parts, z_y, ids, vocab_size=vocab, **kw),
        "linear_head_grad_from_shifted": lambda: lh.linear_head_grad_from_shifted(
            out, tile_max, ids, lse, entropy, gl, ge, **kw
        ),
        "linear_head_grad_into (GEMM, TMA descriptors)": lambda: lh.linear_head_grad_into(
            h, w, ids, lse, entropy, gl, ge, out, **kw
        ),
    }
    loops, warmup = (1, 0) if SMOKE else (5, 1)
    shape = f"M = {m}, H = {hdim}, V = {vocab}"
    print(f"\n=== launch: host us per call ({shape}; median of {loops} loops of {calls} calls)")
    print(f"{'function':48s} {'fast':>8s} {'triton':>8s}")
    for name, fn in functions.items():
        fast = host_loop_us(fn, DEV, calls=calls, loops=loops, warmup=warmup)
        with rk.use_options(fast_launch=False):
            slow = host_loop_us(fn, DEV, calls=calls, loops=loops, warmup=warmup)
        print(f"{name:48s} {fast:8.1f} {slow:8.1f}")


def scale_cast_section(reps: int) -> None:
    """scale_cast_into's bandwidth next to copy_ of the same bytes, and its bits."""
    scale = torch.tensor(0.3712, device=DEV)
    n_half, n_slab, n_dh = (4096, 1024, 4099) if SMOKE else (75968 * 4096, 4096 * 4096, 65536 * 4096)
    cases = [
        ("fp32 -> bf16, dweight half", torch.float32, BF16, n_half, False),
        ("fp32 -> bf16, one 64 MiB slab", torch.float32, BF16, n_slab, False),
        ("bf16 in place, dhidden 65k", BF16, BF16, n_dh, True),
        ("bf16 in place, odd length", BF16, BF16, n_dh - 5, True),
    ]
    print("\n=== scale_cast")
    print(f"{'case':34s} {'scale_cast ms':>13s} {'TB/s':>6s} {'copy_ ms':>9s} {'TB/s':>6s}  bits")
    for name, sdt, ddt, n, inplace in cases:
        src = (torch.randn(n, device=DEV) * 3).to(sdt)
        expect = (src.float() * scale).to(ddt)
        out = src.clone() if inplace else torch.empty(n, dtype=ddt, device=DEV)
        scale_cast_into(out if inplace else src, out, scale)
        same = torch.equal(out, expect)
        nbytes = n * (sdt.itemsize + ddt.itemsize)
        dst = src if inplace else out  # timed in place: the values shrink, the bytes do not
        t = bench(lambda s=src, d=dst: scale_cast_into(s, d, scale), reps)
        other = torch.empty(n, dtype=ddt, device=DEV)
        tc = bench(lambda s=src, o=other: o.copy_(s), reps)
        print(f"{name:34s} {t:13.3f} {nbytes / t / 1e9:6.2f} {tc:9.3f} {nbytes / tc / 1e9:6.2f}  {same}")
    if SMOKE:
        print("(the CPU interpreter rounds fp32 -> bf16 by truncation: bits differ there, not on the GPU)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[32] if SMOKE else [2048, 6144])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--reps", type=int, default=10)
    sections = ["tables", "launch", "scale_cast"]
    parser.add_argument("--sections", nargs="+", default=["tables"], choices=sections)
    parser.add_argument("--launch-calls", type=int, default=2 if SMOKE else 300, help="calls per launch loop")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes")
    args = parser.parse_args()
    t0 = time.perf_counter()
    device = "CPU (interpreter)" if SMOKE else torch.cuda.get_device_name(DEV)
    print(
        f"# {device} | torch {torch.__version__} | triton {triton.__version__} | "
        f"{datetime.date.today()} | H = {HIDDEN}, V = {VOCAB}, bf16, T = {T}"
    )
    configs = [CONFIGS[name] for name in args.configs]
    if "tables" in args.sections:
        for i, m in enumerate(args.m):
            print_table(m, run_m(m, i == 0, configs, args.reps, t0))
            if not SMOKE:
                torch.cuda.empty_cache()
    if "launch" in args.sections:
        launch_section(args.launch_calls)
    if "scale_cast" in args.sections:
        scale_cast_section(20)
    print(f"\ndone in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
