"""Where the batch-invariant chain's time goes: host time per call of each op, and the patched model
next to the unpatched one. On a CUDA machine (``--smoke``: tiny, on the CPU, checks the script only).
With PYTHONPATH=src or the package installed:

    python3 scripts/profile_invariant.py [--config anchor] [--sections ops models kernels]

A decode step of the anchor model is host bound (its GPU time ~1.6 ms, its wall time ~11-13 ms on
the H100 host of 2026-11-21), so what a patched op costs there is its Python and launch time:

    ops      host µs per call (``bench.timing.host_loop_us``: calls in a loop without a sync on the
             operands of an anchor decode step, B = 32): for linear, rms_norm (hidden and QK-norm)
             and the attention adapter, the HF / PyTorch call the unpatched model makes, the public
             rlkernel op, and the kernel module's function, each with the fast launcher on and off
             (option ``fast_launch``).
    models   the anchor model unpatched, patched with the fast launcher, patched with Triton's own
             launch: wall, host and host-CPU ms per call (``bench.timing.host_times_interleaved``,
             rotated rounds) of a decode step (B = 32 against 512 cached tokens), a prefill
             (B = 8 × 512) and the consistency command's masked inputs (a left-padded prime + 8
             decode steps, a right-padded prefill); then cProfile of patched decode steps.
    kernels  per model, prefill and decode step under ``torch.profiler``: wall ms, GPU kernel ms,
             the host gap (wall − GPU), launches, the top kernels. A patched model slower than the
             unpatched one by more than its GPU-time difference is host bound.

Ends with one table.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

if __name__ == "__main__" and "--smoke" in sys.argv:  # before a kernel module imports Triton
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import rlkernel as rk  # noqa: E402
from rlkernel.bench import profiling, timing  # noqa: E402
from rlkernel.invariant.hf_attention import hf_attention_forward  # noqa: E402
from rlkernel.invariant.matmul import linear  # noqa: E402
from rlkernel.invariant.patch import patch_hf_model  # noqa: E402
from rlkernel.invariant.rmsnorm import rms_norm  # noqa: E402
from rlkernel.invariant.scoring import build_model, make_prompts  # noqa: E402
from rlkernel.kernels import attention as ka  # noqa: E402
from rlkernel.kernels import matmul as km  # noqa: E402
from rlkernel.kernels import rmsnorm as kr  # noqa: E402

SECTIONS = ("ops", "models", "kernels")


class Table:
    """The rows printed as they come and again at the end: (group, variant, value, unit)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, float, str]] = []

    def add(self, group: str, variant: str, value: float, unit: str) -> None:
        self.rows.append((group, variant, value, unit))
        print(f"{group:36s}  {variant:48s} {value:10.2f} {unit}", flush=True)

    def print(self) -> None:
        print("\n=== host overhead and model times")
        for group, variant, value, unit in self.rows:
            print(f"{group:36s}  {variant:48s} {value:10.2f} {unit}")


def with_fast(on: bool | None, fn):
    if on is None:
        return fn

    def call():
        with rk.use_options(fast_launch=on):
            return fn()

    return call


def op_section(dev, dtype, calls: int, loops: int, warmup: int, table: Table) -> None:
    """Host µs per call of each op on a decode step's operands (tiny ones on the CPU)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device=dev, generator=gen).to(dtype)

    def us(fn) -> float:
        return timing.host_loop_us(fn, dev, calls=calls, loops=loops, warmup=warmup)

    b, h, d, tk, hq, hkv = (32, 1024, 128, 512, 16, 8) if dev.type == "cuda" else (2, 32, 16, 8, 4, 2)
    fast = ((True, "fast launch"), (False, "triton launch"))
    x, w = rnd(b, h), rnd(h, h) * 0.03
    group = f"linear [{b},{h}]x[{h},{h}]"
    table.add(group, "torch F.linear (cuBLAS)", us(lambda: torch.nn.functional.linear(x, w)), "us")
    for on, tag in fast:
        table.add(group, f"rk linear (public), {tag}", us(with_fast(on, lambda: linear(x, w))), "us")
        table.add(group, f"kernels.matmul.matmul, {tag}", us(with_fast(on, lambda: km.matmul(x, w.t()))),
                  "us")  # fmt: skip
    for label, shape, size in ((f"rms_norm hidden [{b},1,{h}]", (b, 1, h), h),
                               (f"rms_norm qk [{b},1,{hq},{d}]", (b, 1, hq, d), d)):  # fmt: skip
        xr = rnd(*shape)
        hf = Qwen3RMSNorm(size, eps=1e-6).to(dev, dtype)
        hf.weight.copy_(rnd(size) * 0.1 + 1)  # under no_grad
        wr, x2 = hf.weight.detach(), xr.reshape(-1, size)
        table.add(label, "HF Qwen3RMSNorm (unpatched)", us(lambda hf=hf, xr=xr: hf(xr)), "us")
        for on, tag in fast:
            table.add(label, f"rk rms_norm (public), {tag}",
                      us(with_fast(on, lambda xr=xr, wr=wr: rms_norm(xr, wr, 1e-6))), "us")  # fmt: skip
            kernel = with_fast(on, lambda x2=x2, wr=wr: kr.rms_norm_fwd(x2, wr, 1e-6))
            table.add(label, f"kernels.rmsnorm.rms_norm_fwd, {tag}", us(kernel), "us")

    class Module(torch.nn.Module):  # what the HF attention functions read of the layer
        is_causal = True
        num_key_value_groups = hq // hkv

    mod = Module()
    q, k, v = rnd(b, hq, 1, d), rnd(b, hkv, tk, d), rnd(b, hkv, tk, d)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    key_start = torch.zeros(b, dtype=torch.int32, device=dev)
    group = f"attention decode B={b} Tk={tk}"
    sdpa = us(lambda: sdpa_attention_forward(mod, q, k, v, None))
    table.add(group, "HF sdpa_attention_forward", sdpa, "us")
    for on, tag in fast:
        table.add(group, f"rk hf_attention_forward, {tag}",
                  us(with_fast(on, lambda: hf_attention_forward(mod, q, k, v, None))), "us")  # fmt: skip
        table.add(group, f"kernels.attention.attention_fwd, {tag}",
                  us(with_fast(on, lambda: ka.attention_fwd(qt, kt, vt, scale=d**-0.5, key_start=key_start))),
                  "us")  # fmt: skip


def model_calls(model, dev, smoke: bool) -> dict:
    """label -> a no-grad call of ``model``: decode step, prefill, masked prime + 8 decode steps,
    masked prefill (the consistency command's inputs)."""
    from transformers import DynamicCache

    from rlkernel.invariant.scoring import _decode_timer, _prefill_timer

    b, t, bd = (2, 16, 2) if smoke else (8, 512, 32)
    gen = torch.Generator(device=dev).manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (b, t), device=dev, generator=gen)
    cached = torch.randint(1, vocab, (bd, t), device=dev, generator=gen)
    tok = torch.randint(1, vocab, (bd, 1), device=dev, generator=gen)
    pos = torch.full((bd, 1), t, device=dev, dtype=torch.long)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=cached, past_key_values=cache, use_cache=True)
    n_seq, plen, glen = (2, 8, 4) if smoke else (32, 16, 128)
    prompts = make_prompts(n_seq, plen, vocab, seed=0)
    completions = torch.randint(1, vocab, (n_seq, glen), generator=torch.Generator().manual_seed(1))
    masked_prefill = _prefill_timer(model, prompts, completions, n_seq)
    masked_decode = _decode_timer(model, prompts, completions, n_seq, steps=8)

    @torch.no_grad()
    def decode():
        model(input_ids=tok, position_ids=pos, past_key_values=cache, use_cache=True)
        cache.crop(-1)

    return {
        f"decode B={bd} cache={t}": decode,
        f"prefill B={b} T={t}": torch.no_grad()(lambda: model(input_ids=ids, use_cache=False)),
        f"masked prime+8 steps B={n_seq}": torch.no_grad()(masked_decode),
        f"masked prefill B={n_seq}": torch.no_grad()(masked_prefill),
    }


