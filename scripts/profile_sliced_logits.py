"""Time and memory of fused_policy_loss (DAPO + k3 KL) fwd+bwd with logits sliced from a model output.

    PYTHONPATH=src python3 scripts/profile_sliced_logits.py after [dapo|gspo] [V]    # on a CUDA machine

The logits are ``base[:, P - 1 : -1]`` of a ``[B, P + T, V]`` bf16 tensor that requires grad (the
trainer's call), against a contiguous ``[B, T, V]`` leaf; ``validate`` True and False; isolated
(CUDA events around one call) and back-to-back timings, and the peak memory beyond the inputs.
"""

import dataclasses
import statistics
import sys
import time

import torch

import rlkernel as rk

dev = "cuda"
PRESET = sys.argv[2] if len(sys.argv) > 2 else "dapo"
B, P, T, V = 8, 128, 1024, int(sys.argv[3]) if len(sys.argv) > 3 else 151936
g = torch.Generator(device="cpu").manual_seed(0)
base = (2 * torch.randn(B, P + T, V, generator=g)).to(dev, torch.bfloat16).requires_grad_(True)
ids = torch.randint(0, V, (B, T), generator=g).to(dev)
mask = (torch.rand(B, T, generator=g) > 0.1).to(dev)
old = (-torch.rand(B, T, generator=g)).to(dev)
ref = (-torch.rand(B, T, generator=g)).to(dev)
adv = torch.randn(B, generator=g).to(dev)
cfg = rk.PolicyLossConfig.preset(PRESET)
if PRESET == "dapo":
    cfg = dataclasses.replace(cfg, kl_coef=1e-3, kl_estimator="k3")
contig = base.detach()[:, P - 1 : -1].contiguous().requires_grad_(True)


def step(sliced, validate):
    x = base[:, P - 1 : -1] if sliced else contig
    out = rk.fused_policy_loss(
        cfg, logits=x, token_ids=ids, old_logp=old, advantages=adv, mask=mask, ref_logp=ref, validate=validate
    )
    out.loss.backward()
    base.grad = None
    contig.grad = None


def timeit(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return statistics.median(ts), (time.perf_counter() - t0) / iters * 1e3


for sliced in (False, True):
    for validate in (True, False):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        iso, piped = timeit(lambda s=sliced, v=validate: step(s, v))
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30
        print(
            f"{sys.argv[1]:5s} {PRESET} V={V} {'sliced' if sliced else 'contig'} validate={validate!s:5s}: "
            f"isolated {iso:6.2f} ms, back-to-back {piped:6.2f} ms, peak extra {peak:5.2f} GiB",
            flush=True,
        )
