"""Where the patched model's time goes: torch.profiler of the anchor model (unpatched vs patched).

    PYTHONPATH=src python3 scripts/profile_invariant_model.py [--config anchor] [--smoke]

For prefill (B=8, T=512, no grad) and one decode step (B=32 against a 512-entry cache) it prints,
for each model: wall time per call (CUDA-synchronized, median of 10), total GPU kernel time per
call, the host-side gap (wall − GPU), the number of kernel launches, and the top GPU kernels by
time. A patched model slower than the unpatched one by more than its GPU-time difference is host
bound (Python wrappers, launches); otherwise the kernels themselves are the gap.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from rlkernel.invariant.consistency import build_model
from rlkernel.invariant.patch import patch_hf_model


def _wall_ms(fn, reps: int, sync) -> float:
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _profile(fn, reps: int):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    launches = 0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[ev.name] += ev.device_time_total / 1e3 / reps
            launches += 1
    return per_kernel, launches / reps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="anchor")
    parser.add_argument("--smoke", action="store_true", help="tiny config on CPU (no GPU timing)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    config = "tiny" if args.smoke else args.config
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    base = build_model(config, device=device, dtype=dtype, seed=0)
    models = {"unpatched": base, "patched": patch_hf_model(copy.deepcopy(base))}
    b, t, bd = (2, 16, 2) if args.smoke else (8, 512, 32)
    gen = torch.Generator(device=device).manual_seed(0)
    vocab = base.config.vocab_size
    ids = torch.randint(1, vocab, (b, t), device=device, generator=gen)
    dec_ids = torch.randint(1, vocab, (bd, t), device=device, generator=gen)
    tok = torch.randint(1, vocab, (bd, 1), device=device, generator=gen)
    reps = 2 if args.smoke else 10
    from transformers import DynamicCache

    for name, model in models.items():
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=dec_ids, past_key_values=cache, use_cache=True)
        pos = torch.full((bd, 1), t, device=device, dtype=torch.long)

        def prefill(model=model):
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)

        def decode(model=model, cache=cache, pos=pos):
            with torch.no_grad():
                model(input_ids=tok, position_ids=pos, past_key_values=cache, use_cache=True)
            cache.crop(-1)

        for label, fn in (
            (f"prefill B={b} T={t}", prefill),
            (f"decode B={bd} cache={t}", decode),
        ):
            fn()
            fn()
            wall = _wall_ms(fn, reps, sync)
            kernels, launches = _profile(fn, reps)
            gpu = sum(kernels.values())
            print(
                f"\n== {name:9s} {label}: wall {wall:.3f} ms, GPU {gpu:.3f} ms, "
                f"host gap {wall - gpu:.3f} ms, {launches:.0f} launches"
            )
            for kname, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:12]:
                print(f"   {ms:8.3f} ms  {kname[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
