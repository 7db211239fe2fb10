"""Timing primitives of the benchmark harness: interleaved per-call CUDA-event timing of isolated
calls, GPU time of small calls (``queue_ahead``), back-to-back loops (a training step's call
pattern), L2 input rotation, quantiles. :mod:`rlkernel.bench.harness` runs workloads with them (and
re-exports them); scripts that time one call at a time use :func:`gpu_time_ms` directly.
See the harness module docstring for the method.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
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
    time one call at a time (``scripts/gpu_decode_gemm_sweep.py``)."""
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
) -> dict[str, list[float]]:
    """Per-call times in ms, the implementations interleaved round-robin in a rotated order.

    On CUDA every call is isolated: the device is synchronized before its start event, so the GPU
    is idle when the call is issued and the event pair spans the host time until its first kernel,
    its kernels, and the launch gaps it causes (what one eager call costs). ``queue_ahead``: see
    :class:`~rlkernel.bench.suite.Workload` (GPU time only)."""
    names = list(calls)
    samples: dict[str, list[float]] = {n: [] for n in names}
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
                    fn(i % copies)
                    end.record()
                    i += 1
                torch.cuda.synchronize(device)
                samples[name] += [start.elapsed_time(end) for start, end in events]
            else:
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn(i % copies)
                    samples[name].append((time.perf_counter() - t0) * 1e3)
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
