"""GPU check of the token_logprobs Triton kernels at real sizes: correctness, then quick timings.

    python scripts/gpu_check_logprobs.py              # checks + timings (a few minutes on an H100)
    python scripts/gpu_check_logprobs.py --sweep      # also time a grid of launch configurations
    python scripts/gpu_check_logprobs.py --no-bench   # checks only

Every check runs on its own: a failure or an exception (OOM included) is reported in the table and
the next check runs. Checks marked "info" report facts to act on (e.g. whether the in-place
backward may be enabled inside torch.compile) and do not fail the run. Exit code 0 iff every
non-info check passed. Needs a CUDA device; uses ``rlkernel`` from the environment, else ``src/``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import traceback
from pathlib import Path

import torch

try:
    import rlkernel as rk
except ImportError:  # a checkout without `pip install -e .`: use its src/ (this script only)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import rlkernel as rk

from rlkernel.reference import logprobs as ref

N = 8192
VOCABS = (151936, 32768)
LOGP_ATOL = 1e-5  # DESIGN: bf16-input logp vs the fp32 reference on the same values
ENT_TOL = (1e-5, 1e-5)  # entropy (atol, rtol): a sum over V terms
# Gradient vs the fp32 reference gradient: (atol, rtol) for the final rounding to the logits' dtype
# (half an ulp), plus P_TOL·p_k·(|g_logp| + |g_H|)/T for the fp32 error of the entropy term
# p_k·(log p_k + H), which cancels to ~0 where log p_k ≈ −H (a relative bound alone fails there).
GRAD_TOL = {torch.bfloat16: (1e-9, 2**-8), torch.float16: (1e-7, 2**-10), torch.float32: (1e-9, 1e-5)}
P_TOL = 1e-5
REF_ROWS = 512  # reference computed on this many rows at a time (fp32 [rows, V] temporaries)

RESULTS: list[tuple[str, str, str]] = []


def check(name: str, info: bool = False):
    """Run ``fn() -> (ok, detail)``; record PASS/FAIL/ERROR (or INFO) and never raise."""

    def wrap(fn):
        t0 = time.perf_counter()
        try:
            ok, detail = fn()
            status = "INFO" if info else ("PASS" if ok else "FAIL")
        except Exception as exc:  # report and go on: the lead needs the whole table
            status, detail = ("INFO" if info else "ERROR"), f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc(limit=3)
        RESULTS.append((status, name, f"{detail}  [{time.perf_counter() - t0:.1f} s]"))
        print(f"{status:5s} {name}: {detail}", flush=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return fn

    return wrap


def make(n: int, vocab: int, seed: int, dtype=torch.bfloat16, scale: float = 3.0, ignore_every: int = 97):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(n, vocab, device="cuda", generator=gen).mul_(scale).to(dtype)
    ids = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    ids[::ignore_every] = -100
    return logits, ids


def reference_rows(logits, ids, rows, temperature=1.0, g_logp=None, g_ent=None):
    """fp32 reference logp, entropy and, if upstream grads are given, the autograd gradient and
    its error allowance ``P_TOL·p·(|g_logp| + |g_H|)/T`` (see GRAD_TOL)."""
    out_logp, out_ent, out_grad, out_slack = [], [], [], []
    for s in range(rows.start, rows.stop, REF_ROWS):
        sl = slice(s, min(s + REF_ROWS, rows.stop))
        x = logits[sl].float().requires_grad_(g_logp is not None or g_ent is not None)
        logp, ent = ref.token_logprobs(x, ids[sl], temperature=temperature, return_entropy=True)
        if x.requires_grad:
            loss = 0.0
            if g_logp is not None:
                loss = loss + (logp * g_logp[sl]).sum()
            if g_ent is not None:
                loss = loss + (ent * g_ent[sl]).sum()
            loss.backward()
            out_grad.append(x.grad)
            g_abs = sum(g[sl].abs() for g in (g_logp, g_ent) if g is not None)
            p = torch.softmax(x.detach() / temperature, -1)
            out_slack.append(P_TOL * p * g_abs[:, None] / temperature)
        out_logp.append(logp.detach())
        out_ent.append(ent.detach())
    if not out_grad:
        return torch.cat(out_logp), torch.cat(out_ent), None
    return torch.cat(out_logp), torch.cat(out_ent), (torch.cat(out_grad), torch.cat(out_slack))


def close(actual, expected, atol, rtol, slack=None):
    err = (actual.double() - expected.double()).abs()
    bound = atol + rtol * expected.double().abs() + (0.0 if slack is None else slack.double())
    bad = int((err > bound).sum())
    nan_mismatch = int((actual.isnan() != expected.isnan()).sum())
    return bad == 0 and nan_mismatch == 0, float(torch.nan_to_num(err, nan=0.0).max()), bad


# ------------------------------------------------------------------------------------- checks
def run_checks() -> None:
    from rlkernel.kernels import logprobs as K
    from rlkernel.ops import _logprobs_function as F

    for vocab in VOCABS:
        for temperature in (1.0, 0.7):

            @check(f"fwd+bwd bf16 N={N} V={vocab} T={temperature} vs fp32 reference")
            def _(vocab=vocab, temperature=temperature):
                logits, ids = make(N, vocab, seed=vocab)
                x = logits.clone().requires_grad_(True)
                logp, ent = rk.token_logprobs(x, ids, temperature=temperature, return_entropy=True)
                g_logp = torch.randn(N, device="cuda")
                g_ent = torch.randn(N, device="cuda")
                ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
                msgs, ok = [], True
                for rows in (slice(0, 1024), slice(N - 1024, N)):
                    r_logp, r_ent, r_grad = reference_rows(logits, ids, rows, temperature, g_logp, g_ent)
                    ok1, e1, _ = close(logp[rows], r_logp, LOGP_ATOL, 0.0)
                    ok2, e2, _ = close(ent[rows], r_ent, *ENT_TOL)
                    ok3, e3, b3 = close(x.grad[rows], r_grad[0], *GRAD_TOL[torch.bfloat16], r_grad[1])
                    ok &= ok1 and ok2 and ok3
                    msgs.append(
                        f"rows {rows.start}: |dlogp| {e1:.1e} |dH| {e2:.1e} |dgrad| {e3:.1e} ({b3} bad)"
                    )
                ignored = ids == -100
                zero = bool((logp[ignored] == 0).all() and (ent[ignored] == 0).all())
                zero &= bool((x.grad[ignored] == 0).all())
                ok &= zero
                return ok, "; ".join(msgs) + ("" if zero else "; ignored rows not exactly zero")

        @check(f"in-place backward == out-of-place, bitwise (bf16 N={N} V={vocab})")
        def _(vocab=vocab):
            logits, ids = make(N, vocab, seed=vocab + 1)
            grads = []
            for inplace in (False, True):
                x = logits.clone().requires_grad_(True)
                logp, ent = rk.token_logprobs(x, ids, return_entropy=True, inplace_backward=inplace)
                (logp.sum() + 0.5 * ent.sum()).backward()
                grads.append(x.grad)
                if inplace:
                    shares = x.grad.data_ptr() == x.data_ptr()
                del x, logp, ent
            return torch.equal(
                grads[0], grads[1]
            ) and shares, f"equal={torch.equal(*grads)} storage reused={shares}"

    @check("strided logits[:, :-1] of [B, T, V] == contiguous copy, bitwise; no copy made")
    def _():
        logits, _ = make(8 * 513, 151936, seed=3)
        logits = logits.view(8, 513, 151936)
        ids = torch.randint(0, 151936, (8, 513), device="cuda")
        sliced, sids = logits[:, :-1], ids[:, 1:]
        a = rk.token_logprobs(sliced, sids, return_entropy=True)
        b = rk.token_logprobs(sliced.contiguous(), sids, return_entropy=True)
        no_copy = K.as_kernel_layout(sliced) is sliced
        return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and no_copy, f"no copy={no_copy}"

    for vocab in VOCABS:

        @check(f"row invariance, bitwise (bf16 V={vocab}): alone vs batches of 7, 64, {N}")
        def _(vocab=vocab):
            logits, ids = make(N, vocab, seed=5)
            x = logits.clone().requires_grad_(True)
            full_logp, full_ent = rk.token_logprobs(x, ids, return_entropy=True)
            (full_logp.sum() + full_ent.sum()).backward()
            bad = []
            for n in (1, 7, 64):
                for start in (0, 1000, N - n):
                    xs = logits[start : start + n].clone().requires_grad_(True)
                    lp, en = rk.token_logprobs(xs, ids[start : start + n], return_entropy=True)
                    (lp.sum() + en.sum()).backward()
                    rows = slice(start, start + n)
                    same = torch.equal(lp, full_logp[rows]) and torch.equal(en, full_ent[rows])
                    same &= torch.equal(xs.grad, x.grad[rows])
                    if not same:
                        bad.append(f"n={n}@{start}")
            return not bad, "all equal" if not bad else f"differ: {bad}"

    @check("layout independence: num_warps / num_stages change no bit (pairwise sums)")
    def _():
        logits, ids = make(1024, 151936, seed=7)
        base = K.fwd_config(151936, torch.bfloat16)
        outs = []
        for warps, stages in ((base.num_warps, base.num_stages), (4, 1), (8, 2), (32, 4)):
            cfg = K.KernelConfig(base.block_v, warps, stages)
            logp, ent, lse = (torch.empty(1024, device="cuda") for _ in range(3))
            K._token_logprobs_fwd(logits, ids, logp, ent, lse, temperature=1.0, ignore_index=-100, config=cfg)
            outs.append((logp, ent, lse))
        same = all(all(torch.equal(a, b) for a, b in zip(o, outs[0], strict=True)) for o in outs[1:])
        return same, f"block {base.block_v}, warps/stages tried: (default), (4,1), (8,2), (32,4)"

    @check("determinism: two runs, fwd+bwd, bitwise")
    def _():
        logits, ids = make(N, 151936, seed=9)
        outs = []
        for _ in range(2):
            x = logits.clone().requires_grad_(True)
            logp, ent = rk.token_logprobs(x, ids, return_entropy=True)
            (logp.sum() + ent.sum()).backward()
            outs.append((logp, ent, x.grad))
            del x
        return all(torch.equal(a, b) for a, b in zip(*outs, strict=True)), ""

    @check("fp16 and fp32 logits, V=151936, N=256 vs reference")
    def _():
        msgs, ok = [], True
        for dtype in (torch.float16, torch.float32):
            logits, ids = make(256, 151936, seed=11, dtype=dtype)
            x = logits.clone().requires_grad_(True)
            logp, ent = rk.token_logprobs(x, ids, temperature=0.7, return_entropy=True)
            ones = torch.ones(256, device="cuda")
            (logp.sum() + ent.sum()).backward()
            r_logp, r_ent, r_grad = reference_rows(logits, ids, slice(0, 256), 0.7, ones, ones)
            ok1, e1, _ = close(logp, r_logp, LOGP_ATOL, 0.0)
            ok2, e2, _ = close(ent, r_ent, *ENT_TOL)
            ok3, e3, _ = close(x.grad, r_grad[0], *GRAD_TOL[dtype], r_grad[1])
            ok &= ok1 and ok2 and ok3
            msgs.append(f"{dtype}: |dlogp| {e1:.1e} |dH| {e2:.1e} |dgrad| {e3:.1e}")
        return ok, "; ".join(msgs)

    @check("N = 70,000 rows (> 65,535), V=4096, in-place backward")
    def _():
        n = 70_000
        logits, ids = make(n, 4096, seed=13)
        tail = slice(n - 512, n)
        tail_logits = logits[tail].clone()
        x = logits.requires_grad_(True)
        logp = rk.token_logprobs(x, ids, inplace_backward=True)
        logp.sum().backward()
        ones = torch.ones(n, device="cuda")
        r_logp, _, r_grad = reference_rows(tail_logits, ids[tail], slice(0, 512), 1.0, ones[:512])
        ok1, e1, _ = close(logp[tail], r_logp, LOGP_ATOL, 0.0)
        ok2, e2, _ = close(x.grad[tail], r_grad[0], *GRAD_TOL[torch.bfloat16], r_grad[1])
        return ok1 and ok2, f"tail rows: |dlogp| {e1:.1e} |dgrad| {e2:.1e}"

    @check("N·V > 2^31: N = 66,560, V = 32,768 bf16 (4.4 GB), entropy, in-place backward")
    def _():
        vocab = 32768
        n = 2**31 // vocab + 1024
        logits, ids = make(n, vocab, seed=17)
        tail = slice(n - 512, n)  # rows whose offsets are past 2^31 elements
        tail_logits = logits[tail].clone()
        x = logits.requires_grad_(True)
        logp, ent = rk.token_logprobs(x, ids, return_entropy=True, inplace_backward=True)
        (logp.sum() + ent.sum()).backward()
        ones = torch.ones(512, device="cuda")
        r_logp, r_ent, r_grad = reference_rows(tail_logits, ids[tail], slice(0, 512), 1.0, ones, ones)
        ok1, e1, _ = close(logp[tail], r_logp, LOGP_ATOL, 0.0)
        ok2, e2, _ = close(ent[tail], r_ent, *ENT_TOL)
        ok3, e3, _ = close(x.grad[tail], r_grad[0], *GRAD_TOL[torch.bfloat16], r_grad[1])
        return ok1 and ok2 and ok3, f"tail rows: |dlogp| {e1:.1e} |dH| {e2:.1e} |dgrad| {e3:.1e}"

    def compiled_vs_eager(inplace: bool):
        logits, ids = make(2 * 1025, 32768, seed=19)
        logits = logits.view(2, 1025, 32768)
        ids = ids.view(2, 1025)

        def loss_fn(x, tok):
            logp, ent = rk.token_logprobs(
                x[:, :-1],
                tok[:, 1:],
                temperature=0.7,
                return_entropy=True,
                validate=False,
                inplace_backward=inplace,
            )
            return (logp * 2).sum() + ent.mean()

        torch._dynamo.reset()
        xe = logits.clone().requires_grad_(True)
        le = loss_fn(xe, ids)
        le.backward()
        xc = logits.clone().requires_grad_(True)
        lc = torch.compile(loss_fn, fullgraph=True)(xc, ids)
        lc.backward()
        # Inductor may sum the loss in another order; the kernels' outputs and gradients must agree.
        loss_close = torch.allclose(le, lc, rtol=1e-6, atol=0)
        grad_equal = torch.equal(xe.grad, xc.grad)
        return loss_close and grad_equal, f"loss close={loss_close} grad bitwise equal={grad_equal}"

    for inplace in (False, True):

        @check(f"torch.compile(fullgraph=True) == eager, inplace_backward={inplace}")
        def _(inplace=inplace):
            return compiled_vs_eager(inplace)

    @check(
        "in-place backward also works inside torch.compile (set _INPLACE_UNDER_COMPILE = True?)", info=True
    )
    def _():
        old = F._INPLACE_UNDER_COMPILE
        F._INPLACE_UNDER_COMPILE = True
        try:
            ok, detail = compiled_vs_eager(True)
            return ok, ("works" if ok else "does not match") + f": {detail}"
        finally:
            F._INPLACE_UNDER_COMPILE = old

    @check("peak extra memory of fwd+bwd, bf16 N=8192 V=151936 (logits = 2.49 GB)", info=True)
    def _():
        logits, ids = make(N, 151936, seed=23)
        parts = []
        for name in ("torch", "rlkernel", "rlkernel inplace"):
            x = logits.clone().requires_grad_(True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            if name == "torch":
                lp = torch.log_softmax(x.float(), -1).gather(-1, ids.clamp(min=0)[:, None]).squeeze(-1)
            else:
                lp = rk.token_logprobs(x, ids, validate=False, inplace_backward=name.endswith("inplace"))
            lp.sum().backward()
            torch.cuda.synchronize()
            parts.append(f"{name} {(torch.cuda.max_memory_allocated() - base) / 1e9:.2f} GB")
            del x, lp
        return True, ", ".join(parts)


# ------------------------------------------------------------------------------------- timings
def bench(fn, grad_to_none=None) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, grad_to_none=grad_to_none, return_mode="median")


def copy_time(src: torch.Tensor) -> float:
    """Device-to-device copy of ``src``: the bandwidth ceiling of this run."""
    dst = torch.empty_like(src)
    return bench(lambda: dst.copy_(src))


def time_vocab(vocab: int) -> None:
    logits, ids = make(N, vocab, seed=29)
    nbytes = logits.numel() * logits.element_size()
    t_copy = copy_time(logits)
    copy_bw = 2 * nbytes / t_copy / 1e6  # GB/s (read + write)
    print(f"\nV={vocab}: logits {nbytes / 1e9:.2f} GB; D2D copy {t_copy:.3f} ms = {copy_bw:.0f} GB/s")
    g = torch.ones(N, device="cuda")
    safe_ids = ids.clamp(min=0)
    xg = logits.clone().requires_grad_(True)
    xi = logits.clone().requires_grad_(True)  # overwritten by its gradient each step: same work

    def torch_logp(x):
        return torch.log_softmax(x.float(), -1).gather(-1, safe_ids[:, None]).squeeze(-1)

    def ours_entropy_fwd_bwd():
        logp, ent = rk.token_logprobs(xg, ids, validate=False, return_entropy=True)
        (logp.sum() + ent.sum()).backward()

    # (what, implementation, passes over the logits, fn, tensors whose .grad to reset)
    cases = [
        ("fwd logp", "torch", 1, lambda: torch_logp(logits), None),
        ("fwd logp", "rlkernel", 1, lambda: rk.token_logprobs(logits, ids, validate=False), None),
        (
            "fwd logp+H",
            "rlkernel",
            1,
            lambda: rk.token_logprobs(logits, ids, validate=False, return_entropy=True),
            None,
        ),
        ("fwd+bwd logp", "torch", 3, lambda: torch_logp(xg).backward(g), [xg]),
        ("fwd+bwd logp", "rlkernel", 3, lambda: rk.token_logprobs(xg, ids, validate=False).backward(g), [xg]),
        ("fwd+bwd logp+H", "rlkernel", 3, ours_entropy_fwd_bwd, [xg]),
        (
            "fwd+bwd logp",
            "rlkernel inplace",
            3,
            lambda: rk.token_logprobs(xi, ids, validate=False, inplace_backward=True).backward(g),
            [xi],
        ),
    ]
    for what, impl, passes, fn, to_none in cases:
        try:
            ms = bench(fn, to_none)
            gbs = passes * nbytes / ms / 1e6
            ideal = passes * nbytes / copy_bw / 1e6
            print(
                f"  {what:15s} {impl:17s} {ms:8.3f} ms  {gbs:7.0f} GB/s  "
                f"{100 * gbs / copy_bw:5.1f}% of copy  (ideal {ideal:.3f} ms)",
                flush=True,
            )
        except Exception as exc:
            print(f"  {what:15s} {impl:17s} ERROR {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        torch.cuda.empty_cache()


def run_timings() -> None:
    for vocab in VOCABS:
        time_vocab(vocab)
        torch.cuda.empty_cache()
    print("\nGB/s counts the minimal traffic: fwd = 1 pass over the bf16 logits, fwd+bwd = 3 passes.")


def sweep_vocab(vocab: int) -> None:
    from rlkernel.kernels import logprobs as K

    logits, ids = make(N, vocab, seed=31)
    nbytes = logits.numel() * logits.element_size()
    logp, ent, lse = (torch.empty(N, device="cuda") for _ in range(3))
    print(f"\nforward sweep V={vocab} (default {K.fwd_config(vocab, torch.bfloat16)})")
    results = []
    for entropy in (False, True):
        for block in (2048, 4096, 8192, 16384):
            for warps in (4, 8, 16, 32):
                for stages in (1, 2, 3, 4):
                    if block // (32 * warps) < 2:
                        continue
                    cfg = K.KernelConfig(block, warps, stages)

                    def fwd(cfg=cfg, entropy=entropy):
                        K._token_logprobs_fwd(
                            logits, ids, logp, ent if entropy else None, lse,
                            temperature=1.0, ignore_index=-100, config=cfg,
                        )  # fmt: skip

                    try:
                        ms = bench(fwd)
                        results.append((entropy, nbytes / ms / 1e6, ms, cfg))
                    except Exception as exc:
                        print(f"  {cfg} entropy={entropy}: {type(exc).__name__}: {str(exc)[:120]}")
    for entropy in (False, True):
        for _, gbs, ms, cfg in sorted((r for r in results if r[0] == entropy), key=lambda r: -r[1])[:6]:
            print(f"  entropy={entropy!s:5s} {cfg}: {ms:.3f} ms {gbs:.0f} GB/s")
    grad = torch.empty_like(logits)
    g = torch.ones(N, device="cuda")
    print(f"backward sweep V={vocab} (default {K.bwd_config(vocab, torch.bfloat16)})")
    results = []
    for block in (1024, 2048, 4096, 8192):
        for warps in (2, 4, 8, 16):
            if block // (32 * warps) < 2:
                continue
            cfg = K.KernelConfig(block, warps)

            def bwd(cfg=cfg):
                K._token_logprobs_bwd(
                    logits, ids, lse, ent, g, None, grad, temperature=1.0, ignore_index=-100, config=cfg
                )

            try:
                ms = bench(bwd)
                results.append((2 * nbytes / ms / 1e6, ms, cfg))
            except Exception as exc:
                print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
    for gbs, ms, cfg in sorted(results, key=lambda r: -r[0])[:6]:
        print(f"  {cfg}: {ms:.3f} ms {gbs:.0f} GB/s (read + write)")


def run_sweep() -> None:
    for vocab in VOCABS:
        sweep_vocab(vocab)
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--no-bench", action="store_true", help="correctness checks only")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of launch configurations")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check_logprobs: no CUDA device; nothing to check")
        return 2
    import triton

    device = torch.cuda.get_device_name()
    print(f"{device} | torch {torch.__version__} | triton {triton.__version__}")
    with contextlib.suppress(Exception):
        print(f"rlkernel {rk.__version__} from {Path(rk.__file__).parent}")
    with rk.use_backend("triton"):
        run_checks()
        print("\n" + "=" * 100)
        for status, name, detail in RESULTS:
            print(f"{status:5s} | {name}\n      | {detail}")
        print("=" * 100)
        failed = [r for r in RESULTS if r[0] in ("FAIL", "ERROR")]
        print(f"{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed or informational")
        if not args.no_bench:
            try:
                run_timings()
            except Exception:
                traceback.print_exc()
        if args.sweep:
            try:
                run_sweep()
            except Exception:
                traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
