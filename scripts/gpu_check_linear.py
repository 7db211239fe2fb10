"""GPU check of the chunked linear path (hidden states → log-probs / DAPO-KL loss): correctness at
real sizes, row invariance, determinism, timings against the cuBLAS GEMM ceilings, peak memory.

Run once on an H100 (about 4-5 minutes):

    PYTHONPATH=src python3 scripts/gpu_check_linear.py            # full
    PYTHONPATH=src python3 scripts/gpu_check_linear.py --smoke    # CPU, tiny sizes, interpreter

Sections (each in try/except: a failure prints FAIL and the traceback's tail, then the run goes on):
    correctness  N=8192, H=4096, V=151936 bf16, bias, T=0.9, entropy: logp/entropy max |Δ| and
                 hidden/weight/bias gradient relative norm differences vs the fp32 chunked reference
                 (rlkernel.reference.logprobs), for fp32 and bf16 chunk logits and both dweight
                 accumulations; frozen weight; the fused DAPO-KL loss vs policy_loss(reference logp)
    large        N=16384 (N·V > 2^31): logp of the first and last rows vs the reference
    invariance   logp of rows 0..k bitwise equal within N=k, 4096, 16384 (other rows random)
    determinism  two fwd+bwd runs bitwise equal (logp, dhidden, dweight)
    timing       primitive fwd+bwd, fused DAPO-KL fwd+bwd, frozen-weight fused, plain torch, for
                 chunk logits fp32/bf16 × chunk rows 1024/2048/4096 × dweight fp32/bf16 accumulation,
                 vs the 3-GEMM (2-GEMM when frozen) cuBLAS ceiling timed in the same run; N=65536.
Ends with one table and the recommended defaults.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("RLKERNEL_BACKEND", "triton")

import torch  # noqa: E402

import rlkernel as rk  # noqa: E402
from rlkernel.ops import _linear_engine as engine  # noqa: E402
from rlkernel.ops import _linear_function as lf  # noqa: E402
from rlkernel.ops._linear_loss import autograd_coef_fn, ppo_kl_chunk_loss  # noqa: E402
from rlkernel.reference import logprobs as ref  # noqa: E402
from rlkernel.rl import token_loss as tl  # noqa: E402

RESULTS: list[str] = []
ROWS: list[tuple] = []
DEV = torch.device("cpu" if SMOKE else "cuda")
T = 0.9
KL = 1e-3


def status(ok: bool, what: str, detail: str = "") -> None:
    line = f"{'PASS' if ok else 'FAIL'} {what}" + (f": {detail}" if detail else "")
    print(line, flush=True)
    RESULTS.append(line)


def section(fn):
    def run(*a, **k):
        t0 = time.perf_counter()
        try:
            fn(*a, **k)
        except Exception:  # noqa: BLE001 - report and go on
            tb = traceback.format_exc().strip().splitlines()
            status(False, f"section {fn.__name__} raised", " | ".join(tb[-4:]))
        print(f"  [{fn.__name__}: {time.perf_counter() - t0:.1f} s]", flush=True)
        free()

    return run


def free():
    import gc

    gc.collect()
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def bench(fn, reps=20, warmup=2):
    """Median ms over ``reps`` calls (CUDA events) and peak extra GB of one call."""
    for _ in range(warmup):
        fn()
    sync()
    peak = None
    if DEV.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        sync()
        peak = (torch.cuda.max_memory_allocated() - base) / 1e9
    times = []
    for _ in range(reps):
        if DEV.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), peak


def sizes():
    if SMOKE:
        configs = [("fp32", 16, 16), ("fp32", 16, 32), ("input", 32, 32)]
        return dict(n=64, h=16, v=100, big_n=96, inv_ns=(5, 32, 96), configs=configs, n_large=128)
    # (chunk logits dtype, logits chunk rows C, gradient group rows G)
    configs = [
        ("fp32", 1024, 2048),
        ("fp32", 1024, 4096),
        ("fp32", 512, 2048),
        ("fp32", 2048, 4096),
        ("input", 2048, 2048),
        ("input", 2048, 4096),
        ("input", 4096, 4096),
        ("input", 1024, 2048),
    ]
    return dict(
        n=8192, h=4096, v=151936, big_n=16384, inv_ns=(100, 4096, 16384), configs=configs, n_large=65536
    )


def inputs(n, h, v, seed=0, bias=True, dtype=torch.bfloat16):
    g = torch.Generator(device=DEV).manual_seed(seed)
    hid = torch.randn(n, h, device=DEV, generator=g, dtype=dtype)
    w = (torch.randn(v, h, device=DEV, generator=g, dtype=torch.float32) * h**-0.5 * 2).to(dtype)
    b = (torch.randn(v, device=DEV, generator=g) * 0.1).to(dtype) if bias else None
    ids = torch.randint(0, v, (n,), device=DEV, generator=g)
    ids[::97] = -100
    return hid, w, b, ids


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def ref_run(hid, w, b, ids, gl, ge):
    """fp32 chunked reference: logp, entropy and the (hidden, weight, bias) gradients."""
    leaves = [t.detach().requires_grad_(True) for t in (hid, w, b)]
    logp, ent = ref.linear_token_logprobs(
        *leaves[:2], ids, bias=leaves[2], temperature=T, return_entropy=True
    )
    grads = torch.autograd.grad((logp, ent), leaves, (gl, ge))
    return logp.detach(), ent.detach(), grads


def ours_run(hid, w, b, ids, gl, ge, **kw):
    leaves = [t.detach().requires_grad_(True) for t in (hid, w, b)]
    logp, ent = lf.linear_token_logprobs_triton(
        leaves[0], leaves[1], ids, bias=leaves[2], temperature=T, return_entropy=True, **kw
    )
    grads = torch.autograd.grad((logp, ent), leaves, (gl, ge))
    return logp.detach(), ent.detach(), grads


ACC: dict[str, float] = {}


@section
def correctness():
    s = sizes()
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"mm(out_dtype=fp32) on {DEV.type}: {lf._mm_out_dtype_supported(DEV)}")
    hid, w, b, ids = inputs(s["n"], s["h"], s["v"])
    g = torch.Generator(device=DEV).manual_seed(5)
    gl = torch.randn(s["n"], device=DEV, generator=g)
    ge = torch.randn(s["n"], device=DEV, generator=g) * 0.1
    rlogp, rent, rgrads = ref_run(hid, w, b, ids, gl, ge)
    free()
    for zdt in ("fp32", "input"):
        for acc in ("fp32", "weight"):
            logp, ent, grads = ours_run(hid, w, b, ids, gl, ge, logits_dtype=zdt, dweight_accum=acc)
            dl = (logp - rlogp).abs().max().item()
            de = (ent - rent).abs().max().item()
            rg = [rel(a, c) for a, c in zip(grads, rgrads, strict=True)]
            ACC[f"{zdt}/{acc}"] = dl
            lim = 1e-4 if zdt == "fp32" else 1e-1
            ok = dl <= lim and de <= lim and max(rg) <= 1e-2
            status(
                ok,
                f"primitive logits={zdt} dweight={acc} vs fp32 reference",
                f"logp max|Δ| {dl:.2e}, entropy {de:.2e}, grad rel (h, W, b) "
                + ", ".join(f"{x:.2e}" for x in rg),
            )
            del logp, ent, grads
            free()
    # frozen weight: dhidden and dbias only
    leaves = [hid.detach().requires_grad_(True), b.detach().requires_grad_(True)]
    logp = lf.linear_token_logprobs_triton(leaves[0], w, ids, bias=leaves[1], temperature=T)
    dh, db = torch.autograd.grad(logp, leaves, gl)
    r = [rel(dh, rgrads[0]), rel(db, rgrads[2])]
    # the reference grads include the entropy term: compare against a logp-only reference
    rl = [t.detach().requires_grad_(True) for t in (hid, b)]
    rdh, rdb = torch.autograd.grad(
        ref.linear_token_logprobs(rl[0], w, ids, bias=rl[1], temperature=T), rl, gl
    )
    r = [rel(dh, rdh), rel(db, rdb)]
    status(max(r) <= 1e-2, "frozen weight (dhidden, dbias) vs reference", ", ".join(f"{x:.2e}" for x in r))
    del dh, db, rdh, rdb, rgrads
    free()
    fused_correctness(hid, w, b, ids)


def dapo_inputs(n, ids, seed=7):
    g = torch.Generator(device=DEV).manual_seed(seed)
    t = 16 if SMOKE else 1024
    bsz = n // t
    lengths = torch.randint(int(0.8 * t), t + 1, (bsz,), device=DEV, generator=g)
    mask = (torch.arange(t, device=DEV)[None] < lengths[:, None]).reshape(-1)
    old = torch.randn(n, device=DEV, generator=g) * 0.1 - 12.0
    refl = torch.randn(n, device=DEV, generator=g) * 0.1 - 12.0
    adv = torch.randn(bsz, device=DEV, generator=g)[:, None].expand(bsz, t).reshape(-1).contiguous()
    ids_m = torch.where(mask, ids.clamp(min=0), torch.full_like(ids, -100))
    return dict(mask=mask, old=old, ref=refl, adv=adv, ids=ids_m, b=bsz, t=t)


def dapo_coef_fn(d):
    return autograd_coef_fn(
        ppo_kl_chunk_loss(
            d["old"],
            d["adv"],
            d["mask"],
            clip_low=0.2,
            clip_high=0.28,
            kl_coef=KL,
            ref_logp=d["ref"],
            dual_clip=10.0,
        )
    )


def plan_coef_fn(d, cfg):
    """The real per-chunk coefficients: the rlkernel.rl.token_loss plan, one launch per chunk."""
    shp = (d["b"], d["t"])
    plan = tl.build_plan(
        cfg,
        token_ids=d["ids"].clamp(min=0).reshape(shp),
        old_logp=d["old"].reshape(shp),
        advantages=d["adv"].reshape(shp),
        mask=d["mask"].reshape(shp),
        ref_logp=d["ref"].reshape(shp),
    )
    return tl.as_coef_fn(plan), plan.ids.reshape(-1)


def dapo_policy_loss(logp, d, cfg):
    """policy_loss of the DAPO inputs ``d`` on flat ``logp``."""
    shp = (d["b"], d["t"])
    return rk.policy_loss(
        logp.reshape(shp),
        d["old"].reshape(shp),
        d["adv"].reshape(shp),
        d["mask"].reshape(shp),
        cfg,
        ref_logp=d["ref"].reshape(shp),
    )


def fused_correctness(hid, w, b, ids):
    n = hid.shape[0]
    d = dapo_inputs(n, ids)
    # old/ref near the true logp so that clipping happens on a few % of the tokens
    with torch.no_grad():
        true = lf.linear_token_logprobs_triton(hid, w, d["ids"], bias=b, temperature=T)
    d["old"] = true + d["old"] + 12.0
    d["ref"] = true + d["ref"] + 12.0
    cfg = rk.PolicyLossConfig.preset("dapo", kl_coef=KL, kl_estimator="k3")
    leaves = [t.detach().requires_grad_(True) for t in (hid, w, b)]
    loss, _ = lf.fused_linear_token_loss(*leaves, d["ids"], coef_fn=dapo_coef_fn(d), temperature=T)
    grads = torch.autograd.grad(loss, leaves)
    rl = [t.detach().requires_grad_(True) for t in (hid, w, b)]
    rlogp = ref.linear_token_logprobs(rl[0], rl[1], d["ids"], bias=rl[2], temperature=T)
    out = dapo_policy_loss(rlogp, d, cfg)
    rgrads = torch.autograd.grad(out.loss, rl)
    dl = abs(loss.item() - out.loss.item())
    rg = [rel(a, c) for a, c in zip(grads, rgrads, strict=True)]
    # Same precision first: the composed GPU path (the engine's primitive, whose backward also rounds
    # dL/dlogits to bf16 before its GEMMs, + policy_loss autograd) must agree closely.
    cl = [t.detach().requires_grad_(True) for t in (hid, w, b)]
    clogp = lf.linear_token_logprobs_triton(cl[0], cl[1], d["ids"], bias=cl[2], temperature=T)
    cout = dapo_policy_loss(clogp, d, cfg)
    cgrads = torch.autograd.grad(cout.loss, cl)
    rc = [rel(a, c) for a, c in zip(grads, cgrads, strict=True)]
    status(
        abs(loss.item() - cout.loss.item()) <= 1e-5 * max(1.0, abs(cout.loss.item())) and max(rc) <= 2e-3,
        "fused DAPO-KL vs composed GPU path (same bf16 gradient rounding)",
        f"loss {loss.item():.6f} vs {cout.loss.item():.6f}, grad rel (h, W, b) "
        + ", ".join(f"{x:.2e}" for x in rc),
    )
    # Against the fp32 reference, whose backward GEMMs run in fp32: the bf16 rounding of dL/dlogits
    # (2.8e-3 for the primitive) is amplified by the tokens that flip across a clip boundary.
    status(
        dl <= 1e-4 * max(1.0, abs(out.loss.item())) and max(rg) <= 2e-2,
        "fused DAPO-KL loss vs policy_loss(fp32 reference logp)",
        f"loss {loss.item():.6f} vs {out.loss.item():.6f}, grad rel (h, W, b) "
        + ", ".join(f"{x:.2e}" for x in rg),
    )
    coef, plan_ids = plan_coef_fn(d, cfg)
    leaves = [t.detach().requires_grad_(True) for t in (hid, w, b)]
    loss2, _ = lf.fused_linear_token_loss(*leaves, plan_ids, coef_fn=coef, temperature=T)
    grads2 = torch.autograd.grad(loss2, leaves)
    rg2 = [rel(a, c) for a, c in zip(grads2, rgrads, strict=True)]
    dl2 = abs(loss2.item() - out.loss.item())
    status(
        dl2 <= 1e-4 * max(1.0, abs(out.loss.item())) and max(rg2) <= 2e-2,
        "fused DAPO-KL loss with the token_loss plan coef_fn vs policy_loss(reference logp)",
        f"loss {loss2.item():.6f}, grad rel (h, W, b) " + ", ".join(f"{x:.2e}" for x in rg2),
    )


@section
def large():
    s = sizes()
    n = s["big_n"]
    hid, w, b, ids = inputs(n, s["h"], s["v"], seed=3)
    with torch.no_grad():
        logp = lf.linear_token_logprobs_triton(hid, w, ids, bias=b, temperature=T)
        k = 256 if not SMOKE else 8
        idx = torch.cat([torch.arange(k, device=DEV), torch.arange(n - k, n, device=DEV)])
        want = ref.linear_token_logprobs(hid[idx], w, ids[idx], bias=b, temperature=T)
    d = (logp[idx] - want).abs().max().item()
    status(
        d <= 1e-4, f"N={n} (N*V={n * s['v']:.3g} > 2^31: {n * s['v'] > 2**31}) first/last rows", f"{d:.2e}"
    )


@section
def invariance():
    s = sizes()
    ns = s["inv_ns"]
    hid, w, b, ids = inputs(max(ns), s["h"], s["v"], seed=4)
    k = ns[0]
    with torch.no_grad():
        base = lf.linear_token_logprobs_triton(hid[:k], w, ids[:k], bias=b, temperature=T)
        ok = True
        for n in ns[1:]:
            other = hid[:n].clone()
            other[k:] = torch.randn_like(other[k:])
            got = lf.linear_token_logprobs_triton(other, w, ids[:n], bias=b, temperature=T)
            ok &= torch.equal(got[:k], base)
        for zdt in ("input",):
            b1 = lf.linear_token_logprobs_triton(hid[:k], w, ids[:k], bias=b, temperature=T, logits_dtype=zdt)
            b2 = lf.linear_token_logprobs_triton(hid, w, ids, bias=b, temperature=T, logits_dtype=zdt)
            ok2 = torch.equal(b1, b2[:k])
    status(ok, f"row invariance: logp of rows 0..{k} bitwise equal within N={ns} (fp32 logits)")
    status(ok2, f"row invariance (bf16 logits) N={k} vs N={max(ns)}")


@section
def determinism():
    s = sizes()
    hid, w, b, ids = inputs(s["n"], s["h"], s["v"], seed=6)
    gl = torch.randn(s["n"], device=DEV)
    ge = torch.randn(s["n"], device=DEV) * 0.1
    a = ours_run(hid, w, b, ids, gl, ge)
    a = (a[0], a[1], *a[2])
    free()
    c = ours_run(hid, w, b, ids, gl, ge)
    c = (c[0], c[1], *c[2])
    status(
        all(torch.equal(x, y) for x, y in zip(a, c, strict=True)),
        "determinism: two fwd+bwd runs bitwise equal",
    )


# -------------------------------------------------------------------------------------- timing
def gemm_ceiling(n, h, v, dtype=torch.bfloat16):
    g = torch.Generator(device=DEV).manual_seed(0)
    a = torch.randn(n, h, device=DEV, dtype=dtype, generator=g)
    w = torch.randn(v, h, device=DEV, dtype=dtype, generator=g)
    gz = torch.randn(n, v, device=DEV, dtype=dtype, generator=g) if n * v <= 2**31 else None
    if gz is None:
        return None, None
    t_logits, _ = bench(lambda: a @ w.t(), reps=10)
    t_dh, _ = bench(lambda: gz @ w, reps=10)
    t_dw, _ = bench(lambda: gz.t() @ a, reps=10)
    return t_logits + t_dh + t_dw, t_logits + t_dh


def plain_dapo(hid, w, b, d, need_w=True):
    leaves = [hid.detach().requires_grad_(True), w.detach().requires_grad_(need_w)]
    params = leaves if need_w else leaves[:1]

    def call():
        z = leaves[0] @ leaves[1].t() + b
        logp_all = torch.log_softmax(z.float() / T, dim=-1)
        ids = d["ids"].clamp(min=0)
        logp = logp_all.gather(-1, ids[:, None]).squeeze(-1)
        per = ppo_kl_chunk_loss(
            d["old"],
            d["adv"],
            d["mask"],
            clip_low=0.2,
            clip_high=0.28,
            kl_coef=KL,
            ref_logp=d["ref"],
            dual_clip=10.0,
        )(slice(0, logp.shape[0]), logp, None)
        return torch.autograd.grad(per, params)

    return call


def fused_call(hid, w, b, d, need_w=True, **kw):
    leaves = [hid.detach().requires_grad_(True), w.detach().requires_grad_(need_w)]
    params = leaves if need_w else leaves[:1]
    coef = dapo_coef_fn(d)

    def call():
        loss, _ = lf.fused_linear_token_loss(
            leaves[0], leaves[1], b, d["ids"], coef_fn=coef, temperature=T, **kw
        )
        return torch.autograd.grad(loss, params)

    return call


def prim_call(hid, w, b, ids, gl, **kw):
    leaves = [hid.detach().requires_grad_(True), w.detach().requires_grad_(True)]

    def call():
        logp = lf.linear_token_logprobs_triton(leaves[0], leaves[1], ids, bias=b, temperature=T, **kw)
        return torch.autograd.grad(logp, leaves, gl)

    return call


def row(n, what, ms, peak, ceil):
    frac = ms / ceil if (ms and ceil) else None
    ROWS.append((n, what, ms, peak, frac))
    f = f"{frac:.3f}x" if frac else "-"
    pk = f"{peak:.2f} GB" if peak is not None else "-"
    print(f"  N={n:<6} {what:<58} {ms:9.2f} ms  {pk:>9}  {f}", flush=True)


@section
def timing():
    s = sizes()
    n, h, v = s["n"], s["h"], s["v"]
    reps = 2 if SMOKE else 20
    hid, w, b0, ids = inputs(n, h, v, seed=8, bias=False)
    b = None
    d = dapo_inputs(n, ids)
    c3, c2 = gemm_ceiling(n, h, v)
    free()
    row(n, "ceiling: 3 cuBLAS GEMMs (logits, dhidden, dweight)", c3, None, c3)
    row(n, "ceiling: 2 cuBLAS GEMMs (logits, dhidden)", c2, None, c2)
    try:
        ms, pk = bench(plain_dapo(hid, w, b0 * 0 if b0 is not None else 0, d), reps=max(2, reps // 4))
        row(n, "plain torch DAPO-KL fwd+bwd", ms, pk, c3)
    except torch.OutOfMemoryError:
        row(n, "plain torch DAPO-KL fwd+bwd: OOM", float("nan"), None, None)
    free()
    gl = torch.randn(n, device=DEV)
    for zdt, c, cg in s["configs"]:
        opt = dict(chunk_rows=c, grad_rows=cg, logits_dtype=zdt)
        tag = f"logits={zdt} C={c} G={cg}"
        for acc in ("fp32", "weight"):
            try:
                ms, pk = bench(fused_call(hid, w, b, d, dweight_accum=acc, **opt), reps=reps)
                row(n, f"fused DAPO-KL {tag} dW={acc}", ms, pk, c3)
            except Exception as exc:  # noqa: BLE001 - OOM or a failure: one row, go on
                row(n, f"fused DAPO-KL {tag} dW={acc}: {type(exc).__name__}", float("nan"), None, None)
            free()
        try:
            ms, pk = bench(fused_call(hid, w, b, d, need_w=False, **opt), reps=reps)
            row(n, f"fused DAPO-KL frozen W {tag}", ms, pk, c2)
            ms, pk = bench(prim_call(hid, w, b, ids, gl, **opt), reps=reps)
            row(n, f"primitive logp fwd+bwd {tag} dW=fp32", ms, pk, c3)
        except Exception as exc:  # noqa: BLE001
            row(n, f"frozen/primitive {tag}: {type(exc).__name__}", float("nan"), None, None)
        free()
    ms, pk = bench(fused_call(hid, w, b, d), reps=reps)
    row(n, "fused DAPO-KL defaults", ms, pk, c3)
    cfg = rk.PolicyLossConfig.preset("dapo", kl_coef=KL, kl_estimator="k3")
    coef, plan_ids = plan_coef_fn(d, cfg)
    leaves = [hid.detach().requires_grad_(True), w.detach().requires_grad_(True)]

    def plan_call():
        loss, _ = lf.fused_linear_token_loss(
            leaves[0], leaves[1], None, plan_ids, coef_fn=coef, temperature=T
        )
        return torch.autograd.grad(loss, leaves)

    ms, pk = bench(plan_call, reps=reps)
    row(n, "fused DAPO-KL defaults, token_loss plan coef_fn", ms, pk, c3)
    try:
        leaves = [hid.detach().requires_grad_(True), w.detach().requires_grad_(True)]
        shp = (d["b"], d["t"])

        def public_call():
            out = rk.fused_policy_loss(
                cfg,
                token_ids=d["ids"].clamp(min=0).reshape(shp),
                old_logp=d["old"].reshape(shp),
                advantages=d["adv"].reshape(shp),
                mask=d["mask"].reshape(shp),
                hidden=leaves[0].reshape(*shp, -1),
                weight=leaves[1],
                temperature=T,
                ref_logp=d["ref"].reshape(shp),
            )
            return torch.autograd.grad(out.loss, leaves)

        ms, pk = bench(public_call, reps=reps)
        row(n, "rk.fused_policy_loss(hidden=...) as wired in this build", ms, pk, c3)
    except Exception as exc:  # noqa: BLE001
        print(f"  public fused_policy_loss(hidden=...) not timed: {type(exc).__name__}: {exc}")
    del hid, w, ids, d
    free()
    # N = 65536: defaults only; plain torch is expected to OOM (recorded)
    nl = s["n_large"]
    hid, w, _, ids = inputs(nl, h, v, seed=9, bias=False)
    d = dapo_inputs(nl, ids)
    ms, pk = bench(fused_call(hid, w, None, d), reps=max(3, reps // 4), warmup=1)
    row(nl, "fused DAPO-KL defaults", ms, pk, c3 * nl / n if c3 else None)
    ms, pk = bench(fused_call(hid, w, None, d, need_w=False), reps=max(3, reps // 4), warmup=1)
    row(nl, "fused DAPO-KL frozen W defaults", ms, pk, c2 * nl / n if c2 else None)
    try:
        ms, pk = bench(plain_dapo(hid, w, 0, d), reps=2, warmup=0)
        row(nl, "plain torch DAPO-KL fwd+bwd", ms, pk, c3 * nl / n if c3 else None)
    except torch.OutOfMemoryError:
        row(nl, "plain torch DAPO-KL fwd+bwd: OOM", float("nan"), None, None)


def main():
    argparse.ArgumentParser(description=__doc__).add_argument("--smoke", action="store_true")
    t0 = time.perf_counter()
    print(
        f"torch {torch.__version__}, device {torch.cuda.get_device_name() if DEV.type == 'cuda' else 'cpu'}"
    )
    if SMOKE:
        engine.CHUNK_BYTES = engine.GRAD_BYTES = 16 * sizes()["v"] * 4  # tiny chunks: the defaults pad too
    correctness()
    large()
    invariance()
    determinism()
    timing()
    print("\n==== summary ====")
    for line in RESULTS:
        print(line)
    print(f"\n{'N':>6}  {'what':<62} {'ms':>9} {'peak GB':>8} {'× ceiling':>9}")
    for n, what, ms, peak, frac in ROWS:
        pk = f"{peak:8.2f}" if peak is not None else f"{'-':>8}"
        fr = f"{frac:9.3f}" if frac else f"{'-':>9}"
        print(f"{n:>6}  {what:<62} {ms:9.2f} {pk} {fr}")
    fused = [r for r in ROWS if r[1].startswith("fused DAPO-KL logits=") and r[2] == r[2]]
    if fused:
        best = min(fused, key=lambda r: r[2])
        best32 = min((r for r in fused if "logits=fp32" in r[1]), key=lambda r: r[2], default=None)
        print(f"\nfastest fused config: {best[1]} ({best[2]:.2f} ms, {best[3] or 0:.2f} GB)")
        if best32:
            print(
                f"fastest with fp32 chunk logits: {best32[1]} ({best32[2]:.2f} ms, {best32[3] or 0:.2f} GB)"
            )
        print(f"logp max|Δ| vs fp32 reference by logits/dW mode: {ACC}")
        v = sizes()["v"]
        z32 = torch.float32 if lf._mm_out_dtype_supported(DEV) else torch.bfloat16
        print(
            f"current defaults: logits_dtype={lf.DEFAULT_LOGITS_DTYPE!r}, dweight_accum="
            f"{lf.DEFAULT_DWEIGHT_ACCUM!r}, C={engine.chunk_rows_for(v, z32, torch.bfloat16)}, "
            f"G={engine.grad_rows_for(v, torch.bfloat16)} at V={v}"
        )
        print(
            "recommend: logits_dtype='fp32' unless bf16 logits save > 5 % (their logp error is ~1e-2); "
            "chunk rows = the fastest C whose peak fits the budget; dweight_accum='fp32' unless memory-bound"
        )
    fails = sum(line.startswith("FAIL") for line in RESULTS)
    print(f"\n{len(RESULTS) - fails} passed, {fails} failed ({time.perf_counter() - t0:.0f} s)")
    return 1 if fails else 0  # gpu_run.sh reports the step by this exit status


if __name__ == "__main__":
    sys.exit(main())
