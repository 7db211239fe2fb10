"""Timing primitives of the benchmark harness and the profiling scripts: interleaved per-call
CUDA-event timing of isolated calls, GPU time of small calls (``queue_ahead``), back-to-back loops (a
training step's call pattern), the host time of a call (:func:`host_times`, :func:`host_loop_us`),
L2 input rotation, quantiles. :mod:`rlkernel.bench.harness` runs workloads with them (and re-exports
them); the scripts under ``scripts/`` time their calls with the same functions. See the harness
module docstring for the method.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


def input_copies(input_bytes: int, l2_bytes: int) -> int:
    """1 if the inputs cannot stay in L2; else enough copies to cycle through 4× L2 (at most 16)."""
    if l2_bytes <= 0 or input_bytes >= l2_bytes:
        return 1
    return min(16, math.ceil(4 * l2_bytes / max(input_bytes, 1)))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ``queue_ahead``: a write of this many bytes is queued before each timed call: ~350 us of GPU work
# on an H100 that also evicts L2. It must outlast the
# host time of the timed call: eager decode-sized calls took up to ~120 us on the H100 host of
# 2026-11-21, where 256 MiB (~90 us) still let some of it through (p80 2x the p20). A GPU sleep
# instead gave 2-4x p20-p80 spreads.
QUEUE_AHEAD_BYTES = 2**30
_queue_ahead_buffers: dict[torch.device, torch.Tensor] = {}


def _queue_gpu_work(device: torch.device) -> None:
    buf = _queue_ahead_buffers.get(device)
    if buf is None:
        buf = _queue_ahead_buffers[device] = torch.empty(QUEUE_AHEAD_BYTES, dtype=torch.int8, device=device)
    buf.zero_()


def gpu_time_ms(fn: Callable[[], Any], device: torch.device, *, reps: int, warmup: int = 3) -> float:
    """Median GPU time in ms of ``fn()`` (CUDA), each rep queued behind the L2-evicting write of
    ``queue_ahead``: the kernels' time, without launch latency or host time. For GPU scripts that
    time one kernel call at a time (``scripts/gpu_decode_gemm_sweep.py``,
    ``scripts/bench_linear_head_kernel.py``)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _queue_gpu_work(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_interleaved(
    calls: dict[str, Callable[[int], Any]],
    device: torch.device,
    *,
    rounds: int,
    reps: int,
    copies: int = 1,
    queue_ahead: bool = False,
    host: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Per-call times in ms, the implementations interleaved round-robin in a rotated order.

    On CUDA every call is isolated: the device is synchronized before its start event, so the GPU
    is idle when the call is issued and the event pair spans the host time until its first kernel,
    its kernels, and the launch gaps it causes (what one eager call costs). ``queue_ahead``: see
    :class:`~rlkernel.bench.suite.Workload` (GPU time only). ``host``: a dict that receives, per
    implementation, each call's host time in ms (from its start to its return on the host: the
    Python, checks, allocations and launches of a call that does not wait for the GPU)."""
    names = list(calls)
    samples: dict[str, list[float]] = {n: [] for n in names}
    host_ms: dict[str, list[float]] = host if host is not None else {}
    for n in names:
        host_ms.setdefault(n, [])
    i = 0
    for r in range(rounds):
        shift = r % max(len(names), 1)
        for name in names[shift:] + names[:shift]:
            fn = calls[name]
            if device.type == "cuda":
                events = [
                    (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    for _ in range(reps)
                ]
                for start, end in events:
                    if queue_ahead:
                        _queue_gpu_work(device)
                    else:
                        torch.cuda.synchronize(device)  # isolated: nothing of the previous call queued
                    start.record()
                    t0 = time.perf_counter()
                    fn(i % copies)
                    t1 = time.perf_counter()
                    end.record()
                    host_ms[name].append((t1 - t0) * 1e3)
                    i += 1
                torch.cuda.synchronize(device)
                samples[name] += [start.elapsed_time(end) for start, end in events]
            else:
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn(i % copies)
                    samples[name].append((time.perf_counter() - t0) * 1e3)
                    host_ms[name].append(samples[name][-1])
                    i += 1
    return samples


def time_back_to_back(
    calls: dict[str, Callable[[int], Any]],
    device: torch.device,
    *,
    loop: int,
    reps: int,
    copies: int = 1,
) -> dict[str, list[float]]:
    """Per-call wall time in ms of ``loop`` calls issued back to back with one sync at the end, the
    way a training step issues its micro-batches: ``reps`` loops per implementation, interleaved
    in a rotated order, each started on an idle device. A call whose host time is shorter than
    its GPU time is hidden behind the previous call's kernels; one with a host sync inside is not.
    Each call's results are dropped before the next one (its memory is reused, as in a step)."""
    if loop < 1:
        raise ValueError(f"loop must be >= 1, got {loop}")
    names = list(calls)
    samples: dict[str, list[float]] = {n: [] for n in names}
    i = 0
    for r in range(reps):
        shift = r % max(len(names), 1)
        for name in names[shift:] + names[:shift]:
            fn = calls[name]
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(loop):
                fn(i % copies)
                i += 1
            synchronize(device)
            samples[name].append((time.perf_counter() - t0) * 1e3 / loop)
    return samples


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of a non-empty sample."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True)
class HostTimes:
    """Medians, in ms, over isolated calls (the device idle when each starts):

    * ``host_ms``: from the call's start to its return on the host. For a call that does not wait
      for the GPU this is its host time (Python, checks, allocations, launches), the time before
      which the GPU cannot have received the call's last kernel.
    * ``cpu_ms``: the thread's CPU time over the same interval; ``host_ms - cpu_ms`` is time the
      host spent blocked (a host sync inside the call, the GIL, a page fault). The two come from
      different clocks: for a call that never blocks ``cpu_ms`` may exceed ``host_ms`` by a few ns.
    * ``wall_ms``: from the call's start to the end of its GPU work (a sync after it).
    """

    host_ms: float
    cpu_ms: float
    wall_ms: float


def host_times_interleaved(
    calls: dict[str, Callable[[], Any]], device: torch.device, *, rounds: int, warmup: int = 1
) -> dict[str, HostTimes]:
    """:class:`HostTimes` of each call, the calls interleaved in ``rounds`` rounds in a rotated order
    (host drift hits all alike), each call started on a synchronized device."""
    names = list(calls)
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    host: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        shift = r % max(len(names), 1)
        for name in names[shift:] + names[:shift]:
            synchronize(device)
            t0, c0 = time.perf_counter(), time.thread_time()
            calls[name]()
            t1, c1 = time.perf_counter(), time.thread_time()
            synchronize(device)
            t2 = time.perf_counter()
            host[name].append((t1 - t0) * 1e3)
            cpu[name].append((c1 - c0) * 1e3)
            wall[name].append((t2 - t0) * 1e3)
    med = statistics.median
    return {n: HostTimes(med(host[n]), med(cpu[n]), med(wall[n])) for n in names}


def host_times(fn: Callable[[], Any], device: torch.device, *, reps: int, warmup: int = 3) -> HostTimes:
    """:class:`HostTimes` of ``reps`` isolated calls of ``fn`` after ``warmup`` calls."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    return host_times_interleaved({"fn": fn}, device, rounds=reps, warmup=warmup)["fn"]


def host_loop_us(
    fn: Callable[[], Any], device: torch.device, *, calls: int, loops: int = 5, warmup: int = 10
) -> float:
    """Host µs per call of ``calls`` calls issued in a loop without a sync (the loop's time before
    the sync that ends it, divided by ``calls``), median of ``loops`` loops. On operands small
    enough that the GPU keeps up, the cost of a launch path on the host (checks, launcher, Python)."""
    if calls < 1 or loops < 1:
        raise ValueError(f"calls and loops must be >= 1, got {calls} and {loops}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    per_call = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
        synchronize(device)
    return statistics.median(per_call)
