"""GPU check of the batch-invariant GEMM (``linear``/``matmul``, default ``MODE``) and RMSNorm.

    PYTHONPATH=src python3 scripts/gpu_check_invariant_ops.py            # H100: <= 90 s
    PYTHONPATH=src python3 scripts/gpu_check_invariant_ops.py --sweep    # + every candidate config
    PYTHONPATH=src python3 scripts/gpu_check_invariant_ops.py --smoke    # CPU interpreter, tiny sizes

Each section on its own (a failure prints FAIL/ERROR and the next section runs):

1. Class check (bf16, fp16, fp32): every config of the default table (``table_configs(dtype)``) is
   invariant across M (rows and offset slices, ``torch.equal``) and all are mutually bitwise equal,
   at K = N = 4096 and at a K-tail shape. This re-verifies, on this GPU and Triton, the premise of
   the tuned table's invariance (fp16 runs bf16's table): FAIL = set ``MODE = "single"``. INFO:
   where timed non-table candidates (bf16) fall (``--sweep``: every candidate).
2. Public ``linear`` in the default mode: rows equal across M = 1 … 100,000 (bucket edges, offsets,
   bias; a wide and a narrow weight), and at every Qwen3-8B layer shape the rows of M = 1 … 2048
   equal those of M = 8192 (every weight class of the table).
3. Accuracy: ‖out − exact‖/‖exact‖ against fp64, next to cuBLAS's own error.
4. Determinism: ``linear`` forward + backward twice, bitwise (both ``BACKWARD_GEMM``); RMSNorm.
5. Speed (CUDA events, L2 flushed before each rep, median of 25): 8192×4096×4096 TFLOP/s of the
   default vs cuBLAS; each Qwen3-8B GEMM at M = 1, 8, 64, 256, 2048, 8192: default and "single"
   as time ÷ cuBLAS, next to class candidates (M <= 64: the former picks; M = 256 and 2048: the
   class's other tiles, to pick those cells); fwd+bwd; RMSNorm vs copy.

Ends with ONE compact table. Exit code 0 iff every non-INFO check passed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import time
import traceback

SMOKE = "--smoke" in sys.argv
SWEEP = "--sweep" in sys.argv
if SMOKE:  # before any Triton kernel module is imported; the public ops run the kernels too
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["RLKERNEL_BACKEND"] = "triton"

import torch  # noqa: E402

from rlkernel.bench.invariant import GEMM_SHAPES  # noqa: E402
from rlkernel.bench.timing import gpu_time_ms  # noqa: E402
from rlkernel.invariant.matmul import linear  # noqa: E402
from rlkernel.invariant.rmsnorm import rms_norm  # noqa: E402
from rlkernel.kernels import matmul as km  # noqa: E402
from rlkernel.kernels import rmsnorm as kr  # noqa: E402
from rlkernel.reference import rmsnorm as ref_rms  # noqa: E402

# The module (the package attribute ``rlkernel.invariant.matmul`` is the function of that name).
inv_matmul = importlib.import_module("rlkernel.invariant.matmul")

DEV = torch.device("cpu" if SMOKE else "cuda")
BF16 = torch.bfloat16
# Candidates timed per shape next to the table (INFO), all in the bf16 class of the earlier H100
# runs: at M <= 64 the decode sweep's 16-row tiles (and the former mma16_n32); at M = 256 and
# 2048 (where the table is 2-4x cuBLAS) the class's other tiles, to choose those cells.
CAND_SMALL = (
    "mma16_n32", "dec_n16_k256", "dec_n32_k256", "dec_n64_k128_s8", "dec_n64_k128_s4", "dec_n64_k64_s12"
)  # fmt: skip
CAND_MID = ("decode", "decode_n16", "decode_n32", "mma16_n32", "mid", "mid_tma", "prefill", "prefill_256x128")
CAND_LARGE = ("decode", "mid", "mid_tma", "prefill", "prefill_256x128", "prefill_tma_flat", "prefill_tma_ws")
EXTRA = ("mid_tma", "prefill")  # bf16 class members timed above but not in the table: class INFO
if SMOKE:
    K, N, M_FULL, OFFSET = 64, 96, 1100, 37
    MS = (1, 3, 8, 16, 17, 64, 65, 1000, 1025)
    BIG_M = M_FULL
    SHAPES = {"q/o": (64, 64), "k/v": (64, 16), "gate/up": (64, 192), "down": (192, 64), "lm_head": (64, 500)}
    PERF_MS = (1, 8, 64, 256, 300)
    RMS_SHAPES = {"hidden": (200, 64), "qk_norm": (400, 16)}
    REPS, WARMUP = 2, 1
    # every weight class and every cell's first config (TMA ones too) at tiny sizes
    km.NARROW_N, km.VOCAB_N, km.MIN_TILES, km.MIN_TILES_TMA = 16, 400, 1, 1
else:
    K, N, M_FULL, OFFSET = 4096, 4096, 8192, 37
    MS = (1, 2, 8, 16, 17, 32, 33, 64, 65, 1000, 1024, 1025, 8192)
    BIG_M = 100_000
    # Qwen3-8B's layer GEMMs and LM head, as the bench suite has them: "q/o 4096->4096": (K, N)
    SHAPES = {f"{name.removesuffix('_proj')} {k}->{n}": (k, n) for n, k, name in GEMM_SHAPES}
    PERF_MS = (1, 8, 32, 64, 256, 2048, 8192)
    RMS_SHAPES = {"hidden [8192,4096]": (8192, 4096), "qk_norm [262144,128]": (262144, 128)}
    REPS, WARMUP = 25, 3
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}

CHECKS: list[tuple[str, str, str]] = []
PERF: list[tuple[str, str, float, str, str]] = []  # workload, impl, ms, rate, vs baseline
NOTES: list[str] = []


@contextlib.contextmanager
def setting(module, name: str, value):
    """Set ``module.name = value`` for the block (``km.MODE``, ``BACKWARD_GEMM``); restored after."""
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def record(status: str, name: str, detail: str, t0: float) -> None:
    CHECKS.append((status, name, f"{detail} [{time.perf_counter() - t0:.1f} s]"))
    print(f"{status:5s} {name}: {detail}", flush=True)


def section(name: str, info: bool = False):
    """Run the decorated ``fn() -> (ok, detail)`` at once and record PASS/FAIL/INFO/ERROR."""

    def wrap(fn):
        t0 = time.perf_counter()
        try:
            ok, detail = fn()
            status = "INFO" if info else ("PASS" if ok else "FAIL")
        except Exception as exc:  # report and go on: the lead needs the whole table
            status, detail = ("INFO" if info else "ERROR"), f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc(limit=4)
        record(status, name, detail, t0)
        if not SMOKE:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return fn

    return wrap


def rand(*shape, dtype=BF16, seed=0, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=g) * scale).to(dtype)


def weight(n, k, dtype=BF16, seed=1):
    return rand(n, k, dtype=dtype, seed=seed, scale=k**-0.5)


def bench(fn) -> float:
    """Median ms over REPS calls: GPU time, each call queued behind an L2-evicting write (which also
    hides the host's launch latency; ``rlkernel.bench.timing.gpu_time_ms``)."""
    if SMOKE:
        fn()
        t0 = time.perf_counter()
        for _ in range(REPS):
            fn()
        return (time.perf_counter() - t0) / REPS * 1e3
    return gpu_time_ms(fn, DEV, reps=REPS, warmup=WARMUP)


def tflops(m, n, k, ms):
    return 2 * m * n * k / ms / 1e9


def rows_invariant(run, x, ms=MS, offsets=(0, OFFSET)):
    """``run(x[a:b])`` equals rows a:b of ``run(x)`` for every m in ``ms`` at the offsets (and at
    the end of x); returns the full output and the mismatches."""
    full = run(x)
    bad = []
    for m in ms:
        for start in {*offsets, x.shape[0] - m}:
            if 0 <= start and start + m <= x.shape[0] and m < x.shape[0]:
                if not torch.equal(run(x[start : start + m]), full[start : start + m]):
                    bad.append(f"m={m}@{start}")
    return full, bad


# ------------------------------------------------------------------------------ 1. class check
def class_check(dtype, configs, required, m_full, k, n, tag):
    """Each config invariant across M, then classes of mutually bitwise-equal configs. PASS iff
    every ``required`` config ran, is invariant and all of them sit in one class."""
    t0 = time.perf_counter()
    x = rand(m_full, k, dtype=dtype, seed=2)
    w = weight(n, k, dtype=dtype)
    outs, not_invariant, errors = {}, {}, {}
    for cfg in configs:
        try:
            full, bad = rows_invariant(
                lambda a, cfg=cfg: km.matmul(a, w.t(), config=cfg), x, [m for m in MS if m <= m_full]
            )
            outs[cfg.name] = full
            if bad:
                not_invariant[cfg.name] = bad[:4]
        except Exception as exc:
            errors[cfg.name] = f"{type(exc).__name__}: {str(exc)[:100]}"
            traceback.print_exc(limit=2)
    classes: list[list[str]] = []
    for name, out in outs.items():
        for cls in classes:
            if torch.equal(outs[cls[0]], out):
                cls.append(name)
                break
        else:
            classes.append([name])
    ok = not (required & (set(not_invariant) | set(errors))) and any(required <= set(c) for c in classes)
    detail = "classes: " + " | ".join("{" + ", ".join(c) + "}" for c in classes)
    if not_invariant:
        detail += f"; NOT invariant across M: {not_invariant}"
    if errors:
        detail += f"; errors: {errors}"
    name = f"{tag} table configs one class, each invariant across M (M<={m_full}, K={k}, N={n})"
    record("PASS" if ok else "FAIL", name, detail, t0)
    return classes


def run_class_checks():
    k_tail, n_tail = (K - 24, 1000) if not SMOKE else (40, 48)
    c16 = km.CANDIDATES_16
    table = {dt: km.table_configs(dt, mode="tuned") for dt in (BF16, torch.float16, torch.float32)}
    extra = [c16[nm] for nm in EXTRA]
    sweep16 = list(c16.values()) if SWEEP else []
    plans = (  # dtype, configs run, M_full, tag
        (BF16, list(dict.fromkeys(table[BF16] + extra + sweep16)), M_FULL, "bf16"),
        (torch.float16, list(dict.fromkeys(table[torch.float16] + table[BF16] + sweep16)), 2048, "fp16"),
        (torch.float32, list(km.CANDIDATES_32.values()), 1024, "fp32"),
    )
    for dtype, configs, m_full, tag in plans:
        required = {c.name for c in table[dtype]}
        try:
            classes = class_check(dtype, configs, required, min(m_full, M_FULL), K, N, tag)
            tail_cfgs = configs if SWEEP or dtype == torch.float32 else table[dtype]  # compile time
            class_check(dtype, tail_cfgs, required, min(512, M_FULL), k_tail, n_tail, f"{tag} K-tail")
            home = next((set(c) for c in classes if required <= set(c)), set())
            if dtype == BF16:
                NOTES.append(
                    f"CLASS bf16: timed non-table {EXTRA} in the table's class: {sorted(home & set(EXTRA))}"
                )
            if dtype == torch.float16:
                more = sorted({c.name for c in table[BF16]} - required)
                NOTES.append(
                    f"CLASS fp16: bf16-table configs {more} in fp16's class: {sorted(home & set(more))}"
                )
        except Exception as exc:
            record("ERROR", f"{tag} class check", f"{type(exc).__name__}: {exc}"[:300], time.perf_counter())
            traceback.print_exc(limit=4)


# --------------------------------------------------------------------------- 2. public invariance
def run_public_invariance():
    mode = km.mode_for(DEV)
    for n, label in ((N, "wide"), (N // 4, "narrow")):

        @section(f"linear bf16 {mode}: rows equal across M=1..{BIG_M} ({label} N={n}, bias, offsets)")
        def _(n=n):
            x = rand(BIG_M, K, seed=3)
            w = weight(n, K, seed=4)
            b = rand(n, seed=5)
            _, bad = rows_invariant(lambda a: linear(a, w, b), x)
            return not bad, "all rows equal" if not bad else f"differs at {bad[:8]}"

    for shape, (k, n) in SHAPES.items():

        @section(f"linear bf16 {mode}: {shape} rows at M={PERF_MS[:-1]} == M={PERF_MS[-1]} rows")
        def _(k=k, n=n):
            x = rand(PERF_MS[-1], k, seed=6)
            w = weight(n, k, seed=7)
            full = linear(x, w)
            bad = [m for m in PERF_MS[:-1] if not torch.equal(linear(x[:m], w), full[:m])]
            used = sorted({km.config_for(m, n, k, BF16, mode).name for m in PERF_MS})
            return not bad, (f"differs at M={bad}" if bad else "all rows equal") + f"; configs {used}"


# ------------------------------------------------------------------------------------ 3. accuracy
def run_accuracy():
    m = min(2048, M_FULL)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):

        @section(f"linear {str(dtype)[6:]} accuracy vs fp64 (M={m}, K={K}, N={N})")
        def _(dtype=dtype):
            x = rand(m, K, dtype=dtype, seed=8)
            w = weight(N, K, dtype=dtype, seed=9)
            b = rand(N, dtype=dtype, seed=10)
            exact = x.double() @ w.double().T + b.double()
            err = ((linear(x, w, b).double() - exact).norm() / exact.norm()).item()
            allow = torch.backends.cuda.matmul.allow_tf32 if not SMOKE else False
            torch.backends.cuda.matmul.allow_tf32 = False
            base = ((torch.nn.functional.linear(x, w, b).double() - exact).norm() / exact.norm()).item()
            torch.backends.cuda.matmul.allow_tf32 = allow
            ok = err <= REL_TOL[dtype] and err <= 2 * base + 1e-7
            return ok, f"rel err {err:.2e} (cuBLAS {base:.2e}, tol {REL_TOL[dtype]:.0e} and <= 2x cuBLAS)"

    @section("rms_norm bf16 kernel == reference bitwise; distance to HF's module")
    def _():
        x = rand(M_FULL, K, seed=11, scale=3.0)
        w = rand(K, seed=12, scale=0.1) + 1
        out = rms_norm(x, w)
        same = torch.equal(out, ref_rms.rms_norm(x, w))
        hf = ref_rms.rms_norm_hf(x, w)
        diff = (out != hf).float().mean().item()
        step = ((out.float() - hf.float()).abs() / hf.float().abs().clamp_min(1e-30)).max().item()
        # (the CPU interpreter casts fp32 -> bf16 by truncation: not bitwise there)
        return (
            same or SMOKE,
            f"kernel==reference: {same}; vs HF: {diff:.2%} elements differ, max rel {step:.1e}",
        )

    @section("rms_norm fwd+bwd accuracy vs fp64 autograd (bf16, [2048, 4096])")
    def _():
        m, h = (2048, K) if not SMOKE else (64, K)
        x = rand(m, h, seed=13, scale=3.0).requires_grad_()
        w = (rand(h, seed=14, scale=0.1) + 1).requires_grad_()
        gy = rand(m, h, seed=15)
        rms_norm(x, w).backward(gy)
        xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
        ref_rms.rms_norm_hf(xd, wd).backward(gy.double())
        ex = ((x.grad.double() - xd.grad).norm() / xd.grad.norm()).item()
        ew = ((w.grad.double() - wd.grad).norm() / wd.grad.norm()).item()
        return ex <= 1e-2 and ew <= 1e-2, f"dx rel {ex:.1e}, dweight rel {ew:.1e}"


# --------------------------------------------------------------------------------- 4. determinism
def run_determinism():
    for bwd in ("kernel", "torch"):

        @section(f"linear bf16 fwd+bwd deterministic (twice, bitwise), M=4096, BACKWARD_GEMM={bwd}")
        def _(bwd=bwd):
            m = min(4096, M_FULL)

            def once():
                x = rand(m, K, seed=16).requires_grad_()
                w = weight(N, K, seed=17).requires_grad_()
                b = rand(N, seed=18).requires_grad_()
                out = linear(x, w, b)
                out.backward(rand(m, N, seed=19))
                return out.detach(), x.grad, w.grad, b.grad

            with setting(inv_matmul, "BACKWARD_GEMM", bwd):
                a, b = once(), once()
            same = [torch.equal(u, v) for u, v in zip(a, b, strict=True)]
            x, w = rand(m, K, seed=16).double(), weight(N, K, seed=17).double()
            gy = rand(m, N, seed=19).double()
            errs = [
                ((a[1].double() - gy @ w).norm() / (gy @ w).norm()).item(),
                ((a[2].double() - gy.T @ x).norm() / (gy.T @ x).norm()).item(),
            ]
            ok = all(same) and max(errs) <= 1e-2
            return ok, f"out/dx/dw/db equal: {same}; dx, dw rel err vs fp64 {errs[0]:.1e}, {errs[1]:.1e}"

    @section("rms_norm bf16 fwd+bwd deterministic (twice, bitwise) + row invariance + QK-norm")
    def _():
        m = min(M_FULL, 8192)

        def once():
            x = rand(m, K, seed=20, scale=2.0).requires_grad_()
            w = (rand(K, seed=21, scale=0.1) + 1).requires_grad_()
            out = rms_norm(x, w)
            out.backward(rand(m, K, seed=22))
            return out.detach(), x.grad, w.grad

        a, b = once(), once()
        same = [torch.equal(u, v) for u, v in zip(a, b, strict=True)]
        w = rand(K, seed=24) + 1
        _, bad = rows_invariant(lambda t: rms_norm(t, w), rand(m, K, seed=23))
        heads, d = (32, 128) if not SMOKE else (4, 16)
        wq = rand(d, seed=26) + 1
        _, bad_q = rows_invariant(lambda t: rms_norm(t, wq), rand(min(m, 4096), heads, d, seed=25))
        ok = all(same) and not bad and not bad_q
        return ok, f"out/dx/dw equal: {same}; row mismatches {bad + bad_q or 'none'}"


# ---------------------------------------------------------------------------------------- 5. speed
def _gemm_perf(label, m, k, n, impls, baseline="cuBLAS"):
    x = rand(m, k, seed=30)
    w = weight(n, k, seed=31)
    times = {}
    for name, fn in impls.items():
        try:
            times[name] = bench(lambda fn=fn: fn(x, w))
        except Exception as exc:
            print(f"ERROR {label} {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    base = times.get(baseline)
    for name, ms in times.items():
        ratio = f"{ms / base:.2f}x time" if base else "-"
        PERF.append((label, name, ms, f"{tflops(m, n, k, ms):.0f} TFLOP/s", ratio))
        print(
            f"PERF  {label:32s} {name:20s} {ms:9.4f} ms {tflops(m, n, k, ms):7.1f} TFLOP/s {ratio}",
            flush=True,
        )
    return times


def _cfg_impl(cfg):
    return lambda x, w: km.matmul(x, w.t(), config=cfg)


def _single(x, w):
    with setting(km, "MODE", "single"):
        return linear(x, w)


def run_speed():
    mode = km.mode_for(DEV)
    base_impls = {"cuBLAS": torch.nn.functional.linear, f"rk {mode}": linear, "rk single": _single}
    c16 = km.CANDIDATES_16
    m, k, n = (8192, 4096, 4096) if not SMOKE else (PERF_MS[-1], K, N)
    try:
        impls = dict(base_impls)
        if SWEEP:
            impls.update({nm: _cfg_impl(c) for nm, c in c16.items()})
        t = _gemm_perf(f"GEMM bf16 {m}x{n}x{k}", m, k, n, impls)
        NOTES.append(
            f"GEMM {m}x{n}x{k}: cuBLAS {tflops(m, n, k, t['cuBLAS']):.0f} TFLOP/s; linear ({mode}, "
            f"{km.config_for(m, n, k, BF16, mode).name}) {tflops(m, n, k, t[f'rk {mode}']):.0f} TFLOP/s = "
            f"{t['cuBLAS'] / t[f'rk {mode}']:.0%} of cuBLAS; single {t['cuBLAS'] / t['rk single']:.0%}"
        )
    except Exception:
        traceback.print_exc(limit=4)

    small = [nm for nm in c16 if nm.startswith(("decode", "mma16", "mid"))]
    large = [nm for nm in c16 if nm.startswith(("prefill", "mid"))]
    for shape, (k, n) in SHAPES.items():
        ratios = []
        for m in PERF_MS:
            try:
                impls = dict(base_impls)
                cands = CAND_SMALL if m <= 64 else CAND_MID if m <= 256 else CAND_LARGE if m <= 2048 else ()
                names = (small if m <= 256 else large) if SWEEP else cands
                impls.update({nm: _cfg_impl(c16[nm]) for nm in names})
                t = _gemm_perf(f"{shape} M={m}", m, k, n, impls)
                best = min(names, key=lambda nm: t.get(nm, float("inf"))) if names else None
                ratio = (
                    f"M={m} {km.config_for(m, n, k, BF16, mode).name} {t[f'rk {mode}'] / t['cuBLAS']:.2f}x"
                )
                if best in t:
                    ratio += f" (best cand. {best} {t[best] / t['cuBLAS']:.2f}x)"
                ratios.append(ratio)
            except Exception:
                traceback.print_exc(limit=4)
        NOTES.append(f"{shape} {mode}/cuBLAS time: " + ", ".join(ratios))

    for label, (k, n) in list(SHAPES.items())[:: 2 if not SMOKE else 4]:
        try:
            _fwd_bwd_perf(f"fwd+bwd {label} M={PERF_MS[-1]}", PERF_MS[-1], k, n)
        except Exception:
            traceback.print_exc(limit=4)
    for label, (m, h) in RMS_SHAPES.items():
        try:
            _rms_perf(f"rms_norm {label}", m, h)
        except Exception:
            traceback.print_exc(limit=4)


def _fwd_bwd_perf(label, m, k, n):
    """Training: forward + both gradients, cuBLAS vs linear with each ``BACKWARD_GEMM``."""
    x = rand(m, k, seed=40).requires_grad_()
    w = weight(n, k, seed=41).requires_grad_()
    gy = rand(m, n, seed=42)
    rows = {"cuBLAS": bench(lambda: torch.autograd.grad(torch.nn.functional.linear(x, w), (x, w), gy))}
    for bwd in ("kernel", "torch"):
        with setting(inv_matmul, "BACKWARD_GEMM", bwd):
            rows[f"rk bwd={bwd}"] = bench(lambda: torch.autograd.grad(linear(x, w), (x, w), gy))
    for name, t in rows.items():
        PERF.append(
            (label, name, t, f"{3 * tflops(m, n, k, t):.0f} TFLOP/s", f"{t / rows['cuBLAS']:.2f}x time")
        )


def _rms_perf(label, m, h):
    """RMSNorm forward/backward bandwidth against a device-to-device copy of the same tensor."""
    x = rand(m, h, seed=50)
    w = rand(h, seed=51) + 1
    gy = rand(m, h, seed=52)
    dst = torch.empty_like(x)
    _, rstd = kr.rms_norm_fwd(x, w, 1e-6)
    nbytes = x.numel() * x.element_size()
    copy_bw = 2 * nbytes / bench(lambda: dst.copy_(x)) / 1e6
    for name, fn, moved in (
        ("rk fwd", lambda: kr.rms_norm_fwd(x, w, 1e-6), 2 * nbytes),
        ("rk bwd", lambda: kr.rms_norm_bwd(gy, x, w, rstd), 3 * nbytes),
    ):
        t = bench(fn)
        bw = moved / t / 1e6
        PERF.append((label, name, t, f"{bw:.0f} GB/s", f"{bw / copy_bw:.0%} of copy ({copy_bw:.0f} GB/s)"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes (a dry run)")
    parser.add_argument("--sweep", action="store_true", help="also check and time every candidate config")
    parser.add_argument("--no-bench", action="store_true", help="checks only")
    args = parser.parse_args()
    if not SMOKE and not torch.cuda.is_available():
        print("needs a CUDA device (or --smoke)")
        return 2
    t0 = time.perf_counter()
    if not SMOKE:
        import triton

        cap = torch.cuda.get_device_capability()
        versions = f"torch {torch.__version__}, triton {triton.__version__}"
        print(f"device {torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}, {versions}")
    print(
        f"MODE={km.MODE}, on this device: {km.mode_for(DEV)}; TMA API: {km.tma_api_available()}", flush=True
    )
    for shape, (k, n) in SHAPES.items():
        picks = [f"M={m} {km.describe_launch(m, n, k, BF16, km.mode_for(DEV))['name']}" for m in PERF_MS]
        print(f"launch {shape} ({km.weight_class(n)}): " + ", ".join(picks))
    for step in (run_class_checks, run_public_invariance, run_accuracy, run_determinism):
        step()
    print(f"checks done in {time.perf_counter() - t0:.0f} s", flush=True)
    if not args.no_bench:
        run_speed()

    print("\n" + "=" * 110)
    print(f"{'status':6s} {'check':70s} detail")
    for status, name, detail in CHECKS:
        print(f"{status:6s} {name:70s} {detail}")
    if PERF:
        print("-" * 110)
        print(f"{'workload':36s} {'impl':20s} {'ms':>10s} {'rate':>16s}  vs baseline")
        for workload, impl, ms, rate, ratio in PERF:
            print(f"{workload:36s} {impl:20s} {ms:10.4f} {rate:>16s}  {ratio}")
    print("-" * 110)
    for note in NOTES:
        print(note)
    failed = [c for c in CHECKS if c[0] in ("FAIL", "ERROR")]
    passed = f"{len(CHECKS) - len(failed)} / {len(CHECKS)} checks without FAIL/ERROR"
    print(f"total {time.perf_counter() - t0:.0f} s; {passed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
