"""Where an isolated ``fused_policy_loss`` fwd+bwd call spends its time, on a CUDA machine.

    PYTHONPATH=src python3 scripts/profile_call_timeline.py [--vocab 151936 32768] [--cases dapo gspo]

The bench's users' call pattern (``rlkernel.bench``: logits ``out[:, 127:-1]`` of ``[8, 1152, V]``
bf16 requiring grad, ragged lengths, default arguments). Per case and vocabulary:

* isolated ms (queue drained before, synchronize after: the bench's isolated timing), back-to-back
  ms per call, and the host ms of a call (perf_counter around the call, no synchronize);
* one isolated call under ``torch.profiler``: each GPU kernel's start offset from the call's start
  and its duration, and the GPU's idle time inside the call (what the host made it wait for);
* cProfile of 50 isolated calls: rlkernel's functions by cumulative time, every function by own
  time.

Prints a compact table per case; ``--liger`` adds Liger's ``GrpoLossFunction`` for comparison
(needs liger-kernel).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

import rlkernel as rk
from rlkernel.bench._logits_baselines import TEMPERATURE, loss_config
from rlkernel.bench._logits_inputs import KINDS, geometry, make_sliced_inputs, window

DEV = torch.device("cuda")


def _call(case: str, inp: dict):
    cfg = loss_config(case)
    kl = case == "dapo"

    def step():
        out = rk.fused_policy_loss(
            cfg,
            token_ids=inp["ids"],
            old_logp=inp["old_logp"],
            advantages=inp["advantages"],
            mask=inp["mask"],
            logits=window(inp["base"], inp["p"]),
            temperature=TEMPERATURE,
            ref_logp=inp["ref_logp"] if kl else None,
        )
        (g,) = torch.autograd.grad(out.loss, (inp["base"],))
        return g

    return step


def _times(step, iters=50):
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    iso, host = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        iso.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    b2b = (time.perf_counter() - t0) / iters
    return statistics.median(iso) * 1e3, b2b * 1e3, statistics.median(host) * 1e3


def _timeline(step):
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function("CALL"):
            step()
        torch.cuda.synchronize()
    events = prof.events()
    call = next(e for e in events if e.name == "CALL")
    t_call = call.time_range.start
    kernels = sorted(
        (
            e
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0
        ),
        key=lambda e: e.time_range.start,
    )
    rows, busy, end = [], 0.0, None
    for k in kernels:
        s, d = k.time_range.start - t_call, k.time_range.elapsed_us()
        rows.append((s, d, k.name[:70]))
        busy += d
        end = s + d
    return rows, busy, end, call.time_range.elapsed_us()


def _cprofile(step, n=50):
    """cProfile of ``n`` isolated calls (the queue drained between calls, outside the profile), so
    no function's time includes waiting for the GPU: rlkernel's functions by cumulative time, then
    every function by own time."""
    prof = cProfile.Profile()
    for _ in range(n):
        torch.cuda.synchronize()
        prof.enable()
        step()
        prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats("rlkernel", 30)
    stats.sort_stats("tottime").print_stats(25)
    return f"(per call: divide by {n})\n" + out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 32768])
    parser.add_argument("--cases", nargs="+", default=["dapo", "gspo"])
    parser.add_argument("--no-cprofile", action="store_true")
    args = parser.parse_args()
    geo = geometry(8192, smoke=False)
    summary = []
    for v in args.vocab:
        for case in args.cases:
            kind = KINDS["sliced_dapo_kl_fwd_bwd" if case == "dapo" else "sliced_gspo_fwd_bwd"]
            inp = make_sliced_inputs(kind, geo, v, DEV, seed=0)
            inp["base"].requires_grad_(True)
            step = _call(case, inp)
            iso, b2b, host = _times(step)
            rows, busy, end, wall = _timeline(step)
            print(f"\n=== {case} V={v}: isolated {iso:.3f} ms, back-to-back {b2b:.3f} ms, "
                  f"host {host:.3f} ms/call")  # fmt: skip
            print(f"    profiled call: {len(rows)} kernels, GPU busy {busy / 1e3:.3f} ms, "
                  f"last kernel ends at {(end or 0) / 1e3:.3f} ms, "
                  f"idle inside {((end or 0) - busy) / 1e3:.3f} ms")  # fmt: skip
            for s, d, name in rows:
                print(f"    {s / 1e3:8.3f} ms  {d:8.1f} us  {name}")
            if not args.no_cprofile:
                print(_cprofile(step))
            summary.append((case, v, iso, b2b, host, len(rows), busy / 1e3, ((end or 0) - busy) / 1e3))
            del inp, step
            torch.cuda.empty_cache()
    print("\ncase   V        isolated  b2b     host    kernels  GPU busy  GPU idle in call (ms)")
    for case, v, iso, b2b, host, nk, busy, idle in summary:
        print(f"{case:6s} {v:7d}  {iso:7.3f}  {b2b:7.3f} {host:7.3f}  {nk:6d}  {busy:8.3f}  {idle:8.3f}")


if __name__ == "__main__":
    main()
