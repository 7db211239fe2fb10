"""Where the fused LM head's time and memory go, kernel by kernel, on a CUDA machine.

    PYTHONPATH=src python3 scripts/profile_linear_head.py [--n 8192 65536] [--variants default single]

The bench's ragged inputs (``rlkernel.bench`` linear: hidden ``base[:, 127:-1]``, lengths U[T/4, T],
H = 4096, V = 151,936, bf16). For each workload (DAPO+KL trainable, frozen; the primitive log-probs
+ entropy) and engine variant (``--variants``: chunk/group sizes, logits dtype, dweight
accumulation, passed to the engine directly):

* the fwd+bwd time (CUDA events, median of ``--reps``) and the peak memory above the inputs;
* one call under ``torch.profiler``: GPU time per kernel class (GEMMs, the log-softmax forward and
  backward kernels, the token-loss kernel, copies/fills/casts, the rest), the GPU busy time and the
  wall time of the call;

and, as the floors, each GEMM shape the engine runs (cuBLAS, bf16 or fp32 output, ``addmm`` into
an fp32 accumulator) and the elementwise passes (fp32 → bf16 cast of dweight, the log-softmax
kernels over one chunk) timed alone. Prints compact tables; ``--json`` writes them too.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import torch

import rlkernel as rk
from rlkernel.bench._linear_inputs import KINDS, geometry, hidden, make_inputs
from rlkernel.bench._logits_baselines import TEMPERATURE, loss_config
from rlkernel.kernels import logprobs as lk
from rlkernel.ops._linear_function import fused_linear_token_loss, linear_token_logprobs_triton
from rlkernel.rl import token_loss as tl

DEV = torch.device("cuda")
H, V = 4096, 151936

# name -> engine keywords (None: the defaults)
VARIANTS = {
    "default": {},
    "grouped": {"whole_batch": False},  # the grouped loop: fp32 dweight accumulator + final cast
    "c1024": {"chunk_rows": 1024},
    "bf16_logits": {"logits_dtype": "input"},
    "cublas": {"options": {"linear_head_gemm": "cublas"}},  # cuBLAS chunks + log-softmax kernels
    # Smaller chunks/groups (the epilogue kernel is row invariant at any M: no logp bit changes).
    "c1024_g2048": {"chunk_rows": 1024, "grad_rows": 2048},
    "c1024_g1024": {"chunk_rows": 1024, "grad_rows": 1024},
    "c512_g512": {"chunk_rows": 512, "grad_rows": 512},
}


def _cfg():
    return loss_config("dapo")


def _time(fn, reps):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def _classify(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "xmma", "matmul")):
        return "gemm"
    if "fwd" in n and ("logprob" in n or "lse" in n):
        return "lsm_fwd"
    if "bwd" in n and ("logprob" in n or "grad" in n):
        return "lsm_bwd"
    if "token_loss" in n or "coef" in n:
        return "token_loss"
    if any(k in n for k in ("copy", "cast", "fill", "zero", "memset", "memcpy")):
        return "copy/fill"
    if any(k in n for k in ("index", "scatter", "gather", "nonzero", "masked")):
        return "index"
    return "other"


def _profile(fn):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
    wall = a.elapsed_time(b)
    by_cls: dict[str, float] = defaultdict(float)
    by_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()
        by_cls[_classify(e.name)] += us / 1e3
        by_name[e.name][0] += 1
        by_name[e.name][1] += us / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]
    top = [(k[:90], c, round(t, 3)) for k, (c, t) in top]
    return wall, dict(by_cls), top, _gaps(prof)


def _gaps(prof, min_us: float = 30.0):
    """GPU idle gaps inside the call (between consecutive kernels, > ``min_us``) with the kernels
    around them, and the host's blocking CUDA runtime calls (syncs, copies, mallocs)."""
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    gaps = []
    for a, b in zip(kernels, kernels[1:], strict=False):
        gap = b.time_range.start - a.time_range.end
        if gap > min_us:
            gaps.append((round(gap / 1e3, 3), a.name[:50], b.name[:50]))
    blocking: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and any(
            k in e.name for k in ("Synchronize", "Memcpy", "Malloc", "Free", "nonzero", "item")
        ):
            blocking[e.name][0] += 1
            blocking[e.name][1] += e.time_range.elapsed_us() / 1e3
    return {
        "idle_ms": round(sum(g[0] for g in gaps), 3),
        "top_gaps": sorted(gaps, reverse=True)[:8],
        "blocking": {k: (c, round(t, 3)) for k, (c, t) in blocking.items()},
    }


