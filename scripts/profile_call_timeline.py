"""Where an isolated ``fused_policy_loss`` fwd+bwd call spends its time, on a CUDA machine.

    PYTHONPATH=src python3 scripts/profile_call_timeline.py [--vocab 151936 32768] [--cases dapo gspo]
    PYTHONPATH=src python3 scripts/profile_call_timeline.py --cases hidden_dapo hidden_frozen hidden_logprobs

The bench's users' call pattern (``rlkernel.bench``: logits ``out[:, 127:-1]`` of ``[8, 1152, V]``
bf16 requiring grad, ragged lengths, default arguments). The ``hidden_*`` cases are the fused LM
head's (``rlkernel bench linear``'s ragged rows: hidden ``base[:, 127:-1]`` of ``[8, 1152, 4096]``,
V = 151,936 whatever ``--vocab`` says): DAPO+KL with a trainable or frozen weight, and
``linear_token_logprobs(return_entropy=True)``. Per case and vocabulary:

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


LINEAR_KINDS = {
    "hidden_dapo": "ragged_dapo_kl_fwd_bwd",
    "hidden_frozen": "ragged_dapo_kl_frozen_fwd_bwd",
    "hidden_logprobs": "ragged_logprobs_entropy_fwd_bwd",
}


def _linear_floor(case: str, tokens: int, seed: int = 0):
    """The bench linear suite's GEMM floor of the case (its cuBLAS GEMMs over the scored rows)."""
    from rlkernel.bench import _linear_baselines as lb
    from rlkernel.bench import _linear_inputs as li

    kind = li.KINDS[LINEAR_KINDS[case]]
    inp = li.make_inputs(kind, li.geometry(tokens, False), 4096, 151936, DEV, seed=seed)
    call = lb.gemm_call(kind, [inp], seed)
    return lambda: call(0)


def _linear_call(case: str, tokens: int = 8192, seed: int = 0):
    """The bench linear suite's rlkernel call (public API, default arguments) and its fwd+bwd."""
    from rlkernel.bench import _linear_inputs as li

    kind = li.KINDS[LINEAR_KINDS[case]]
    inp = li.make_inputs(kind, li.geometry(tokens, False), 4096, 151936, DEV, seed=seed)
    leaves = (inp["base"],) if kind.frozen_weight else (inp["base"], inp["weight"])
    for t in leaves:
        t.requires_grad_(True)
    cfg = loss_config("dapo")

    def step():
        if not kind.loss:
            lp, en = rk.linear_token_logprobs(
                li.hidden(inp), inp["weight"], inp["ids_ignore"], temperature=TEMPERATURE,
                return_entropy=True,
            )  # fmt: skip
            return torch.autograd.grad((lp, en), leaves, inp["grad_out"])
        loss = rk.fused_policy_loss(
            cfg, token_ids=inp["ids"], old_logp=inp["old_logp"], advantages=inp["advantages"],
            mask=inp["mask"], hidden=li.hidden(inp), weight=inp["weight"], temperature=TEMPERATURE,
            ref_logp=inp["ref_logp"],
        ).loss  # fmt: skip
        return torch.autograd.grad(loss, leaves)

    return step


# (module, attribute) of the functions whose host entry/exit times ``--host-marks`` records.
HOST_MARKS = [
    ("rlkernel.rl.fused", "validate_batch"),
    ("rlkernel.rl.token_loss", "masked_token_ids"),
    ("rlkernel.rl.token_loss", "plan_from_batch"),
    ("rlkernel.ops.id_checks", "check_token_ids"),
    ("rlkernel.ops._linear_function", "_active_rows"),
    ("rlkernel.ops._linear_engine", "_Engine.__init__"),
    ("rlkernel.ops._linear_engine", "_Engine.stage"),
    ("rlkernel.kernels.linear_head", "stats_partials"),
    ("rlkernel.kernels.linear_head", "combine_partials"),
    ("rlkernel.kernels.linear_head", "linear_head_grad_into"),
    ("rlkernel.ops._linear_function", "whole_batch_grads"),
]


