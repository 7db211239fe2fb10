"""GPU check of the fused token-level loss path of ``fused_policy_loss(logits=...)``: correctness,
timings, memory and launch counts, against the composed path and Liger-Kernel.

    PYTHONPATH=src python3 scripts/gpu_check_loss.py           # the check (< 4 minutes on an H100)
    PYTHONPATH=src python3 scripts/gpu_check_loss.py --smoke   # CPU, Triton interpreter, tiny sizes

Sections (each runs on its own; a failure prints FAIL and the traceback's last lines, then goes on):

1. correctness, N = 8192 (B = 8 × T = 1024, ~10 % right padding), V ∈ {151936, 32768}, bf16 logits,
   temperature 0.9: DAPO+KL (k3, 1e-3), PPO, CISPO, SAPO (fused token-level path) and GSPO (not
   eligible: composed path) against the composed path ``policy_loss(token_logprobs(...))``
   (``rlkernel.rl.fused.TOKEN_LEVEL_FUSION = False``): |Δloss|, max |Δgrad| / max |grad|, metrics.
2. timings of DAPO+KL fwd+bwd per call, V ∈ {151936, 32768}: fused vs composed vs Liger
   ``GrpoLossFunction`` (if importable), ``validate`` True/False; "isolated" = CUDA events around
   one call with a sync after it (median of 25), "pipelined" = 20 calls back to back, then one sync.
3. peak extra memory (``max_memory_allocated`` − allocated before the call) of DAPO+KL fwd+bwd with
   ``inplace_backward=True``, in bytes/token, fused vs composed.
4. kernel launches of one DAPO+KL fwd+bwd call (``torch.profiler`` CUDA kernel events), fused vs
   composed, ``validate=False``.
5. "2-pass": the gradient-in-forward path (``rlkernel.rl.fused.GRAD_IN_FORWARD_MAX_VOCAB``, off by
   default) for DAPO+KL at both V: loss/grad vs the 3-pass fused path, and its timings. Turn it on
   for V ≤ 64k if it beats the 3-pass row at V = 32768.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

SMOKE = "--smoke" in sys.argv
if SMOKE:  # must precede the first import of a kernel module
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import rlkernel as rk  # noqa: E402
import rlkernel.rl.fused as fused_mod  # noqa: E402
from rlkernel.bench import logits as bench_logits  # noqa: E402

DEVICE = torch.device("cpu" if SMOKE else "cuda")
B, T = (4, 16) if SMOKE else (8, 1024)
N = B * T
VOCABS = (101, 37) if SMOKE else (151936, 32768)
TEMPERATURE = 0.9
REPS = 1 if SMOKE else 25
PIPE = 1 if SMOKE else 20
CONFIGS = {
    "dapo+kl": ("dapo", dict(kl_coef=1e-3, kl_estimator="k3")),
    "ppo": ("ppo", {}),
    "cispo": ("cispo", {}),
    "sapo": ("sapo", {}),
    "gspo": ("gspo", {}),
}
LOSS_RTOL = 1e-5
GRAD_RTOL = 2**-7  # bf16 gradients from fp32 coefficients that differ in the last bits: ≤ ~1 bf16 ulp
ROWS: list[tuple[str, str, str]] = []
TIMES: list[tuple[str, str, str]] = []


def section(name):
    def wrap(fn):
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # report and go on: the lead needs the whole table
            ROWS.append(("FAIL", name, f"{type(exc).__name__}: {str(exc)[:300]}"))
            print(f"FAIL {name}: {type(exc).__name__}: {exc}")
            print("".join(traceback.format_exc().splitlines(keepends=True)[-6:]))
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]", flush=True)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return fn

    return wrap


def record(status: bool | None, name: str, detail: str) -> None:
    tag = "INFO" if status is None else ("PASS" if status else "FAIL")
    ROWS.append((tag, name, detail))
    print(f"{tag} {name}: {detail}", flush=True)


def make_inputs(vocab: int, seed: int = 0) -> dict:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = (torch.randn(B, T, vocab, device=DEVICE, generator=g, dtype=torch.bfloat16) * 2).requires_grad_(
        True
    )
    ids = torch.randint(0, vocab, (B, T), device=DEVICE, generator=g)
    lengths = torch.randint(int(0.8 * T), T + 1, (B,), device=DEVICE, generator=g)
    mask = torch.arange(T, device=DEVICE)[None, :] < lengths[:, None]
    with torch.no_grad():
        true = rk.token_logprobs(logits, ids, temperature=TEMPERATURE)
    noise = lambda: 0.1 * torch.randn(B, T, device=DEVICE, generator=g)  # noqa: E731
    return dict(
        logits=logits,
        ids=torch.where(mask, ids, -1),  # garbage at masked positions
        mask=mask,
        old_logp=true + noise(),
        ref_logp=true + noise(),
        advantages=torch.randn(B, device=DEVICE, generator=g),
        adv_seq=None,
    )


def run_loss(
    cfg, inp, *, fused: bool, validate: bool = True, inplace: bool = False, logits=None, two_pass=False
):
    fused_mod.TOKEN_LEVEL_FUSION = fused
    fused_mod.GRAD_IN_FORWARD_MAX_VOCAB = 1 << 30 if two_pass else 0
    try:
        return rk.fused_policy_loss(
            cfg,
            logits=inp["logits"] if logits is None else logits,
            token_ids=inp["ids"],
            old_logp=inp["old_logp"],
            advantages=inp["advantages"],
            mask=inp["mask"],
            ref_logp=inp["ref_logp"] if cfg.kl_coef > 0 else None,
            temperature=TEMPERATURE,
            validate=validate,
            inplace_backward=inplace,
        )
    finally:
        fused_mod.TOKEN_LEVEL_FUSION = True
        fused_mod.GRAD_IN_FORWARD_MAX_VOCAB = 0


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def time_call(fn) -> tuple[float, float]:
    """(isolated median ms, pipelined ms per call)."""
    for _ in range(1 if SMOKE else 5):
        fn()
    sync()
    iso = []
    for _ in range(REPS):
        if DEVICE.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            iso.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            iso.append(1e3 * (time.perf_counter() - t0))
    sync()
    t0 = time.perf_counter()
    for _ in range(PIPE):
        fn()
    sync()
    return statistics.median(iso), 1e3 * (time.perf_counter() - t0) / PIPE


# ------------------------------------------------------------------------------------ 1. correctness
def check_correctness(vocab: int) -> None:
    inp = make_inputs(vocab, seed=vocab % 97)
    for label, (preset, over) in CONFIGS.items():
        name = f"correct {label} V={vocab}"
        try:
            cfg = rk.PolicyLossConfig.preset(preset, **over)
            got = run_loss(cfg, inp, fused=True)
            (g_got,) = torch.autograd.grad(got.loss, inp["logits"])
            want = run_loss(cfg, inp, fused=False)
            (g_want,) = torch.autograd.grad(want.loss, inp["logits"])
            dloss = (got.loss - want.loss).abs().item()
            scale = g_want.abs().max().float().item()
            dgrad = (g_got.float() - g_want.float()).abs().max().item() / max(scale, 1e-30)
            metric_diff = max(
                ((got.metrics[k] - want.metrics[k]).abs().item() for k in want.metrics), default=0.0
            )
            same_keys = got.metrics.keys() == want.metrics.keys()
            ok = (
                dloss <= LOSS_RTOL * max(abs(want.loss.item()), 1e-3)
                and dgrad <= GRAD_RTOL
                and same_keys
                and metric_diff <= 1e-4
                and bool(torch.isfinite(got.loss))
            )
            path = "fused" if rk.rl.token_loss.is_eligible(cfg) else "composed (not eligible)"
            record(
                ok,
                name,
                f"{path}: loss {got.loss.item():.6g} |Δloss| {dloss:.2e}, max|Δgrad|/max|grad| {dgrad:.2e}, "
                f"max|Δmetric| {metric_diff:.2e}",
            )
            del got, want, g_got, g_want
        except Exception as exc:
            record(False, name, f"{type(exc).__name__}: {str(exc)[:200]}")
            print("".join(traceback.format_exc().splitlines(keepends=True)[-6:]))
    # validate=False with an out-of-range active id: NaN, not a number read out of bounds.
    cfg = rk.PolicyLossConfig.preset("dapo", kl_coef=1e-3)
    bad = dict(inp, ids=inp["ids"].clone())
    bad["ids"][0, 0] = vocab + 12345  # position (0, 0) is active (lengths ≥ 0.8 T)
    loss = run_loss(cfg, bad, fused=True, validate=False).loss
    record(bool(torch.isnan(loss)), f"oob id -> NaN V={vocab}", f"loss {loss.item()}")


# -------------------------------------------------------------------------------------- 2. timings
def liger_call(vocab_inp):
    mod, why = bench_logits._liger_module()
    if mod is None:
        return None, why
    cfg, spec = bench_logits.resolve_loss("dapo")
    kwargs = bench_logits.liger_loss_kwargs(spec)
    kwargs["temperature"] = TEMPERATURE
    ext = bench_logits._liger_logits(vocab_inp["logits"].detach(), B, T, 7).requires_grad_(True)
    args = bench_logits.liger_grpo_args(
        mod.GrpoLossFunction,
        logits=ext,
        old_logp=vocab_inp["old_logp"],
        ref_logp=vocab_inp["ref_logp"],
        completion_ids=torch.where(vocab_inp["mask"], vocab_inp["ids"], 0),
        advantages=vocab_inp["advantages"],
        completion_mask=vocab_inp["mask"].to(torch.int32),
        **kwargs,
    )

    def call():
        loss = mod.GrpoLossFunction.apply(*args)[0]
        torch.autograd.grad(loss, (ext,))

    return call, ""


def time_dapo(vocab: int) -> None:
    inp = make_inputs(vocab, seed=1)
    cfg = rk.PolicyLossConfig.preset("dapo", kl_coef=1e-3, kl_estimator="k3")
    for fused in (True, False):
        for validate in (False, True):
            label = f"rlkernel {'fused' if fused else 'composed'} validate={validate}"

            def call(fused=fused, validate=validate):
                out = run_loss(cfg, inp, fused=fused, validate=validate)
                torch.autograd.grad(out.loss, (inp["logits"],))

            iso, pipe = time_call(call)
            TIMES.append((f"V={vocab}", label, f"{iso:8.3f} ms isolated | {pipe:8.3f} ms pipelined"))
            print(TIMES[-1], flush=True)
    try:
        call, why = liger_call(inp)
        if call is None:
            TIMES.append((f"V={vocab}", "liger GrpoLossFunction", f"skipped: {why}"))
        else:
            iso, pipe = time_call(call)
            TIMES.append(
                (
                    f"V={vocab}",
                    "liger GrpoLossFunction dapo",
                    f"{iso:8.3f} ms isolated | {pipe:8.3f} ms pipelined",
                )
            )
    except Exception as exc:
        TIMES.append(
            (f"V={vocab}", "liger GrpoLossFunction", f"error: {type(exc).__name__}: {str(exc)[:150]}")
        )
    print(TIMES[-1], flush=True)


# ------------------------------------------------------------------------------------ 3. memory
def memory(vocab: int) -> None:
    cfg = rk.PolicyLossConfig.preset("dapo", kl_coef=1e-3, kl_estimator="k3")
    for fused in (True, False):
        inp = make_inputs(vocab, seed=2)
        leaf = inp["logits"].detach().requires_grad_(True)
        if DEVICE.type != "cuda":
            record(None, f"memory fused={fused}", "skipped on CPU")
            return
        run_loss(cfg, inp, fused=fused, inplace=False, logits=leaf.detach().clone().requires_grad_(True))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = run_loss(cfg, inp, fused=fused, validate=False, inplace=True, logits=leaf)
        out.loss.backward()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
        record(
            (extra / N <= 64) if fused else None,
            f"peak extra memory inplace fused={fused} V={vocab}",
            f"{extra / N:.1f} B/token ({extra / 2**20:.2f} MiB)",
        )
        del out, leaf, inp


# ------------------------------------------------------------------------------------ 4. launches
def launches(vocab: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    inp = make_inputs(vocab, seed=3)
    cfg = rk.PolicyLossConfig.preset("dapo", kl_coef=1e-3, kl_estimator="k3")
    for fused in (True, False):

        def call(fused=fused):
            out = run_loss(cfg, inp, fused=fused, validate=False)
            torch.autograd.grad(out.loss, (inp["logits"],))

        call()
        sync()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE.type == "cuda" else [])
        with profile(activities=acts) as prof:
            call()
            sync()
        events = prof.events()
        if DEVICE.type == "cuda":
            n = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
            what = "CUDA kernels (incl. memcpy/memset)"
        else:
            n = sum(1 for e in events if e.name.startswith("aten::"))
            what = "aten ops (CPU profile, nested included)"
        record(None, f"launches DAPO+KL fwd+bwd fused={fused}", f"{n} {what}")


# ------------------------------------------------------------------------------------ 5. 2-pass
def two_pass(vocab: int) -> None:
    inp = make_inputs(vocab, seed=4)
    cfg = rk.PolicyLossConfig.preset("dapo", kl_coef=1e-3, kl_estimator="k3")
    got = run_loss(cfg, inp, fused=True, two_pass=True)
    (g_got,) = torch.autograd.grad(got.loss, inp["logits"])
    want = run_loss(cfg, inp, fused=True)
    (g_want,) = torch.autograd.grad(want.loss, inp["logits"])
    dloss = (got.loss - want.loss).abs().item()
    dgrad = (g_got.float() - g_want.float()).abs().max().item() / max(
        g_want.abs().max().float().item(), 1e-30
    )
    ok = dloss <= LOSS_RTOL * max(abs(want.loss.item()), 1e-3) and dgrad <= GRAD_RTOL
    record(ok, f"2-pass vs 3-pass V={vocab}", f"|Δloss| {dloss:.2e}, max|Δgrad|/max|grad| {dgrad:.2e}")
    del got, want, g_got, g_want

    def call():
        out = run_loss(cfg, inp, fused=True, validate=False, two_pass=True)
        torch.autograd.grad(out.loss, (inp["logits"],))

    iso, pipe = time_call(call)
    TIMES.append(
        (f"V={vocab}", "rlkernel 2-pass validate=False", f"{iso:8.3f} ms isolated | {pipe:8.3f} ms pipelined")
    )
    print(TIMES[-1], flush=True)


def main() -> int:
    argparse.ArgumentParser(description=__doc__).add_argument("--smoke", action="store_true")
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check_loss: no CUDA device (use --smoke on CPU)")
        return 2
    import triton

    dev = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "CPU (interpreter, smoke)"
    print(f"{dev} | torch {torch.__version__} | triton {triton.__version__} | N={N}")
    t0 = time.perf_counter()
    with rk.use_backend("triton"):
        for vocab in VOCABS:
            section(f"correctness V={vocab}")(lambda v=vocab: check_correctness(v))
        for vocab in VOCABS:
            section(f"timing V={vocab}")(lambda v=vocab: time_dapo(v))
        section("memory")(lambda: memory(VOCABS[0]))
        section("launches")(lambda: launches(VOCABS[1]))
        for vocab in VOCABS:
            section(f"2-pass V={vocab}")(lambda v=vocab: two_pass(v))
    print("\n" + "=" * 110)
    for status, name, detail in ROWS:
        print(f"{status:4s} | {name:44s} | {detail}")
    print("-" * 110)
    for where, label, detail in TIMES:
        print(f"{where:9s} | {label:38s} | {detail}")
    print("=" * 110)
    failed = sum(1 for r in ROWS if r[0] == "FAIL")
    print(f"{failed} FAIL of {len(ROWS)} rows; total {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
