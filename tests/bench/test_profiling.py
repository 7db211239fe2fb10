"""The profiling primitives the scripts share: host timing (``rlkernel.bench.timing``), the kernel
timeline's arithmetic, host marks and cProfile (``rlkernel.bench.profiling``), on the CPU."""

from __future__ import annotations

import time

import pytest
import torch

from rlkernel.bench import profiling, timing
from rlkernel.bench.profiling import Kernel, Timeline

CPU = torch.device("cpu")


def _sleep_ms(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def _spin_cpu_ms(ms: float) -> None:
    """Busy until this thread has used ``ms`` of CPU time (however loaded the machine is)."""
    end = time.thread_time() + ms / 1e3
    while time.thread_time() < end:
        pass


def test_host_times_split_host_and_wall():
    t = timing.host_times(lambda: _spin_cpu_ms(2.0), CPU, reps=3, warmup=1)
    # CPU time and wall time come from two clocks: a call that never blocks may read a few ns
    # more CPU than wall time (seen on CI: 2.001627 vs 2.001626999 ms). Slack of one clock tick.
    clock_slack_ms = 0.05
    assert t.cpu_ms >= 2.0
    assert t.cpu_ms <= t.host_ms + clock_slack_ms
    assert t.host_ms <= t.wall_ms
    idle = timing.host_times(lambda: time.sleep(0.004), CPU, reps=3, warmup=0)
    assert idle.host_ms >= 4.0 and idle.cpu_ms < idle.host_ms / 2  # a blocked host: no CPU time


def test_host_times_interleaved_times_each_call():
    calls = {"short": lambda: _sleep_ms(0.5), "long": lambda: _sleep_ms(3.0)}
    out = timing.host_times_interleaved(calls, CPU, rounds=2, warmup=0)
    assert set(out) == {"short", "long"}
    assert out["long"].host_ms > out["short"].host_ms + 1.5


def test_time_interleaved_gives_each_calls_host_time():
    """``time_interleaved(host=...)``: one host time per timed call, per implementation, in order."""
    calls = {"short": lambda i: _sleep_ms(0.5), "long": lambda i: _sleep_ms(3.0)}
    host: dict[str, list[float]] = {}
    out = timing.time_interleaved(calls, CPU, rounds=2, reps=2, host=host)
    assert set(host) == {"short", "long"} and all(len(v) == 4 for v in host.values())
    # lower bounds only (a call can take longer on a loaded machine, never less than its wait)
    assert min(host["long"]) >= 3.0 and min(host["short"]) >= 0.5
    assert host == out  # on the CPU the host time is the call's time


def test_host_loop_us_is_per_call():
    us = timing.host_loop_us(lambda: _sleep_ms(0.5), CPU, calls=4, loops=2, warmup=1)
    assert 500 <= us < 5000


@pytest.mark.parametrize("kwargs", [{"calls": 0}, {"calls": 2, "loops": 0}])
def test_host_loop_us_rejects_empty_loops(kwargs):
    with pytest.raises(ValueError, match="calls and loops"):
        timing.host_loop_us(lambda: None, CPU, **kwargs)


def test_host_times_rejects_no_reps():
    with pytest.raises(ValueError, match="reps"):
        timing.host_times(lambda: None, CPU, reps=0)


def test_timeline_idle_busy_and_first_gemm():
    tl = Timeline(
        (
            Kernel(100.0, 10.0, "triton_masked_ids_kernel"),
            Kernel(150.0, 50.0, "_linear_head_stats_kernel"),
            Kernel(180.0, 40.0, "elementwise_copy"),  # overlaps the GEMM by 20 µs: counted once
            Kernel(300.0, 20.0, "nvjet_gemm"),
        ),
        host_us=250.0,
    )
    assert tl.first_start_us == 100.0 and tl.end_us == 320.0
    assert tl.busy_us == pytest.approx(10 + 70 + 20)
    assert tl.idle_between_us == pytest.approx(220 - 100)
    assert tl.first().name == "_linear_head_stats_kernel"  # the first GEMM, not the first kernel
    assert tl.gaps(min_us=30) == [(80.0, "elementwise_copy", "nvjet_gemm"), (40.0, "triton_masked_ids_kernel",
                                                                             "_linear_head_stats_kernel")]
    assert tl.by_name()[0] == ("_linear_head_stats_kernel", 1, pytest.approx(0.05))
    assert tl.by_class() == pytest.approx({"index": 0.01, "gemm": 0.07, "copy/fill": 0.04})
    empty = Timeline((), host_us=5.0)
    assert empty.first_start_us is None and empty.busy_us == 0.0 and empty.idle_between_us == 0.0


def test_kernel_timeline_on_the_cpu_has_the_call_and_no_kernels():
    x = torch.randn(64, 64)
    tl = profiling.kernel_timeline(lambda: (x @ x).sum(), CPU)
    assert tl.kernels == () and tl.host_us > 0


def test_host_marks_time_the_stages_and_restore_the_functions():
    original_quantile, original_by_name = timing.quantile, Timeline.by_name
    tl = Timeline((Kernel(0.0, 1.0, "k"),), host_us=1.0)

    def call():
        _sleep_ms(2.0)
        timing.quantile([1.0, 2.0], 0.5)  # looked up on the module: seen
        _sleep_ms(1.0)
        tl.by_name()  # a method, looked up on the class: seen

    targets = ["rlkernel.bench.timing:quantile", "rlkernel.bench.profiling:Timeline.by_name",
               "rlkernel.bench.timing:no_such_function", "no_such_module:f"]  # fmt: skip
    marks, missing = profiling.host_marks(call, targets, CPU, reps=2)
    assert missing == targets[2:]
    q, b, end = marks[targets[0]], marks[targets[1]], marks["(call end)"]
    assert 2.0 <= q.enter_ms <= q.exit_ms < b.enter_ms <= end.exit_ms
    assert b.enter_ms - q.exit_ms >= 1.0
    assert q.gpu_done_ms is None  # no device events on the CPU
    assert timing.quantile is original_quantile and Timeline.by_name is original_by_name


def test_host_marks_restore_after_an_error():
    original = timing.quantile

    def call():
        timing.quantile([1.0], 0.5)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        profiling.host_marks(call, ["rlkernel.bench.timing:quantile"], CPU, reps=1)
    assert timing.quantile is original


def test_cprofile_report_names_the_functions():
    text = profiling.cprofile_report(lambda: timing.quantile([3.0, 1.0, 2.0], 0.5), CPU, calls=3)
    assert text.startswith("(totals over 3 calls)") and "quantile" in text
