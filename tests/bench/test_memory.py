"""rlkernel.bench.memory: the allocator-trace replay behind trl_trainer_compare's --memory-breakdown."""

from __future__ import annotations

from rlkernel.bench import memory


def _frame(path, line, name):
    return {"filename": path, "line": line, "name": name}


def _alloc(addr, size, *frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def _free(addr, action="free_requested"):
    return {"action": action, "addr": addr}


OURS = _frame("/x/src/rlkernel/ops/_linear_engine.py", 300, "__init__")
TORCH = _frame("/venv/site-packages/torch/nn/functional.py", 10, "linear")
TRL = _frame("/venv/site-packages/trl/kernels/chunked_logprob.py", 77, "forward")


def test_blocks_alive_at_the_peak_not_at_the_end():
    trace = [
        _alloc(1, 100, TORCH, OURS),  # named by the innermost owned frame, not torch's
        _alloc(2, 300, TRL),
        _free(2),
        _free(2, "free_completed"),  # a second free of the same block counts once
        _alloc(3, 50),
        _alloc(4, 500, OURS),  # the peak: 1, 3, 4 alive (650)
        _free(4),
        _free(1),
        _alloc(5, 10, TRL),
    ]
    peak, blocks = memory.live_at_peak(trace)
    assert peak == 650
    assert sorted(b.size for b in blocks) == [50, 100, 500]
    where = {b.size: b.where for b in blocks}
    assert where[100] == where[500] == "rlkernel/ops/_linear_engine.py:300 __init__"
    assert where[50] == memory.NO_FRAME
    assert memory.group(blocks) == [(600, 2, where[100]), (50, 1, memory.NO_FRAME)]
    assert memory.group(blocks, top=1) == [(600, 2, where[100])]


def test_frees_of_blocks_from_before_the_recording_are_ignored():
    # Block 9 was allocated before the recording: its free must not lower the running total.
    trace = [_free(9), _alloc(1, 40, TRL), _alloc(2, 30, TRL), _free(1), _alloc(3, 5, TRL)]
    peak, blocks = memory.live_at_peak(trace)
    assert peak == 70 and sorted(b.size for b in blocks) == [30, 40]
    assert blocks[0].where == "trl/kernels/chunked_logprob.py:77 forward"


def test_empty_trace_and_cpu_recorder():
    assert memory.live_at_peak([]) == (0, [])
    with memory.Recorder() as rec:  # no CUDA here: records nothing
        pass
    assert rec.breakdown() == {"peak_bytes": 0, "sites": []}
