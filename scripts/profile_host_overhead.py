"""Host time per call of the invariant ops and of a patched model's decode step (the model-level gap).

    PYTHONPATH=src python3 scripts/profile_host_overhead.py [--config anchor] [--smoke]

A decode step of the anchor model is host bound (``scripts/profile_invariant_model.py``): its GPU
time is ~1.6 ms, its wall time ~11-13 ms. So what a patched op costs there is its Python and launch
time, which this script measures layer by layer:

1. Per op, host microseconds per call: ``n`` calls in a loop without synchronization on tiny
   operands (GPU time per call below the host time), wall time of the loop before the final sync,
   divided by ``n``. For ``linear``, ``rms_norm`` and the attention adapter: the HF/PyTorch call the
   unpatched model makes, the public rlkernel op, the kernel module's launcher, and the bare Triton
   launch; each with the fast launcher (``rlkernel.kernels._launch``) on and off.
2. The anchor model: wall time (synchronized) and host CPU time (thread time) per decode step
   (B = 32 against 512 cached tokens), per prefill (B = 8 × 512), and for the consistency command's
   masked inputs (a left-padded decode run of 8 steps, a right-padded prefill): unpatched, patched
   with the fast launcher, patched with Triton's own launch; all interleaved in rotated rounds.
3. cProfile of patched decode steps: the functions with the most own time.

Ends with one table.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

if "--smoke" in sys.argv:  # before the kernel modules import Triton: the op section runs interpreted
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["RLKERNEL_BACKEND"] = "triton"

import torch  # noqa: E402

import rlkernel as rk  # noqa: E402
from rlkernel.invariant.hf_attention import hf_attention_forward
from rlkernel.invariant.matmul import linear
from rlkernel.invariant.patch import patch_hf_model
from rlkernel.invariant.rmsnorm import rms_norm
from rlkernel.invariant.scoring import build_model
from rlkernel.kernels import attention as ka
from rlkernel.kernels import matmul as km
from rlkernel.kernels import matmul_table as mt
from rlkernel.kernels import rmsnorm as kr

ROWS: list[tuple[str, str, float]] = []  # (group, variant, value)


def host_us(fn, n: int, sync) -> float:
    """Host microseconds per call of ``fn`` (loop without syncs; the GPU keeps up on tiny calls)."""
    for _ in range(10):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    sync()
    return (t1 - t0) / n * 1e6


def record(group: str, variant: str, value: float, unit: str = "us") -> None:
    ROWS.append((group, variant, value))
    print(f"{group:28s} {variant:44s} {value:9.2f} {unit}", flush=True)


def with_fast(on: bool, fn):
    def call():
        with rk.use_options(fast_launch=on):
            return fn()

    return call


def op_section(dev, dtype, n, sync) -> None:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, generator=gen).to(dtype)

    # Sizes: a decode step of the anchor model (B = 32; the interpreter gets tiny ones).
    B, H, D, TK, HQ, HKV = (32, 1024, 128, 512, 16, 8) if dev.type == "cuda" else (2, 32, 16, 8, 4, 2)

    # ---- linear: decode-sized GEMM (M = B rows, H -> H)
    x, w = rnd(B, H), rnd(H, H) * 0.03
    out = torch.empty(B, H, device=dev, dtype=dtype)
    wt = w.t()
    cfg = mt.config_for(B, H, H, dtype, mt.table_for(dev, "tuned"))
    args = (out, *out.stride(), x, *x.stride(), wt, *wt.stride(), out, B, H, H)
    constexprs = {
        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m,
        "NUM_STAGES": cfg.num_stages, "EVEN_K": True, "HAS_BIAS": False, "INPUT_PRECISION": "tf32",
        "HINT_M": False, "HINT_N": False, "INTERPRETED": dev.type == "cpu",
    }  # fmt: skip
    grid = (km._cdiv(B, cfg.block_m) * km._cdiv(H, cfg.block_n),)
    g = f"linear [{B},{H}]x[{H},{H}]"
    with torch.no_grad():
        record(g, "torch F.linear (cuBLAS)", host_us(lambda: torch.nn.functional.linear(x, w), n, sync))
        for on in (True, False):
            tag = "fast" if on else "triton launch"
            record(g, f"rk linear (public), {tag}", host_us(with_fast(on, lambda: linear(x, w)), n, sync))
            record(g, f"km.matmul (alloc), {tag}", host_us(with_fast(on, lambda: km.matmul(x, wt)), n, sync))
            record(
                g,
                f"km._matmul (out=), {tag}",
                host_us(with_fast(on, lambda: km._matmul(x, wt, out)), n, sync),
            )
        launcher = km._launch_pointer
        record(
            g,
            "FastLauncher call only",
            host_us(lambda: launcher(grid, args, constexprs, {"num_warps": cfg.num_warps}), n, sync),
        )
        record(
            g,
            "bare kernel[grid](...)",
            host_us(lambda: km._matmul_kernel[grid](*args, **constexprs, num_warps=cfg.num_warps), n, sync),
        )
        record(
            g,
            "config_for + table_for",
            host_us(lambda: mt.config_for(B, H, H, dtype, mt.table_for(dev, "tuned")), n, lambda: None),
        )
        record(
            g,
            f"torch.empty [{B},{H}]",
            host_us(lambda: torch.empty(B, H, device=dev, dtype=dtype), n, sync),
        )

    # ---- RMSNorm: hidden [B, 1, H] and QK-norm [B, 1, HQ, D]
    for label, shape, h in (
        (f"rms_norm hidden [{B},1,{H}]", (B, 1, H), H),
        (f"rms_norm qk [{B},1,{HQ},{D}]", (B, 1, HQ, D), D),
    ):
        xr = rnd(*shape)
        hf = Qwen3RMSNorm(h, eps=1e-6).to(dev, dtype)
        with torch.no_grad():
            hf.weight.copy_(rnd(h) * 0.1 + 1)
            wr = hf.weight
            record(label, "HF Qwen3RMSNorm (unpatched)", host_us(lambda hf=hf, xr=xr: hf(xr), n, sync))
            for on in (True, False):
                tag = "fast" if on else "triton launch"
                record(
                    label,
                    f"rk rms_norm (public), {tag}",
                    host_us(with_fast(on, lambda xr=xr, wr=wr: rms_norm(xr, wr, 1e-6)), n, sync),
                )
                x2 = xr.reshape(-1, h)
                record(
                    label,
                    f"kr.rms_norm_fwd, {tag}",
                    host_us(with_fast(on, lambda x2=x2, wr=wr: kr.rms_norm_fwd(x2, wr, 1e-6)), n, sync),
                )

    # ---- attention: one decode step against TK keys (HF layout [B, heads, T, D])
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class _Module(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 2

    mod = _Module()
    q, k, v = rnd(B, HQ, 1, D), rnd(B, HKV, TK, D), rnd(B, HKV, TK, D)
    key_start = torch.zeros(B, dtype=torch.int32, device=dev)
    g = f"attention decode B={B} Tk={TK}"
    with torch.no_grad():
        record(
            g,
            "HF sdpa_attention_forward",
            host_us(lambda: sdpa_attention_forward(mod, q, k, v, None), n, sync),
        )
        for on in (True, False):
            tag = "fast" if on else "triton launch"
            record(
                g,
                f"rk hf_attention_forward, {tag}",
                host_us(with_fast(on, lambda: hf_attention_forward(mod, q, k, v, None)), n, sync),
            )
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            record(
                g,
                f"ka.attention_fwd, {tag}",
                host_us(
                    with_fast(
                        on,
                        lambda qt=qt, kt=kt, vt=vt: ka.attention_fwd(
                            qt, kt, vt, scale=D**-0.5, key_start=key_start
                        ),
                    ),
                    n,
                    sync,
                ),
            )


def interleaved(calls: dict[tuple[str, str], object], rounds: int, sync) -> None:
    """Time every call in ``rounds`` rounds, the order rotated each round (host drift hits all
    alike); record the median wall ms (synchronized) and the median host CPU ms (thread time:
    what the Python side costs, whatever the GPU does) of each."""
    names = list(calls)
    wall: dict = {k: [] for k in names}
    cpu: dict = {k: [] for k in names}
    for fn in calls.values():  # warm-up: compiles, caches
        fn()
    for r in range(rounds):
        shift = r % len(names)
        for key in names[shift:] + names[:shift]:
            sync()
            t0, c0 = time.perf_counter(), time.thread_time()
            calls[key]()
            c1 = time.thread_time()
            sync()
            wall[key].append((time.perf_counter() - t0) * 1e3)
            cpu[key].append((c1 - c0) * 1e3)
    for group, variant in names:
        record(group, f"{variant} wall", statistics.median(wall[(group, variant)]), "ms")
        record(group, f"{variant} host CPU", statistics.median(cpu[(group, variant)]), "ms")


def model_section(dev, dtype, config, reps, sync, smoke) -> None:
    from transformers import DynamicCache

    from rlkernel.invariant.scoring import _decode_timer, _prefill_timer, make_prompts

    base = build_model(config, device=dev, dtype=dtype, seed=0)
    patched = patch_hf_model(copy.deepcopy(base))
    b, t, bd = (2, 16, 2) if smoke else (8, 512, 32)
    gen = torch.Generator(device=dev).manual_seed(0)
    vocab = base.config.vocab_size
    ids = torch.randint(1, vocab, (b, t), device=dev, generator=gen)
    dec_ids = torch.randint(1, vocab, (bd, t), device=dev, generator=gen)
    tok = torch.randint(1, vocab, (bd, 1), device=dev, generator=gen)
    pos = torch.full((bd, 1), t, device=dev, dtype=torch.long)
    # The consistency command's inputs: padded batches WITH an attention mask (left-padded decode
    # against a primed cache, 8 steps; right-padded prefill of prompt + completion).
    n_seq, plen, glen = (2, 8, 4) if smoke else (32, 16, 128)
    prompts = make_prompts(n_seq, plen, vocab, seed=0)
    completions = torch.randint(1, vocab, (n_seq, glen), generator=torch.Generator().manual_seed(1))
    calls, steps = {}, {}
    for name, model in (("unpatched", base), ("patched", patched)):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=dec_ids, past_key_values=cache, use_cache=True)

        def decode(model=model, cache=cache):
            with torch.no_grad():
                model(input_ids=tok, position_ids=pos, past_key_values=cache, use_cache=True)
            cache.crop(-1)

        def prefill(model=model):
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)

        masked_prefill = _prefill_timer(model, prompts, completions, n_seq)
        masked_decode = _decode_timer(model, prompts, completions, n_seq, steps=8)

        def masked_decode_nograd(run=masked_decode):
            with torch.no_grad():
                return run()

        def masked_prefill_nograd(run=masked_prefill):
            with torch.no_grad():
                return run()

        steps[name] = (decode, masked_decode_nograd)
        variants = (
            [(name, None)] if name == "unpatched" else [(f"{name} fast", True), (f"{name} triton", False)]
        )
        for tag, on in variants:
            for label, fn in (
                (f"decode B={bd} cache={t}", decode),
                (f"prefill B={b} T={t}", prefill),
                (f"masked prime+8 steps B={n_seq}", masked_decode_nograd),
                (f"masked prefill B={n_seq}", masked_prefill_nograd),
            ):
                calls[(f"model {config} {label}", tag)] = fn if on is None else with_fast(on, fn)
    interleaved(calls, reps, sync)
    # Where the patched decode step's host time goes (fast launcher on): no mask, then masked.
    for label, fn, n in (
        ("decode steps", steps["patched"][0], reps),
        ("masked decode runs (prime + 8 steps)", steps["patched"][1], 2),
    ):
        prof = cProfile.Profile()
        fn()
        prof.enable()
        for _ in range(n):
            fn()
        prof.disable()
        sync()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        print(f"\n== cProfile: {n} patched {label}, by own time\n{buf.getvalue()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="anchor")
    parser.add_argument("--smoke", action="store_true", help="tiny config on CPU (pipeline check only)")
    parser.add_argument("--models-only", action="store_true", help="skip the per-op section")
    args = parser.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    dev = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    n, reps = (3, 2) if smoke else (500, 20)
    if not args.models_only:
        op_section(dev, dtype, n, sync)
    model_section(dev, dtype, "tiny" if smoke else args.config, reps, sync, smoke)
    print("\n=== host overhead (us per call; model rows: ms per call, wall)")
    for group, variant, value in ROWS:
        print(f"{group:32s} {variant:40s} {value:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
