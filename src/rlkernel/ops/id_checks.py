"""Token-id range checks that cost the GPU queue no host sync: the check runs on the device, its
result comes back through pinned memory, and a bad id raises at a later, well-defined point.

Why: the default ``validate=True`` of the log-prob ops and ``fused_policy_loss`` used to read the
check's result at once (``bool(bad.any())``): one host sync per call, which stalls the launch queue
whenever the CPU runs ahead of the GPU (a training step's normal state). Now, on a CUDA device:

    call k      one kernel (``rlkernel.kernels.ids``) counts the out-of-range ids and finds the first
                one, queued after the call's own kernels; the two numbers are copied (non-blocking)
                into pinned host memory, with an event behind them
    later       the error of call k is raised (``ValueError``, naming the argument, the count and
                the first bad id) by the first of:
                  * any later call of a checking rlkernel op (``token_logprobs``,
                    ``linear_token_logprobs``, ``fused_policy_loss``) made after the GPU finished
                    call k's check (the event is polled, never waited on),
                  * :func:`raise_pending_errors` (``rk.raise_pending_errors()``), which waits for
                    every pending check: call it where the step synchronizes anyway (logging).

Meanwhile nothing silently wrong comes out of call k: the kernels give an out-of-range id a NaN
log-prob, so the loss and the gradients are NaN. On the CPU (and for inputs that take the reference
backend on CUDA, where an out-of-range gather would be a device-side assert) the check is read at
once and raises inside the call, as before.

State: one process-wide list of pending checks (behind a lock: backward runs on autograd's device
threads). It holds a pinned two-int64 buffer and an event per unfinished call, and is emptied as
the checks complete and are read; read buffers are kept for reuse (pinned allocation is slow).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rlkernel import _validate as check


@dataclass(frozen=True)
class _Pending:
    what: str  # the argument, as the error names it
    vocab_size: int
    ignore_index: int | None
    host: torch.Tensor  # pinned int64: count, first-bad key (rlkernel.kernels.ids) at host[offset:]
    done: torch.cuda.Event | None  # None: read already (report_read), ready
    offset: int = 0
    device: int = -1  # the CUDA device index of ``done`` (-1: none)


_lock = threading.Lock()
_pending: list[_Pending] = []
# Pinned buffers (by length) and events already read, reused: a pinned allocation and an event's
# creation are each tens of µs of host time on the H100 host, per call otherwise.
_free_buffers: dict[int, list[torch.Tensor]] = {}
_free_events: dict[int, list[torch.cuda.Event]] = {}  # by device: an event binds to its first one
# The Stream object of each (stream id, device, type) seen: ``torch.cuda.current_stream()`` builds a
# new one through ~8 Python calls per call (~20 µs of the H200 host's time per check).
_streams: dict[tuple[int, int, int], torch.cuda.Stream] = {}


def raise_pending_errors(wait: bool = True) -> None:
    """Raise the error of the first pending id check that found a bad id (see the module docstring).

    Args:
        wait: ``True`` (the public default) waits for every pending check (one host sync on their
            events); ``False`` reads only the checks the GPU has already finished (no sync).

    Raises:
        ValueError: an earlier call had active token ids outside ``[0, V)``; the message names that
            call's argument, the count and the first bad id. Each check raises at most once.
        TypeError: ``wait`` is not a bool.
    """
    check.boolean("wait", wait)
    with _lock:
        ready = [p for p in _pending if wait or p.done is None or p.done.query()]
        if not ready:
            return
        for p in ready:
            _pending.remove(p)
    for p in ready:
        if wait and p.done is not None:
            p.done.synchronize()
        count, key = (int(v) for v in p.host.tolist()[p.offset : p.offset + 2])
        if p.done is not None:
            with _lock:
                _free_buffers.setdefault(p.host.numel(), []).append(p.host)
                _free_events.setdefault(p.device, []).append(p.done)
        if count:
            from rlkernel.kernels.ids import decode_first

            first = decode_first(key)[1]
            raise ValueError(check.token_ids_message(p.what, count, p.vocab_size, p.ignore_index, first))


@contextlib.contextmanager
def token_ids_checked(
    what: str,
    ids: torch.Tensor,
    vocab_size: int,
    ignore_index: int | None,
    *,
    defer: bool,
    active: torch.Tensor | None = None,
) -> Iterator[None]:
    """:func:`check_token_ids` around a block that launches the caller's kernels: before the block
    when the check reads its result at once (not ``defer``, or ids off CUDA: it raises before any
    kernel reads a bad id); after it when deferred, so that its launches queue behind the block's
    kernels instead of delaying the first of them (no sync either way). Not run if the block raises."""
    late = defer and ids.device.type == "cuda"
    if not late:
        check_token_ids(what, ids, vocab_size, ignore_index, defer=defer, active=active)
    yield
    if late:
        check_token_ids(what, ids, vocab_size, ignore_index, defer=defer, active=active)


def check_token_ids(
    what: str,
    ids: torch.Tensor,
    vocab_size: int,
    ignore_index: int | None,
    *,
    defer: bool,
    active: torch.Tensor | None = None,
) -> None:
    """Every id is in ``[0, vocab_size)`` or equals ``ignore_index`` (``None``: none is exempt).

    With ``defer`` and ids on CUDA the check is deferred (no host sync; see the module docstring)
    and the errors of earlier finished checks are raised first; otherwise it raises here.

    Args:
        what: names the argument in the error, e.g. ``"token_ids"``.
        ids: int tensor of any shape (on the device of the logits).
        defer: the caller's kernels give an out-of-range id a NaN result (the Triton path); the
            reference path must check at once (an out-of-range gather is a device-side assert).
        active: optional bool mask, the shape of ``ids``: only these positions are checked.

    Inside CUDA-graph capture nothing is checked (no event can be polled there); the NaN that the
    kernels give an out-of-range id still marks the result.
    """
    if not defer or ids.device.type != "cuda":
        checked = ids if active is None else torch.where(active, ids, 0)
        check.token_ids_in_range(what, checked, vocab_size, ignore_index)
        return
    if torch.cuda.is_current_stream_capturing():
        return
    raise_pending_errors(wait=False)
    if ids.numel() == 0:
        return
    from rlkernel.kernels.ids import bad_id_stats

    stats = bad_id_stats(ids, vocab_size, ignore_index, active)
    _queue(what, stats, vocab_size, ignore_index)


def defer_result(
    what: str, stats: torch.Tensor, vocab_size: int, ignore_index: int | None, offset: int = 0
) -> None:
    """Defer the result of an id check that a caller's own kernel made (``stats``: int64 on CUDA
    holding, at ``offset``, ``rlkernel.kernels.ids``' two numbers: the count of bad ids and the
    first one's key; copied whole, no slicing op): the errors of earlier finished checks are raised
    first, then this one is read later (see the module docstring). Nothing is queued inside
    CUDA-graph capture. Off CUDA (the CPU interpreter) it is read at once and raises here.

    Raises:
        ValueError: ``stats`` off CUDA counts a bad id.
    """
    if not stats.is_cuda:
        count, key = (int(v) for v in stats.tolist()[offset : offset + 2])
        if count:
            from rlkernel.kernels.ids import decode_first

            first = decode_first(key)[1]
            raise ValueError(check.token_ids_message(what, count, vocab_size, ignore_index, first))
        return
    if torch.cuda.is_current_stream_capturing():
        return
    raise_pending_errors(wait=False)
    _queue(what, stats, vocab_size, ignore_index, offset)


def report_read(
    what: str, count: int, key: int, vocab_size: int, ignore_index: int | None, *, defer: bool
) -> None:
    """An id check whose two numbers (``rlkernel.kernels.ids``' count and first-bad key) the caller
    read on the host together with a value it had to read anyway (no sync of its own): raised as a
    deferred check's would be. With ``defer`` (CUDA, Triton path) the errors of earlier finished
    checks are raised first and a bad count is raised by a later call (see the module docstring);
    without, a bad count raises here.

    Raises:
        ValueError: ``count`` > 0 and not ``defer``, or an earlier deferred check failed.
    """
    if defer:
        raise_pending_errors(wait=False)
    if not count:
        return
    if not defer:
        from rlkernel.kernels.ids import decode_first

        raise ValueError(check.token_ids_message(what, count, vocab_size, ignore_index, decode_first(key)[1]))
    with _lock:
        _pending.append(_Pending(what, vocab_size, ignore_index, torch.tensor([count, key]), None))


def _queue(
    what: str, stats: torch.Tensor, vocab_size: int, ignore_index: int | None, offset: int = 0
) -> None:
    """Copy ``stats`` into pinned memory behind the queued kernels and remember the check."""
    host = host_buffer(stats.numel())
    host.copy_(stats, non_blocking=True)
    _remember(what, host, vocab_size, ignore_index, offset, stats.get_device())


def host_buffer(n: int) -> torch.Tensor:
    """A pinned int64 ``[n]`` buffer for a deferred check's result (from the pool, else new). A
    kernel may write it directly (pinned memory is mapped into the GPU's address space under
    unified addressing: the same pointer), then :func:`defer_written` queues the check."""
    with _lock:
        free = _free_buffers.get(n)
        host = free.pop() if free else None
    return host if host is not None else torch.empty(n, dtype=torch.int64, pin_memory=True)


def defer_written(
    what: str, host: torch.Tensor, vocab_size: int, ignore_index: int | None, device: int
) -> None:
    """Queue the check whose kernel, already queued on the current stream of CUDA device ``device``
    (an index), writes its count and first-bad key into the pinned ``host`` ``[2]`` itself (no
    copy): earlier finished checks are raised first. Never inside CUDA-graph capture: the caller
    takes no buffer there (a replayed graph must not write into a pooled buffer;
    ``ops.device_plan_loss``), so this does not ask again (host time: one CUDA query per call)."""
    raise_pending_errors(wait=False)
    _remember(what, host, vocab_size, ignore_index, 0, device)


def _remember(
    what: str, host: torch.Tensor, vocab_size: int, ignore_index: int | None, offset: int, device: int
) -> None:
    """An event behind the work queued on ``device``'s current stream, and the check in the
    pending list."""
    with _lock:
        free = _free_events.get(device)
        done = free.pop() if free else None
    if done is None:
        done = torch.cuda.Event()
    done.record(_current_stream(device))
    with _lock:
        _pending.append(_Pending(what, vocab_size, ignore_index, host, done, offset, device))


def _current_stream(device: int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)``, the Stream object cached per stream."""
    key = torch._C._cuda_getCurrentStream(device)  # (stream id, device index, device type)
    stream = _streams.get(key)
    if stream is None:
        stream = _streams[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    return stream
