"""Where one call's time goes, for the profiling scripts (``scripts/profile_call.py``,
``scripts/profile_invariant.py``); the timing itself is :mod:`rlkernel.bench.timing`'s.

* :func:`kernel_timeline`: one call under ``torch.profiler``: each GPU kernel's start offset from
  the call's start on the host and its duration (so the GPU's idle time before the first kernel,
  before the first GEMM, and between kernels), and the host's blocking CUDA runtime calls.
* :func:`host_marks`: for named functions, when the host entered and left each one (first call
  inside the timed call) and when the GPU had finished the work queued by then (a CUDA event):
  how long the GPU waits for the host before each stage, without a profiler's overhead.
* :func:`cprofile_report`: cProfile of isolated calls (the queue drained between them, outside the
  profile, so no function's time includes waiting for the GPU).

The profiler adds host time of its own (a few µs per op), so a timeline's idle times are upper
bounds of the unprofiled call's; :func:`host_marks` and :func:`rlkernel.bench.timing.host_times`
measure without it. Importing this module touches no device.
"""

from __future__ import annotations

import cProfile
import importlib
import io
import pstats
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlkernel.bench.timing import synchronize

CALL = "rlkernel.bench.profiling.call"  # the record_function range around the profiled call
# Kernels that are GEMMs: cuBLAS (nvjet, cutlass, *gemm*), Triton's matmul kernels and the LM-head
# GEMMs with their log-softmax epilogues. A script may pass its own pattern.
GEMM_PATTERN = re.compile(r"gemm|nvjet|cutlass|xmma|matmul|linear_head_(stats|grad)_kernel", re.IGNORECASE)
# Host calls that wait for the device (or for memory the device may use).
BLOCKING = ("Synchronize", "Memcpy", "Malloc", "Free", "nonzero", "item")


@dataclass(frozen=True)
class Kernel:
    """One GPU kernel of a profiled call: start (µs after the call's start on the host), duration."""

    start_us: float
    dur_us: float
    name: str


@dataclass(frozen=True)
class Timeline:
    """The GPU kernels of one call in start order, the call's host duration, and its blocking host
    calls (name -> (count, total ms))."""

    kernels: tuple[Kernel, ...]
    host_us: float
    blocking: dict[str, tuple[int, float]] = field(default_factory=dict)

    @property
    def first_start_us(self) -> float | None:
        """The GPU's idle time before the call's first kernel (None: no kernel)."""
        return self.kernels[0].start_us if self.kernels else None

    @property
    def end_us(self) -> float | None:
        return max(k.start_us + k.dur_us for k in self.kernels) if self.kernels else None

    @property
    def busy_us(self) -> float:
        """Time with at least one kernel running (overlapping kernels counted once)."""
        busy, reach = 0.0, None
        for k in self.kernels:
            end = k.start_us + k.dur_us
            if reach is None or k.start_us >= reach:
                busy += k.dur_us
                reach = end
            elif end > reach:
                busy += end - reach
                reach = end
        return busy

    @property
    def idle_between_us(self) -> float:
        """GPU idle time between the first kernel's start and the last one's end."""
        if not self.kernels:
            return 0.0
        return self.end_us - self.kernels[0].start_us - self.busy_us

    def first(self, pattern: re.Pattern = GEMM_PATTERN) -> Kernel | None:
        """The first kernel whose name matches ``pattern`` (default: the first GEMM)."""
        return next((k for k in self.kernels if pattern.search(k.name)), None)

    def gaps(self, min_us: float = 30.0) -> list[tuple[float, str, str]]:
        """GPU idle gaps longer than ``min_us`` between kernels, ``(µs, kernel before, kernel after)``,
        longest first."""
        out, reach, last = [], None, ""
        for k in self.kernels:
            if reach is not None and k.start_us - reach > min_us:
                out.append((k.start_us - reach, last, k.name))
            if reach is None or k.start_us + k.dur_us >= reach:
                reach, last = k.start_us + k.dur_us, k.name
        return sorted(out, reverse=True)

    def by_name(self) -> list[tuple[str, int, float]]:
        """``(kernel name, launches, total ms)``, largest total first."""
        totals: dict[str, list] = {}
        for k in self.kernels:
            entry = totals.setdefault(k.name, [0, 0.0])
            entry[0] += 1
            entry[1] += k.dur_us / 1e3
        return sorted(((n, c, t) for n, (c, t) in totals.items()), key=lambda x: -x[2])

    def by_class(self) -> dict[str, float]:
        """Total ms per :func:`kernel_class`."""
        out: dict[str, float] = {}
        for k in self.kernels:
            cls = kernel_class(k.name)
            out[cls] = out.get(cls, 0.0) + k.dur_us / 1e3
        return out


def kernel_class(name: str) -> str:
    """A coarse class of a kernel by its name: gemm, log-softmax forward / backward, token loss,
    copy/fill, index, other."""
    n = name.lower()
    if GEMM_PATTERN.search(n):
        return "gemm"
    if "fwd" in n and ("logprob" in n or "lse" in n):
        return "logsoftmax_fwd"
    if ("bwd" in n and ("logprob" in n or "grad" in n)) or "shifted_grad" in n:
        return "logsoftmax_bwd"
    if "token_loss" in n or "coef" in n:
        return "token_loss"
    if any(k in n for k in ("copy", "cast", "fill", "zero", "memset", "memcpy")):
        return "copy/fill"
    if any(k in n for k in ("index", "scatter", "gather", "nonzero", "masked")):
        return "index"
    return "other"