def _workload(kind_name: str, n: int, variant: dict, seed: int = 1):
    variant = dict(variant)
    options = variant.pop("options", {})
    step, scored = _workload_step(kind_name, n, variant, seed)

    def with_options():
        with rk.use_options(**options):
            return step()

    return with_options, scored


def _workload_step(kind_name: str, n: int, variant: dict, seed: int):
    kind = KINDS[kind_name]
    inp = make_inputs(kind, geometry(n, False), H, V, DEV, seed=seed)
    inp["base"].requires_grad_(True)
    inp["weight"].requires_grad_(not kind.frozen_weight)
    leaves = [inp["base"]] + ([inp["weight"]] if not kind.frozen_weight else [])
    if kind.loss:
        plan = tl.build_plan(
            _cfg(), token_ids=inp["ids"], old_logp=inp["old_logp"], advantages=inp["advantages"],
            mask=inp["mask"], ref_logp=inp["ref_logp"],
        )  # fmt: skip
        coef = tl.as_coef_fn(plan)

        def step():
            loss, _ = fused_linear_token_loss(
                hidden(inp), inp["weight"], None, plan.ids, coef_fn=coef, temperature=TEMPERATURE, **variant
            )
            return torch.autograd.grad(loss, leaves)

    else:
        go = inp["grad_out"]

        def step():
            lp, en = linear_token_logprobs_triton(
                hidden(inp), inp["weight"], inp["ids_ignore"], temperature=TEMPERATURE,
                return_entropy=True, **variant,
            )  # fmt: skip
            return torch.autograd.grad((lp, en), leaves, (go[0], go[1]))

    return step, int(inp["mask"].sum())


def _peak(fn):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 1e9


def _floors_at(c: int, w: torch.Tensor, g: torch.Generator, reps: int) -> dict[str, float]:
    """The engine's per-chunk and per-group passes at M (resp. K) = c rows, each alone."""
    rows = {}
    hc = torch.randn(c, H, device=DEV, dtype=torch.bfloat16, generator=g)
    z16 = torch.empty(c, V, device=DEV, dtype=torch.bfloat16)
    z32 = torch.empty(c, V, device=DEV, dtype=torch.float32)
    rows[f"logits M={c} bf16 out"] = _time(lambda: torch.mm(hc, w.t(), out=z16), reps)
    rows[f"logits M={c} fp32 out"] = _time(
        lambda: torch.mm(hc, w.t(), out_dtype=torch.float32, out=z32), reps
    )
    ids = torch.randint(0, V, (c,), device=DEV, generator=g)
    lp, ls, en = (torch.empty(c, device=DEV) for _ in range(3))
    gl, ge = torch.randn(c, device=DEV), torch.randn(c, device=DEV)
    kw = {"temperature": 1.0, "ignore_index": -100}
    rows[f"lsm fwd M={c} fp32"] = _time(lambda: lk.token_logprobs_fwd_into(z32, ids, lp, en, ls, **kw), reps)
    rows[f"lsm bwd M={c} fp32->bf16"] = _time(
        lambda: lk.token_logprobs_bwd_into(z32, ids, ls, en, gl, ge, z16, **kw), reps
    )
    z16.normal_()
    rows[f"lsm fwd M={c} bf16"] = _time(lambda: lk.token_logprobs_fwd_into(z16, ids, lp, en, ls, **kw), reps)
    rows[f"lsm bwd M={c} bf16 in place"] = _time(
        lambda: lk.token_logprobs_bwd_into(z16, ids, ls, en, gl, ge, z16, **kw), reps
    )
    if c == 2048:
        from rlkernel.kernels import matmul as mk

        rows["invariant triton logits M=2048 bf16 out"] = _time(lambda: mk.matmul_into(hc, w.t(), z16), reps)
    gch = z16
    acc = torch.mm(gch.t(), hc, out_dtype=torch.float32)
    rows[f"dW K={c} fp32 first (mm)"] = _time(
        lambda: torch.mm(gch.t(), hc, out_dtype=torch.float32, out=acc), reps
    )
    rows[f"dW K={c} fp32 addmm (RMW)"] = _time(
        lambda: torch.addmm(acc, gch.t(), hc, out_dtype=torch.float32, out=acc), reps
    )
    rows[f"dW K={c} bf16 out"] = _time(lambda: gch.t() @ hc, reps)
    rows[f"dh M={c}"] = _time(lambda: gch @ w, reps)
    return rows


