"""What is allocated at the peak of a stretch of CUDA work: a ``torch.cuda.memory`` history replayed.

    from rlkernel.bench.memory import Recorder

    with Recorder() as rec:                  # CUDA only; no-op elsewhere
        step()
    for size, count, where in rec.breakdown(top=12)["sites"]:
        print(size, count, where)

:func:`live_at_peak` replays the allocator's trace (``torch.cuda.memory._snapshot()['device_traces']``:
``alloc`` adds a block, ``free_requested``/``free_completed`` removes it) and returns the blocks alive
when the bytes allocated *during the recording* peaked; :func:`group` sums them by where they were
allocated (the innermost Python frame in rlkernel, TRL, transformers or the caller's script, else
the innermost frame; allocations with no Python frame — autograd's C++ backward — as one row).
Used by ``scripts/trl_trainer_compare.py --memory-breakdown``; touches no device on import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

# Frames worth naming: the first (innermost) frame whose file path contains one of these.
OWNERS = ("rlkernel/", "trl/", "transformers/", "scripts/")
NO_FRAME = "(no Python frame: autograd's C++ backward or a C++ op)"


@dataclasses.dataclass(frozen=True)
class Block:
    """One allocation alive at the peak: its bytes and where it was made."""

    size: int
    where: str


def _where(frames: list[dict]) -> str:
    if not frames:
        return NO_FRAME
    for f in frames:
        name = f.get("filename", "")
        if any(o in name for o in OWNERS):
            short = name.split("site-packages/")[-1].split("/src/")[-1]
            return f"{short}:{f.get('line')} {f.get('name')}"
    f = frames[0]
    return f"{f.get('filename')}:{f.get('line')} {f.get('name')}"


def live_at_peak(trace: Iterable[dict]) -> tuple[int, list[Block]]:
    """``(peak bytes, blocks alive then)`` over the allocations made during ``trace`` (one device's
    events in order). A block freed twice (``free_requested`` then ``free_completed``) counts once."""
    events = list(trace)
    live: dict[int, tuple[int, list]] = {}
    cur = peak = 0
    peak_at = -1
    for i, e in enumerate(events):
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            live[addr] = (e["size"], e.get("frames", []))
            cur += e["size"]
            if cur > peak:
                peak, peak_at = cur, i
        elif action in ("free_requested", "free_completed") and addr in live:
            cur -= live.pop(addr)[0]
    live.clear()
    for e in events[: peak_at + 1]:
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            live[addr] = (e["size"], e.get("frames", []))
        elif action in ("free_requested", "free_completed"):
            live.pop(addr, None)
    return peak, [Block(size, _where(frames)) for size, frames in live.values()]


def group(blocks: list[Block], top: int = 12) -> list[tuple[int, int, str]]:
    """``(bytes, count, where)`` per allocation site, largest first, the first ``top``."""
    sums: dict[str, list[int]] = {}
    for b in blocks:
        s = sums.setdefault(b.where, [0, 0])
        s[0] += b.size
        s[1] += 1
    rows = sorted(((v[0], v[1], k) for k, v in sums.items()), reverse=True)
    return rows[:top]


class Recorder:
    """Records the allocator's history on the current CUDA device while active (``stacks='python'``),
    then holds the snapshot's trace; nothing on a machine without CUDA."""

    def __init__(self, max_entries: int = 500_000) -> None:
        self.max_entries = max_entries
        self.trace: list[dict] = []

    def __enter__(self) -> Recorder:
        if torch.cuda.is_available():
            torch.cuda.memory._record_memory_history(max_entries=self.max_entries, stacks="python")
        return self

    def __exit__(self, *exc) -> None:
        if not torch.cuda.is_available():
            return
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        dev = torch.cuda.current_device()
        traces = snap.get("device_traces", [])
        self.trace = traces[dev] if dev < len(traces) else []

    def breakdown(self, top: int = 12) -> dict:
        """``{"peak_bytes": ..., "sites": [(bytes, count, where), ...]}`` of the recorded stretch."""
        peak, blocks = live_at_peak(self.trace)
        return {"peak_bytes": peak, "sites": group(blocks, top)}
