"""Where the time of fused_policy_loss goes on a GPU: per-call wall time, CPU-side time, and the
CUDA kernels by total time (torch.profiler). Used to find launch/sync overhead in the RL algebra.

    python scripts/profile_loss.py [--n 8192] [--v 151936] [--preset dapo]
"""

from __future__ import annotations

import argparse
import time

import torch

import rlkernel as rk


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--v", type=int, default=151936)
    ap.add_argument("--preset", default="dapo")
    args = ap.parse_args()
    dev = torch.device("cuda")
    b, t = args.n // 1024, 1024
    g = torch.Generator(device=dev).manual_seed(0)
    logits = (torch.randn(b, t, args.v, device=dev, generator=g) * 2).bfloat16().requires_grad_(True)
    ids = torch.randint(0, args.v, (b, t), device=dev, generator=g)
    with torch.no_grad():
        logp = rk.token_logprobs(logits, ids)
    old = logp + 0.1 * torch.randn(b, t, device=dev, generator=g)
    ref = logp + 0.1 * torch.randn(b, t, device=dev, generator=g)
    adv = torch.randn(b, device=dev, generator=g)
    mask = torch.rand(b, t, device=dev, generator=g) > 0.1
    kl = dict(kl_coef=1e-3) if args.preset in ("dapo", "ppo") else {}
    cfg = rk.PolicyLossConfig.preset(args.preset, **kl)

    def fused_grad(x: torch.Tensor, **options) -> torch.Tensor:
        out = rk.fused_policy_loss(
            cfg, token_ids=ids, old_logp=old, advantages=adv, mask=mask, logits=x,
            ref_logp=ref if kl else None, **options,
        )  # fmt: skip
        return torch.autograd.grad(out.loss, (x,))[0]

    def step(validate: bool, algebra_only: bool = False):
        if algebra_only:
            lp = logp.detach().requires_grad_(True)
            out = rk.policy_loss(lp, old, adv, mask, cfg, ref_logp=ref if kl else None)
            return torch.autograd.grad(out.loss, (lp,))
        return fused_grad(logits, validate=validate)

    cases = [
        ("fused validate=True", dict(validate=True)),
        ("fused validate=False", dict(validate=False)),
        ("policy_loss only (on logp)", dict(validate=False, algebra_only=True)),
    ]
    for name, kw in cases:
        for _ in range(3):
            step(**kw)
        torch.cuda.synchronize()
        reps = 20
        t0 = time.perf_counter()
        for _ in range(reps):
            step(**kw)
        torch.cuda.synchronize()
        pipelined = (time.perf_counter() - t0) / reps * 1e3
        iso = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(**kw)
            cpu = time.perf_counter() - t0
            torch.cuda.synchronize()
            iso.append(((time.perf_counter() - t0) * 1e3, cpu * 1e3))
        iso.sort()
        print(
            f"{name:32s} back-to-back {pipelined:7.3f} ms/call | isolated {iso[reps // 2][0]:7.3f} ms "
            f"(CPU launch time {iso[reps // 2][1]:6.3f} ms)"
        )
    for inplace in (False, True):
        x = logits.detach().clone().requires_grad_(True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        grad = fused_grad(x, inplace_backward=inplace)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        print(
            f"peak extra memory, fwd+bwd, inplace_backward={inplace}: {extra / 1e9:.3f} GB = "
            f"{extra / args.n:.1f} bytes/token (grad aliases logits: {grad.data_ptr() == x.data_ptr()})"
        )
        del grad, x
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        step(validate=True)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"CUDA kernels launched in one fused fwd+bwd: {len(kernels)}")


if __name__ == "__main__":
    main()
