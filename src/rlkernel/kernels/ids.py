"""Token-id kernels of one launch each: ``bad_id_stats`` finds out-of-range token ids (their count
and the first one) for a check that must not read anything on the host (``rlkernel.ops.id_checks``);
``masked_ids`` turns a loss call's token ids and mask into the kernels' ids and the active mask;
``active_rows`` is padding compaction's index (the positions of the ids that are not
``ignore_index``, and their count) for the linear path (``rlkernel.ops._linear_rows``).

Why a kernel: the same check in torch ops (compare, mask, sum, argmax, index, cat) is ~9 launches,
~190 us of host time per call on the H100 host (torch 2.11, 2026-11-24); this is one launch on a
two-int64 buffer cloned from a cached template.

Output ``stats`` int64 [2]: ``stats[0]`` = the number of bad ids, ``stats[1]`` = a key whose high 32
bits are the flat index of the first bad id and whose low 32 bits are that id clamped to int32,
offset by 2^31 (``decode_first``); ``INT64_MAX`` when there is none. Blocks merge with
``atomic_add`` / ``atomic_min``: integer atomics, so the result does not depend on the block order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels._launch import FastLauncher, cdiv
from rlkernel.kernels._launch import device_guard as _device_guard

BLOCK = 1024
NO_BAD_ID = 2**63 - 1
_INT32_OFFSET = 2**31


@triton.jit
def bad_id_key(y, index):
    """The first-bad key of id ``y`` (int64) at flat index ``index`` (int64): ``index`` in the high 32
    bits, ``y`` clamped to int32 and offset by 2^31 in the low 32 (the module docstring's layout)."""
    low = tl.minimum(tl.maximum(y, -2147483648), 2147483647) + 2147483648
    return (index << 32) | low


@triton.jit
def count_bad_id(stats_ptr, row, y, active, vocab_size):
    """The id check of one row's id ``y`` inside a row kernel: when active and outside
    ``[0, vocab_size)``, count it and keep the smallest key (``stats_ptr``: the module docstring's
    two int64, initialized to 0 and ``NO_BAD_ID``) by integer atomics: the result does not depend on
    the programs' order."""
    if active & ((y < 0) | (y >= vocab_size)):
        tl.atomic_add(stats_ptr, 1)
        tl.atomic_min(stats_ptr + 1, bad_id_key(y, row))


@triton.jit(do_not_specialize=["vocab_size", "ignore_index"])
def _bad_ids_kernel(
    # output
    stats_ptr,
    # inputs
    ids_ptr,
    active_ptr,
    # sizes and runtime scalars
    n,
    vocab_size,
    ignore_index,
    # meta
    HAS_ACTIVE: tl.constexpr,
    HAS_IGNORE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < n
    y = tl.load(ids_ptr + offs, mask=in_range, other=0).to(tl.int64)
    bad = in_range & ((y < 0) | (y >= vocab_size))
    if HAS_IGNORE:
        bad = bad & (y != ignore_index)
    if HAS_ACTIVE:
        bad = bad & (tl.load(active_ptr + offs, mask=in_range, other=0) != 0)
    count = tl.sum(bad.to(tl.int64), axis=0)
    key = tl.min(tl.where(bad, bad_id_key(y, offs), 9223372036854775807), axis=0)
    if count > 0:
        tl.atomic_add(stats_ptr, count)
        tl.atomic_min(stats_ptr + 1, key)


_launch = FastLauncher(_bad_ids_kernel)
_templates: dict[torch.device, torch.Tensor] = {}


def bad_id_stats(
    ids: torch.Tensor, vocab_size: int, ignore_index: int | None, active: torch.Tensor | None
) -> torch.Tensor:
    """``stats`` int64 [2] on ``ids.device`` (see the module docstring) for the flat ids: bad = outside
    ``[0, vocab_size)``, not ``ignore_index`` (``None``: none exempt), and ``active`` (a bool
    tensor of ``ids``' shape; ``None``: every position). Asynchronous: nothing is read on the host
    (the template's first upload per device aside)."""
    template = _templates.get(ids.device)
    if template is None:  # one upload per device, the first call only
        template = _templates[ids.device] = torch.tensor([0, NO_BAD_ID], dtype=torch.int64, device=ids.device)
    stats = template.clone()
    flat = ids.reshape(-1)
    n = flat.numel()
    if n == 0:
        return stats
    act = active.reshape(-1) if active is not None else flat
    with _device_guard(flat):
        _launch(
            (cdiv(n, BLOCK),),
            (stats, flat, act, n, int(vocab_size), int(ignore_index) if ignore_index is not None else 0),
            {"HAS_ACTIVE": active is not None, "HAS_IGNORE": ignore_index is not None, "BLOCK": BLOCK},
            {"num_warps": 4},
        )
    return stats


def decode_first(key: int) -> tuple[int, int]:
    """``(flat index, id)`` of the first bad id from ``stats[1]`` (the id clamped to int32)."""
    return key >> 32, (key & 0xFFFFFFFF) - _INT32_OFFSET


@triton.jit(do_not_specialize=["n", "ignore_index"])
def _masked_ids_kernel(ids_out, active_out, ids_ptr, mask_ptr, n, ignore_index, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < n
    y = tl.load(ids_ptr + offs, mask=in_range, other=0).to(tl.int64)
    active = tl.load(mask_ptr + offs, mask=in_range, other=0) != 0  # NaN: != 0 (unordered), as torch
    tl.store(ids_out + offs, tl.where(active, tl.maximum(y, -1), ignore_index), mask=in_range)
    tl.store(active_out + offs, active, mask=in_range)


_launch_masked = FastLauncher(_masked_ids_kernel)


def masked_ids(ids: torch.Tensor, mask: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, active)`` of ``ids``' shape: ``active = mask != 0`` (bool) and int64 ``out`` =
    ``max(id, -1)`` where active, ``ignore_index`` elsewhere; one launch instead of PyTorch's four
    (``!=``, ``long``, ``clamp_min``, ``where``: ~0.3 ms of host time per call on the H100 host).

    Args:
        ids: any integer dtype, contiguous.
        mask: ``ids``' shape, bool / integer / floating, contiguous, on ``ids``' device.
        ignore_index: a negative int64 (below -1, so that it never equals a clamped id).
    """
    if not (ids.is_contiguous() and mask.is_contiguous()) or mask.shape != ids.shape:
        raise ValueError(
            f"ids and mask must be contiguous and of one shape: {tuple(ids.shape)} vs {tuple(mask.shape)}"
        )
    out = torch.empty(ids.shape, dtype=torch.int64, device=ids.device)
    active = torch.empty(ids.shape, dtype=torch.bool, device=ids.device)
    n = ids.numel()
    if n == 0:
        return out, active
    with _device_guard(ids):
        args = (out, active, ids, mask, n, int(ignore_index))
        _launch_masked((cdiv(n, BLOCK),), args, {"BLOCK": BLOCK}, {"num_warps": 4})
    return out, active


# The compaction index: one program per ROWS_BLOCK ids. A program counts the active ids of the
# blocks before its own (a loop over them, the same for every run: no atomics, no scan across
# programs), then places its own active rows by a prefix sum: increasing order, as nonzero gives.
# ROWS_BLOCK 4096: 16 programs at N = 65,536, the last re-reading 15 blocks (0.5 MB).
ROWS_BLOCK = 4096


@triton.jit(do_not_specialize=["n", "ignore_index", "seq_len", "gap"])
def _active_rows_kernel(out_ptr, ids_ptr, n, ignore_index, seq_len, gap, BLOCK: tl.constexpr,
                        STORAGE: tl.constexpr):  # fmt: skip
    """``out`` int64: the positions at ``[0, count)``, with ``STORAGE`` their storage rows at
    ``[n, n + count)``, the count at ``[n]`` (``[2n]`` with ``STORAGE``)."""
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    before = tl.zeros((), dtype=tl.int64)
    start = tl.zeros((), dtype=tl.int64)
    for _ in range(0, pid):  # the blocks before this one are whole
        y = tl.load(ids_ptr + start + lanes).to(tl.int64)
        before += tl.sum((y != ignore_index).to(tl.int64), axis=0)
        start += BLOCK
    offs = pid.to(tl.int64) * BLOCK + lanes
    in_range = offs < n
    y = tl.load(ids_ptr + offs, mask=in_range, other=0).to(tl.int64)
    active = in_range & (y != ignore_index)
    ones = active.to(tl.int64)
    pos = before + tl.cumsum(ones, axis=0) - ones  # exclusive prefix: this row's rank
    tl.store(out_ptr + pos, offs, mask=active)
    count_at = n
    if STORAGE:  # row i of [B, T] at storage row i + (i // T)·gap of a hidden read in place
        tl.store(out_ptr + n + pos, offs + (offs // seq_len) * gap, mask=active)
        count_at = 2 * n
    if pid == tl.num_programs(0) - 1:
        tl.store(out_ptr + count_at, before + tl.sum(ones, axis=0))


_launch_active = FastLauncher(_active_rows_kernel)


def active_rows(
    ids: torch.Tensor, ignore_index: int, seq_len: int = 1, gap: int = 0, storage: bool = False
) -> torch.Tensor:
    """The positions of the flat ``ids`` that are not ``ignore_index``, increasing (what
    ``(ids != ignore_index).nonzero()`` gives), and their count, in one launch and one int64
    buffer ``out`` on the device (reading the count is the caller's host sync): the positions at
    ``out[:count]``, the count at ``out[N]``; with ``storage`` the positions' storage rows
    ``i + (i // seq_len)·gap`` (row i of a ``[B, seq_len]`` batch in a hidden read in place) at
    ``out[N:N + count]`` and the count at ``out[2N]``. The other entries are not written.

    Args:
        ids: contiguous integer ids (any shape: flat order).
        ignore_index: the id of inactive rows.
        seq_len, gap, storage: the storage rows' layout (``seq_len >= 1``), and whether to write them.
    """
    n = ids.numel()
    out = torch.empty((2 * n if storage else n) + 1, dtype=torch.int64, device=ids.device)
    if n == 0:
        return out.zero_()
    with _device_guard(ids):
        _launch_active(
            (cdiv(n, ROWS_BLOCK),),
            (out, ids, n, int(ignore_index), int(seq_len), int(gap)),
            {"BLOCK": ROWS_BLOCK, "STORAGE": bool(storage)},
            {"num_warps": 8},
        )
    return out


@triton.jit
def _bad_block(y, active, offs, vocab_size):
    """(count, first-bad key) of one block of ids (the module docstring's numbers; active only)."""
    bad = active & ((y < 0) | (y >= vocab_size))
    key = tl.min(tl.where(bad, bad_id_key(y, offs), 9223372036854775807), axis=0)
    return tl.sum(bad.to(tl.int64), axis=0), key


@triton.jit(do_not_specialize=["n", "ignore_index", "vocab_size", "seq_len", "gap"])
def _masked_rows_kernel(out_ptr, active_ptr, ids_ptr, mask_ptr, n, ignore_index, vocab_size, seq_len, gap,
                        BLOCK: tl.constexpr, STORAGE: tl.constexpr, CHECK: tl.constexpr):  # fmt: skip
    """:func:`masked_rows`'s one launch: ``_masked_ids_kernel``'s outputs, ``_active_rows_kernel``'s
    index (active: ``mask != 0``) and, in the last program, the count and the id check's two numbers
    over every block (it reads the blocks before its own anyway: no atomics, no initialized buffer)."""
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    before = tl.zeros((), dtype=tl.int64)
    bad = tl.zeros((), dtype=tl.int64)
    first = tl.full((), 9223372036854775807, tl.int64)
    start = tl.zeros((), dtype=tl.int64)
    for _ in range(0, pid):  # the blocks before this one are whole
        offs = start + lanes
        act = tl.load(mask_ptr + offs) != 0  # NaN: != 0 (unordered), as torch
        before += tl.sum(act.to(tl.int64), axis=0)
        if CHECK:
            b, k = _bad_block(tl.load(ids_ptr + offs).to(tl.int64), act, offs, vocab_size)
            bad += b
            first = tl.minimum(first, k)
        start += BLOCK
    offs = pid.to(tl.int64) * BLOCK + lanes
    in_range = offs < n
    y = tl.load(ids_ptr + offs, mask=in_range, other=0).to(tl.int64)
    active = in_range & (tl.load(mask_ptr + offs, mask=in_range, other=0) != 0)
    tl.store(out_ptr + offs, tl.where(active, tl.maximum(y, -1), ignore_index), mask=in_range)
    tl.store(active_ptr + offs, active, mask=in_range)
    ones = active.to(tl.int64)
    pos = before + tl.cumsum(ones, axis=0) - ones  # exclusive prefix: this row's rank
    tl.store(out_ptr + n + pos, offs, mask=active)
    tail = 2 * n
    if STORAGE:  # row i of [B, T] at storage row i + (i // T)·gap of a hidden read in place
        tl.store(out_ptr + 2 * n + pos, offs + (offs // seq_len) * gap, mask=active)
        tail = 3 * n
    if pid == tl.num_programs(0) - 1:
        tl.store(out_ptr + tail, before + tl.sum(ones, axis=0))
        if CHECK:
            b, k = _bad_block(y, active, offs, vocab_size)
            tl.store(out_ptr + tail + 1, bad + b)
            tl.store(out_ptr + tail + 2, tl.minimum(first, k))


_launch_masked_rows = FastLauncher(_masked_rows_kernel)


def masked_rows(
    ids: torch.Tensor,
    mask: torch.Tensor,
    ignore_index: int,
    vocab_size: int,
    *,
    seq_len: int = 1,
    gap: int = 0,
    storage: bool = False,
    check: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """:func:`masked_ids`, :func:`active_rows` (of the masked ids) and :func:`bad_id_stats` (of the
    active ids, none exempt) in ONE launch: ``(out, active, tail)`` with the masked int64 ids at
    ``out[:N]``, the active positions (increasing) at ``out[N:N + count]``, with ``storage`` their
    storage rows (as :func:`active_rows`) at ``out[2N:2N + count]``, and at ``out[tail]`` the count,
    at ``out[tail + 1:tail + 3]`` (``check``) the id check's count and first-bad key (module
    docstring); ``active`` bool ``mask != 0``. Nothing is read on the host (the caller reads the
    three numbers in one sync). Unchecked: ``ids`` (any integer dtype) and ``mask`` (any dtype) flat,
    contiguous, of one size N >= 1, on one device; ``ignore_index`` < -1."""
    n = ids.numel()
    tail = (3 if storage else 2) * n
    out = torch.empty(tail + 3, dtype=torch.int64, device=ids.device)
    active = torch.empty(ids.shape, dtype=torch.bool, device=ids.device)
    with _device_guard(ids):
        _launch_masked_rows(
            (cdiv(n, ROWS_BLOCK),),
            (out, active, ids, mask, n, int(ignore_index), int(vocab_size), int(seq_len), int(gap)),
            {"BLOCK": ROWS_BLOCK, "STORAGE": bool(storage), "CHECK": bool(check)},
            {"num_warps": 8},
        )
    return out, active, tail