def models_section(models: dict, dev, config: str, rounds: int, smoke: bool, table: Table) -> None:
    calls, decode = {}, {}
    for name, model in models.items():
        per_model = model_calls(model, dev, smoke)
        decode[name] = per_model
        variants = [(name, None)]
        if name == "patched":  # the launch path matters only there
            variants = [(f"{name} fast", True), (f"{name} triton", False)]
        for tag, on in variants:
            for label, fn in per_model.items():
                calls[(f"model {config} {label}", tag)] = with_fast(on, fn)
    keys = list(calls)
    times = timing.host_times_interleaved({str(i): calls[k] for i, k in enumerate(keys)}, dev, rounds=rounds)
    for i, (group, tag) in enumerate(keys):
        t = times[str(i)]
        table.add(group, f"{tag} wall", t.wall_ms, "ms")
        table.add(group, f"{tag} host", t.host_ms, "ms")
        table.add(group, f"{tag} host CPU", t.cpu_ms, "ms")
    patched = decode["patched"]
    for label in list(patched)[:1] + list(patched)[2:3]:  # the decode step, the masked decode run
        report = profiling.cprofile_report(patched[label], dev, calls=rounds, restrict="", top=25)
        print(f"\n== cProfile: patched {label}\n{report}")


def kernels_section(models: dict, dev, config: str, reps: int, smoke: bool, table: Table) -> None:
    for name, model in models.items():
        per_model = model_calls(model, dev, smoke)
        for label in list(per_model)[:2]:  # decode step, prefill
            fn = per_model[label]
            wall = timing.host_times(fn, dev, reps=reps, warmup=1).wall_ms
            tl = profiling.kernel_timeline(fn, dev)
            gpu = tl.busy_us / 1e3
            group = f"model {config} {label}"
            table.add(group, f"{name} wall (profile: GPU, host gap)", wall, "ms")
            table.add(group, f"{name} GPU kernels", gpu, "ms")
            table.add(group, f"{name} launches", len(tl.kernels), "")
            for kname, count, ms in tl.by_name()[:12]:
                print(f"    {ms:8.3f} ms {count:4d}x  {kname[:100]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="anchor", help="an rlkernel consistency model config")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--smoke", action="store_true", help="tiny config on the CPU: checks the script only")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("profile_invariant: needs a CUDA device (--smoke runs it tiny on the CPU)", file=sys.stderr)
        return 2
    dev = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    dtype = torch.float32 if args.smoke else torch.bfloat16
    calls, loops, warmup, rounds = (2, 1, 1, 1) if args.smoke else (500, 5, 10, 20)
    config = "tiny" if args.smoke else args.config
    table = Table()
    if "ops" in args.sections:
        # The kernels' own launch path: the Triton backend (on the CPU, the interpreter).
        with rk.use_backend("triton"), torch.no_grad():
            op_section(dev, dtype, calls, loops, warmup, table)
    if {"models", "kernels"} & set(args.sections):
        base = build_model(config, device=dev, dtype=dtype, seed=0)
        models = {"unpatched": base, "patched": patch_hf_model(copy.deepcopy(base))}
        if "models" in args.sections:
            models_section(models, dev, config, rounds, args.smoke, table)
        if "kernels" in args.sections:
            kernels_section(models, dev, config, max(rounds // 2, 1), args.smoke, table)
    table.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
