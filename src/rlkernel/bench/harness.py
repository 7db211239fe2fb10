"""The benchmark harness: timing, peak memory, correctness cross-checks, result rows, CSV/JSON.

A *suite* (``rlkernel.bench.logits``, later ``linear``, ``invariant``) describes workloads; this module
runs every implementation of one workload in the same process and turns the measurements into one
row per (workload, implementation), plus one ``ceiling`` row per workload.

Method (DESIGN.md, "Performance method"):

* **Timing.** Every implementation is called once (the first call compiles / JITs; its wall time is
  kept as ``first_call_s``), then ``warmup`` more times, then the implementations are *interleaved*:
  ``rounds`` rounds, each calling every implementation ``reps`` times in a rotated order, so that
  clock or thermal drift hits all of them alike. On CUDA each call is isolated (the device is
  synchronized before it) and bracketed by its own pair of CUDA events: the host time until its
  first kernel starts, its kernels, and the launch gaps the call itself causes (e.g. a host sync);
  on CPU ``time.perf_counter``. A workload with ``queue_ahead`` queues a 1 GiB write (L2 evicted)
  before each start event instead, so only GPU work is timed (calls of a few microseconds, e.g.
  decode-shaped GEMMs, whose isolated time is mostly launch latency). The row reports the median
  and the 20th/80th percentiles. A workload whose calls take seconds caps ``warmup``, ``rounds``
  and ``reps`` for itself (``Workload.max_*``); its ``samples`` column says how many calls it got.
* **Back to back.** A workload with ``back_to_back`` is also timed the way a training step calls
  it: ``loop_calls`` calls issued one after the other, one sync at the end, wall time per call
  (``b2b_ms``, the median of ``loop_reps`` loops, implementations interleaved). Host time that
  fits under the previous call's GPU work is hidden there; a host sync inside a call is not.
* **Inputs and L2.** Inputs larger than the L2 cache are reused as they are (they cannot stay
  resident). Only when a workload's inputs would fit in L2 does the harness ask the suite for several
  copies and rotate through them, so no call reads a cache-warm input.
* **Peak extra memory.** ``torch.cuda.reset_peak_memory_stats()``; ``base = memory_allocated()`` with
  the inputs already allocated; one call; ``max_memory_allocated() − base``. Inputs are excluded; the
  outputs of the call (for fwd+bwd: the logits gradient) and all its temporaries are included.
* **Cross-check.** That same call's outputs are compared with the workload's reference
  (``Workload.reference``: an implementation of the run, plain PyTorch, or an untimed oracle the
  setup provides under that name, e.g. the ``linear`` suite's fp32 reference, called once and given
  no row): ``max_abs_diff`` over the forward values, ``grad_rel_diff`` = max |g − g_ref| /
  max |g_ref| over the input gradients. A benchmark of a wrong implementation is worthless, so the
  numbers sit next to the timings.
* **Roofline.** ``bytes_moved`` / ``flops`` per workload come from the suite (documented there); the
  row's TB/s and TFLOP/s and their fractions of the ceilings measured in the same run
  (:mod:`rlkernel.bench.ceilings`). The ``ceiling`` row is the time the minimal traffic (and math)
  would take at those ceilings.

Caveats:
    * CPU results (``--smoke``) only exercise the pipeline: the device column says ``cpu`` and the
      memory columns stay empty.
    * An implementation that raises (or runs out of memory) gets a row with status ``error: ...``
      (``oom``) and the run goes on; the CLI exits non-zero if any row is an error.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from rlkernel.bench.results import columns_for, make_rows, write_results  # noqa: F401 - the CLI's
from rlkernel.bench.suite import (  # noqa: F401 - the rest re-exported: the CLI and tests use them here
    BenchError,
    Call,
    CallResult,
    Measurement,
    Options,
    Prepared,
    Skip,
    Suite,
    Workload,
)
from rlkernel.bench.timing import (  # noqa: F401 - re-exported: suites, tests and scripts use them here
    QUEUE_AHEAD_BYTES,
    gpu_time_ms,
    input_copies,
    quantile,
    synchronize,
    time_back_to_back,
    time_interleaved,
)

# --------------------------------------------------------------------------------------------------
# Timing and memory
# --------------------------------------------------------------------------------------------------


def measure_call(call: Call, device: torch.device) -> tuple[CallResult, float | None]:
    """Run ``call(0)`` once; return its result and the peak extra memory in bytes (None on CPU)."""
    if device.type != "cuda":
        return call(0), None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = call(0)
    torch.cuda.synchronize(device)
    return out, float(torch.cuda.max_memory_allocated(device) - base)


def _max_abs_diff(values: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> float | None:
    if len(values) != len(ref) or not values:
        return None
    worst = 0.0
    for a, b in zip(values, ref, strict=True):
        if a.shape != b.shape:
            return None
        if a.numel():
            worst = max(worst, (a.detach().double() - b.detach().double()).abs().max().item())
    return worst


def _grad_rel_diff(grads: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> float | None:
    """max |g − g_ref| / max |g_ref|, in chunks of the leading dim to bound the fp32 temporaries."""
    if len(grads) != len(ref) or not grads:
        return None
    num = den = 0.0
    for g, r in zip(grads, ref, strict=True):
        if g.shape != r.shape:
            return None
        if not g.numel():
            continue
        step = max(1, (1 << 26) // max(1, g[0].numel()))
        for s in range(0, g.shape[0], step):
            a, b = g[s : s + step].float(), r[s : s + step].float()
            num = max(num, (a - b).abs().max().item())
            den = max(den, b.abs().max().item())
    return num / den if den > 0 else num


def _free(device: torch.device, *, collect: bool = False) -> None:
    """Return cached blocks to the driver between implementations (less fragmentation for the next
    one); ``collect`` also runs the garbage collector (slow once Dynamo is loaded: per workload only)."""
    if device.type != "cuda":
        return
    if collect:
        gc.collect()
    torch.cuda.empty_cache()


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _error_status(exc: BaseException) -> str:
    if _is_oom(exc):
        return "oom"
    msg = " ".join(f"{type(exc).__name__}: {exc}".split())
    return "error: " + (msg[:300] + "..." if len(msg) > 300 else msg)


# --------------------------------------------------------------------------------------------------
# Running one workload, and a suite
# --------------------------------------------------------------------------------------------------


def _time_each(
    timer: Callable[..., dict[str, list[float]]],
    timed: dict[str, Call],
    results: dict[str, Measurement],
    device: torch.device,
    what: str,
    **kw,
) -> dict[str, list[float]]:
    """``timer(timed, device, **kw)``; if that fails (e.g. an OOM from fragmentation between
    implementations), time each implementation alone and say so in its notes, so one failure costs
    one row (its status says why)."""
    if not timed:
        return {}
    try:
        return timer(timed, device, **kw)
    except Exception as exc:  # noqa: BLE001
        print(f"    {what} timing failed ({_error_status(exc)}); timing one at a time", flush=True)
        _free(device, collect=True)
    samples: dict[str, list[float]] = {}
    for impl, call in timed.items():
        results[impl].note = "; ".join(x for x in (results[impl].note, f"{what}: timed alone") if x)
        try:
            samples.update(timer({impl: call}, device, **kw))
        except Exception as exc_one:  # noqa: BLE001
            results[impl].status = _error_status(exc_one)
            _free(device, collect=True)
    return samples


def _time_all(timed: dict[str, Call], results: dict[str, Measurement], opts: Options, copies: int,
              workload: Workload) -> None:  # fmt: skip
    """The isolated, interleaved timing of every implementation, then (``workload.back_to_back``)
    the back-to-back loops of those that are still fine."""
    _, rounds, reps = workload.capped(opts)
    host: dict[str, list[float]] = {}
    kw = {"rounds": rounds, "reps": reps, "copies": copies, "queue_ahead": workload.queue_ahead, "host": host}
    for impl, xs in _time_each(time_interleaved, timed, results, opts.device, "interleaved", **kw).items():
        results[impl].samples = xs
        results[impl].host_samples = host.get(impl, [])
    if not (workload.back_to_back and opts.loop_calls > 0):
        return
    timed = {i: c for i, c in timed.items() if results[i].status == "ok"}
    kw = {"loop": opts.loop_calls, "reps": opts.loop_reps, "copies": copies}
    for impl, xs in _time_each(time_back_to_back, timed, results, opts.device, "back-to-back", **kw).items():
        results[impl].b2b_samples = xs
        results[impl].b2b_calls = opts.loop_calls


def _untimed_reference(workload: Workload, prepared: Prepared, device: torch.device) -> CallResult | None:
    """The outputs of the workload's reference when it is not one of the timed implementations
    (an oracle the setup provides under that name: one call, no timing, no row), else None. A
    failing reference leaves the rows without a cross-check (and says so on the console)."""
    name = workload.reference
    call = prepared.calls.get(name) if name is not None and name not in workload.impls else None
    if call is None or isinstance(call, Skip):
        return None
    try:
        out = call(0)
        synchronize(device)
        return out
    except Exception as exc:  # noqa: BLE001 - no cross-check, the timings still stand
        print(f"    reference {name}: {_error_status(exc)}; no cross-check", flush=True)
        return None
    finally:
        _free(device, collect=True)


def bench_workload(workload: Workload, opts: Options, *, l2_bytes: int = 0) -> list[Measurement]:
    """Set up, cross-check, measure memory of, and time every implementation of ``workload``."""
    device = opts.device
    copies = input_copies(workload.input_bytes, l2_bytes)
    results = {impl: Measurement(impl) for impl in workload.impls}
    try:
        prepared = workload.setup(device, workload.impls, copies)
    except Exception as exc:  # noqa: BLE001 - e.g. the inputs do not fit: record it, go on
        status = _error_status(exc)
        print(f"    setup failed: {status}", flush=True)
        for m in results.values():
            m.status = status
        _free(device, collect=True)
        return list(results.values())
    for impl, call in prepared.calls.items():
        if impl not in results:  # an untimed reference
            continue
        results[impl].note = prepared.notes.get(impl, "")
        if isinstance(call, Skip):
            results[impl].status = "skipped: " + call.reason
    runnable = [i for i in workload.impls if not isinstance(prepared.calls.get(i), Skip)]
    # The reference goes first so that the others can be compared with its outputs.
    if workload.reference in runnable:
        runnable.remove(workload.reference)
        runnable.insert(0, workload.reference)
    ref_out = _untimed_reference(workload, prepared, device)
    for impl in runnable:
        m, call = results[impl], prepared.calls[impl]
        assert not isinstance(call, Skip)
        try:
            t0 = time.perf_counter()
            call(0)
            synchronize(device)
            m.first_call_s = time.perf_counter() - t0
            for w in range(workload.capped(opts)[0]):
                call(w % copies)
            synchronize(device)
            out, m.peak_bytes = measure_call(call, device)
            if impl == workload.reference:
                ref_out = out
            elif ref_out is not None:
                m.max_abs_diff = _max_abs_diff(out.values, ref_out.values)
                m.grad_rel_diff = _grad_rel_diff(out.grads, ref_out.grads)
            del out
        except Exception as exc:  # noqa: BLE001 - one failing implementation must not end the run
            m.status = _error_status(exc)
            print(f"    {impl}: {m.status}", flush=True)
            _free(device, collect=True)
        _free(device)
    ref_out = None
    _free(device)
    timed = {i: prepared.calls[i] for i in runnable if results[i].status == "ok"}
    _time_all(timed, results, opts, copies, workload)
    del prepared, timed
    _free(device, collect=True)
    return [results[i] for i in workload.impls]


ENV_VARS = ("RLKERNEL_BACKEND", "TRITON_INTERPRET", "PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES")


def _progress(m: Measurement) -> str:
    """One implementation's result for the console line of its workload; with the peak memory, so
    that the log of a run stopped before its files are written still has the numbers."""
    if not m.samples:
        return f"{m.impl} {m.status.split(':')[0]}"
    first = f" (1st call {m.first_call_s:.1f} s)" if m.first_call_s and m.first_call_s >= 1 else ""
    b2b = f" / {statistics.median(m.b2b_samples):.3g} b2b" if m.b2b_samples else ""
    peak = f" [peak +{m.peak_bytes / 1e9:.2f} GB]" if m.peak_bytes is not None else ""
    return f"{m.impl} {statistics.median(m.samples):.3g}{b2b} ms{first}{peak}"


def run_suite(suite: Suite, opts: Options, *, log: Callable[[str], None] = print) -> tuple[list[dict], dict]:
    """Measure the ceilings, then every workload of ``suite``; return (rows, meta)."""
    from rlkernel.bench import ceilings as ceil_mod

    workloads = suite.build(opts)
    if not workloads:
        raise BenchError(f"suite {suite.name!r}: the selection leaves no workload to run")
    env = ceil_mod.collect_env(opts.device)
    t_start = time.perf_counter()
    log(f"rlkernel bench {suite.name}: {len(workloads)} workloads on {env['gpu']} (torch {env['torch']})")
    ceilings = ceil_mod.measure(opts.device, smoke=opts.smoke)
    log(f"ceilings: {ceilings.describe()}")
    l2 = ceil_mod.l2_cache_bytes(opts.device)
    rows: list[dict] = []
    for k, w in enumerate(workloads, 1):
        log(f"[{k}/{len(workloads)}] {w.label} ({', '.join(w.impls)})")
        t0 = time.perf_counter()
        results = bench_workload(w, opts, l2_bytes=l2)
        summary = ", ".join(_progress(m) for m in results)
        log(f"    {time.perf_counter() - t0:.1f} s: {summary}")
        rows += make_rows(suite, w, results, ceilings, env)
    meta = {
        "suite": suite.name,
        "description": suite.description,
        "bytes_doc": suite.bytes_doc,
        "env": env,
        "ceilings": ceilings.as_dict(),
        "options": {
            k: (str(v) if isinstance(v, torch.device) else v) for k, v in dataclasses.asdict(opts).items()
        },
        "command": " ".join(sys.argv),
        "env_vars": {k: os.environ.get(k) for k in ENV_VARS if os.environ.get(k) is not None},
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    log(f"done in {meta['wall_s']} s")
    return rows, meta