def _host_marks(step, reps=10):
    """ms from the start of an isolated call (queue drained before) to the first entry and exit of
    each function of ``HOST_MARKS`` on the host, and to the GPU's completion of the work queued by
    that exit (a CUDA event), median over ``reps`` calls: how long the GPU waits for the host
    before each stage, without a profiler's overhead."""
    import importlib

    marks: dict[str, list] = {}
    t0 = [0.0]
    undo = []
    for mod_name, attr in HOST_MARKS:
        mod = importlib.import_module(mod_name)
        owner, name = (getattr(mod, attr.split(".")[0]), attr.split(".")[1]) if "." in attr else (mod, attr)
        orig = getattr(owner, name)

        def wrapped(*a, _orig=orig, _key=attr, **k):
            seen = marks.setdefault(_key, [])
            enter = time.perf_counter() - t0[0]
            out = _orig(*a, **k)
            if len(seen) == 0:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                seen.append((enter, time.perf_counter() - t0[0], ev))
            return out

        setattr(owner, name, wrapped)
        undo.append((owner, name, orig))
    rows: dict[str, list] = {}
    try:
        for _ in range(reps):
            torch.cuda.synchronize()
            marks.clear()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0[0] = time.perf_counter()
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            marks["(call end)"] = [(0.0, time.perf_counter() - t0[0], end)]
            for key, seen in marks.items():
                enter, leave, ev = seen[0]
                rows.setdefault(key, []).append((enter * 1e3, leave * 1e3, start.elapsed_time(ev)))
    finally:
        for owner, name, orig in undo:
            setattr(owner, name, orig)
    return {k: tuple(statistics.median(x[i] for x in v) for i in range(3)) for k, v in rows.items()}


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
    call = next(e for e in events if e.name == "CALL" and e.device_type == torch.autograd.DeviceType.CPU)
    t_call = call.time_range.start
    kernels = sorted(
        (
            e
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0
            and e.name != "CALL"  # the record_function range shows on the GPU too
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


def _by_kernel(rows) -> list[tuple[str, int, float]]:
    """(kernel name, launches, total ms) of a profiled call's kernels, largest total first."""
    totals: dict[str, list] = {}
    for _, d, name in rows:
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += d / 1e3
    return sorted(((n, c, t) for n, (c, t) in totals.items()), key=lambda x: -x[2])


def _accounting(case: str, tokens: int, step, iso: float) -> None:
    """Where the isolated call's time over the GEMM floor goes: the profiled call's kernels by name
    next to the floor's (its cuBLAS GEMMs, profiled the same way), the GPU's idle time before the
    first kernel and between kernels."""
    floor = _linear_floor(case, tokens)
    floor_iso = _times(floor, 10)[0]
    f_rows, f_busy, _, _ = _timeline(floor)
    rows, busy, end, _ = _timeline(step)
    first = rows[0][0] if rows else 0.0
    print(f"    accounting at N = {tokens}: isolated {iso:.3f} ms vs the floor's {floor_iso:.3f} ms "
          f"(floor kernels {f_busy / 1e3:.3f} ms)")  # fmt: skip
    print(f"      GPU idle before the first kernel {first / 1e3:.3f} ms, between kernels "
          f"{((end or 0) - first - busy) / 1e3:.3f} ms; kernels {busy / 1e3:.3f} ms "
          f"(+{(busy - f_busy) / 1e3:.3f} over the floor's)")  # fmt: skip
    for label, table in (("floor", _by_kernel(f_rows)), ("call", _by_kernel(rows))):
        for name, count, total in table[:14]:
            print(f"      {label:5s} {total:8.3f} ms  {count:4d}x  {name}")


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
    cases = ["dapo", "gspo", *LINEAR_KINDS]
    parser.add_argument("--cases", nargs="+", default=["dapo", "gspo"], choices=cases)
    parser.add_argument("--no-cprofile", action="store_true")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192],
                        help="N of the hidden_* cases (the bench linear suite's 8192 and 65536)")
    parser.add_argument("--no-kernel-list", action="store_true",
                        help="skip the per-kernel timeline (long at N = 65,536)")
    parser.add_argument("--accounting", action="store_true",
                        help="hidden_* cases: kernels by name next to the GEMM floor's")  # fmt: skip
    args = parser.parse_args()
    geo = geometry(8192, smoke=False)
    runs = []  # (case, V, N of the hidden_* cases or None)
    for v in args.vocab:
        for case in args.cases:
            if case not in LINEAR_KINDS:
                runs.append((case, v, None))
            elif v == args.vocab[0]:  # the fused LM head's cases: V = 151,936 whatever --vocab says
                runs.extend((case, 151936, n) for n in args.tokens)
    summary = []
    for case, v, tokens in runs:
        if tokens is not None:
            inp, step = None, _linear_call(case, tokens)
        else:
            kind = KINDS["sliced_dapo_kl_fwd_bwd" if case == "dapo" else "sliced_gspo_fwd_bwd"]
            inp = make_sliced_inputs(kind, geo, v, DEV, seed=0)
            inp["base"].requires_grad_(True)
            step = _call(case, inp)
        iters = 10 if tokens is not None else 50
        iso, b2b, host = _times(step, iters)
        rows, busy, end, wall = _timeline(step)
        label = f"{case} V={v}" + (f" N={tokens}" if tokens is not None else "")
        print(f"\n=== {label}: isolated {iso:.3f} ms, back-to-back {b2b:.3f} ms, host {host:.3f} ms/call")
        print(f"    profiled call: {len(rows)} kernels, GPU busy {busy / 1e3:.3f} ms, "
              f"last kernel ends at {(end or 0) / 1e3:.3f} ms, "
              f"idle inside {((end or 0) - busy) / 1e3:.3f} ms")  # fmt: skip
        if not args.no_kernel_list:
            prev_end = 0.0
            for s, d, name in rows:
                gap = s - prev_end
                print(f"    {s / 1e3:8.3f} ms  {d:8.1f} us  (idle before {gap:7.1f} us)  {name}")
                prev_end = max(prev_end, s + d)
        if tokens is not None:
            print("    ms from the call's start (median of 10 calls): host at the first entry, exit; "
                  "GPU done with the work queued by then")  # fmt: skip
            for key, (enter, leave, gpu) in sorted(_host_marks(step).items(), key=lambda kv: kv[1][1]):
                print(f"    {enter:8.3f} {leave:8.3f} {gpu:8.3f}  {key}")
            if args.accounting:
                _accounting(case, tokens, step, iso)
        if not args.no_cprofile:
            print(_cprofile(step, iters))
        idle = ((end or 0) - busy) / 1e3
        summary.append((case, v, tokens or 0, iso, b2b, host, len(rows), busy / 1e3, idle))
        del inp, step
        torch.cuda.empty_cache()
    print("\ncase            V       N      isolated  b2b      host    kernels  GPU busy  idle in call (ms)")
    for case, v, n, iso, b2b, host, nk, busy, idle in summary:
        print(f"{case:15s} {v:7d} {n:6d}  {iso:8.3f} {b2b:7.3f} {host:7.3f} {nk:6d} {busy:8.3f} {idle:6.3f}")

if __name__ == "__main__":
    main()