def _floors(a_rows: int, reps: int) -> dict[str, float]:
    """Each GEMM / elementwise pass alone, ms: at the scored rows A, and per chunk/group size."""
    g = torch.Generator(device=DEV).manual_seed(0)
    w = torch.randn(V, H, device=DEV, dtype=torch.bfloat16, generator=g) * 0.03
    a = torch.randn(a_rows, H, device=DEV, dtype=torch.bfloat16, generator=g)
    gz = torch.randn(a_rows, V, device=DEV, dtype=torch.bfloat16, generator=g)
    rows = {
        "logits A rows bf16 out": _time(lambda: a @ w.t(), reps),
        "dh A rows (gz@W)": _time(lambda: gz @ w, reps),
        "dW K=A bf16 out": _time(lambda: gz.t() @ a, reps),
        "dW K=A fp32 out": _time(lambda: torch.mm(gz.t(), a, out_dtype=torch.float32), reps),
    }
    gz = None  # freed before the per-size passes
    for c in (1024, 2048, 4096):
        rows.update(_floors_at(c, w, g, reps))
    acc = torch.randn(V, H, device=DEV)
    out = torch.empty(V, H, device=DEV, dtype=torch.bfloat16)
    rows["cast dW fp32->bf16"] = _time(lambda: out.copy_(acc), reps)
    return {k: round(v, 3) for k, v in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[8192])
    ap.add_argument("--kinds", nargs="+", default=["ragged_dapo_kl_fwd_bwd", "ragged_dapo_kl_frozen_fwd_bwd",
                                                      "ragged_logprobs_entropy_fwd_bwd"])  # fmt: skip
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--floors", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    results = {"runs": [], "floors": None}
    for n in args.n:
        for kind in args.kinds:
            for vname in args.variants:
                step, scored = _workload(kind, n, VARIANTS[vname])
                try:
                    ms = _time(step, args.reps)
                    peak = _peak(step)
                    wall, cls, top, gaps = _profile(step)
                except torch.OutOfMemoryError:
                    print(f"{kind} n={n} {vname}: OOM", flush=True)
                    continue
                busy = sum(cls.values())
                row = {"kind": kind, "n": n, "scored": scored, "variant": vname, "ms": round(ms, 2),
                       "peak_gb": round(peak, 2), "prof_wall_ms": round(wall, 2),
                       "gpu_busy_ms": round(busy, 2), "top": top, "gaps": gaps,
                       "classes": {k: round(v, 2) for k, v in sorted(cls.items())}}  # fmt: skip
                results["runs"].append(row)
                parts = "  ".join(f"{k} {v:.2f}" for k, v in sorted(cls.items()))
                print(f"{kind:34s} n={n:6d} ({scored}) {vname:13s} {ms:8.2f} ms  peak {peak:5.2f} GB  "
                      f"busy {busy:7.2f}  {parts}", flush=True)  # fmt: skip
                del step
                torch.cuda.empty_cache()
        if args.floors:
            scored = results["runs"][-1]["scored"] if results["runs"] else n
            results["floors"] = _floors(scored, args.reps)
            for k, v in results["floors"].items():
                print(f"  floor {k:40s} {v:8.3f} ms", flush=True)
    for r in results["runs"]:
        g = r["gaps"]
        print(f"{r['kind']} n={r['n']} {r['variant']}: idle {g['idle_ms']} ms; blocking {g['blocking']}")
        for t in g["top_gaps"][:4]:
            print("    gap", t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