def timeline_from_events(events: Sequence[Any]) -> Timeline:
    """A :class:`Timeline` from ``torch.profiler`` events that contain one :data:`CALL` range."""
    cpu, dev = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    call = next(e for e in events if e.name == CALL and e.device_type == cpu)
    t0 = call.time_range.start
    kernels = sorted(
        (
            Kernel(e.time_range.start - t0, e.time_range.elapsed_us(), e.name)
            for e in events
            # the record_function range shows on the GPU too
            if e.device_type == dev and e.time_range.elapsed_us() > 0 and e.name != CALL
        ),
        key=lambda k: k.start_us,
    )
    blocking: dict[str, list] = {}
    for e in events:
        if e.device_type == cpu and any(b in e.name for b in BLOCKING):
            entry = blocking.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.time_range.elapsed_us() / 1e3
    totals = {k: (c, t) for k, (c, t) in blocking.items()}
    return Timeline(tuple(kernels), call.time_range.elapsed_us(), totals)


def kernel_timeline(fn: Callable[[], Any], device: torch.device) -> Timeline:
    """One call of ``fn`` under ``torch.profiler`` after one unprofiled call (compilation, caches),
    the device synchronized before it. On a CPU device there are no GPU kernels."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize(device)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        with torch.profiler.record_function(CALL):
            fn()
        synchronize(device)
    return timeline_from_events(prof.events())


@dataclass(frozen=True)
class Mark:
    """ms from the start of an isolated call: the host's first entry into a function and that
    entry's return, and when the GPU had done the work queued by that return (None on the CPU)."""

    enter_ms: float
    exit_ms: float
    gpu_done_ms: float | None


def _resolve(target: str) -> tuple[Any, str] | None:
    """``"pkg.module:attr"`` or ``"pkg.module:Class.method"`` -> (owner, attribute name)."""
    module_name, _, attr = target.partition(":")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError:
        return None
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part, None)
    if owner is None or not callable(getattr(owner, name, None)):
        return None
    return owner, name


def host_marks(
    fn: Callable[[], Any], targets: Sequence[str], device: torch.device, *, reps: int = 10
) -> tuple[dict[str, Mark], list[str]]:
    """Per target (``"module:function"`` or ``"module:Class.method"``), the median :class:`Mark`
    of its first call inside each of ``reps`` isolated calls of ``fn``; also ``"(call end)"``.
    Returns ``(marks, targets that do not resolve)``. The targets are wrapped for the duration and
    restored after (an error included); only calls that look the name up on its module or class
    are seen, not a binding made earlier by ``from module import function``."""
    cuda = device.type == "cuda"
    seen: dict[str, tuple[float, float, Any]] = {}
    t0 = [0.0]
    undo, missing = [], []
    for target in targets:
        resolved = _resolve(target)
        if resolved is None:
            missing.append(target)
            continue
        owner, name = resolved
        func = getattr(owner, name)  # on a class: the plain function, or bound for a classmethod
        raw = vars(owner).get(name) if isinstance(owner, type) else func

        def wrapped(*args, _func=func, _key=target, **kwargs):
            enter = time.perf_counter() - t0[0]
            out = _func(*args, **kwargs)
            if _key not in seen:
                event = torch.cuda.Event(enable_timing=True) if cuda else None
                if event is not None:
                    event.record()
                seen[_key] = (enter, time.perf_counter() - t0[0], event)
            return out

        descriptor = isinstance(raw, (staticmethod, classmethod))  # func is already unbound / bound
        setattr(owner, name, staticmethod(wrapped) if descriptor else wrapped)
        undo.append((owner, name, raw))
    rows: dict[str, list[tuple[float, float, float | None]]] = {}
    try:
        for _ in range(reps):
            synchronize(device)
            seen.clear()
            start = torch.cuda.Event(enable_timing=True) if cuda else None
            end = torch.cuda.Event(enable_timing=True) if cuda else None
            t0[0] = time.perf_counter()
            if start is not None:
                start.record()
            fn()
            if end is not None:
                end.record()
            synchronize(device)
            seen["(call end)"] = (time.perf_counter() - t0[0], time.perf_counter() - t0[0], end)
            for key, (enter, leave, event) in seen.items():
                gpu = start.elapsed_time(event) if start is not None else None
                rows.setdefault(key, []).append((enter * 1e3, leave * 1e3, gpu))
    finally:
        for owner, name, raw in reversed(undo):
            if raw is None:  # inherited by the class named: remove the wrapper, the base's shows again
                delattr(owner, name)
            else:
                setattr(owner, name, raw)
    med = statistics.median
    marks = {
        key: Mark(med(r[0] for r in v), med(r[1] for r in v), None if not cuda else med(r[2] for r in v))
        for key, v in rows.items()
    }
    return marks, missing


def cprofile_report(
    fn: Callable[[], Any], device: torch.device, *, calls: int, restrict: str = "rlkernel", top: int = 25
) -> str:
    """cProfile of ``calls`` isolated calls: the functions whose path contains ``restrict`` by
    cumulative time, then every function by own time (totals over the calls)."""
    prof = cProfile.Profile()
    for _ in range(calls):
        synchronize(device)
        prof.enable()
        fn()
        prof.disable()
    synchronize(device)
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats(restrict, top)
    stats.sort_stats("tottime").print_stats(top)
    return f"(totals over {calls} calls)\n" + out.getvalue()
