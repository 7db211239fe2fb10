"""The bookkeeping of rlkernel.ops.id_checks on the CPU: pending checks are read when their
event has completed (polled) or waited for, raise once, in order, with the argument's name, the count
and the first bad id; on the CPU the check raises inside the call. (On CUDA, tests/gpu/test_loss.py
checks the real thing: no host sync, NaN at once, the error at the next call.)"""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk
from rlkernel.ops import id_checks as deferred

COVERED = [rk.raise_pending_errors]


class FakeEvent:
    def __init__(self, done: bool):
        self.done = done
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


@pytest.fixture
def pending(monkeypatch):
    """An empty pending list for the test (the module's list is process-wide)."""
    fresh: list = []
    monkeypatch.setattr(deferred, "_pending", fresh)  # seam: isolate the process-wide list
    monkeypatch.setattr(deferred, "_free_buffers", {})  # seam: ... and its buffer pool
    monkeypatch.setattr(deferred, "_free_events", {})  # seam: ... and its event pools (by device)
    return fresh


def add(pending, count: int, first: int, done: bool, what="token_ids") -> FakeEvent:
    event = FakeEvent(done)
    key = (7 << 32) | (first + 2**31)  # the kernel's encoding: index 7, the id offset by 2^31
    pending.append(deferred._Pending(what, 50, -100, torch.tensor([count, key]), event))
    return event


def test_polling_reads_only_finished_checks(pending):
    add(pending, 3, 77, done=False)
    deferred.raise_pending_errors(wait=False)  # not finished: nothing read, nothing raised
    assert len(pending) == 1
    pending[0].done.done = True
    with pytest.raises(ValueError, match=r"token_ids has 3 id\(s\) outside \[0, 50\) that are not "
                       r"ignore_index=-100 \(first: 77\)"):  # fmt: skip
        deferred.raise_pending_errors(wait=False)
    assert pending == []
    deferred.raise_pending_errors()  # raised once


def test_waiting_reads_every_check_and_clean_ones_raise_nothing(pending):
    clean = add(pending, 0, 0, done=False)
    bad = add(pending, 1, -5, done=False, what="token_ids (at active mask positions)")
    with pytest.raises(ValueError, match=r"active mask positions\) has 1 id.*first: -5"):
        rk.raise_pending_errors()
    assert clean.waited and bad.waited and pending == []


def test_cpu_check_raises_inside_the_call(pending):
    ids = torch.tensor([[1, 2, 60], [-100, 3, -2]])
    with pytest.raises(ValueError, match=r"token_ids has 2 id\(s\).*first: 60"):
        deferred.check_token_ids("token_ids", ids, 50, -100, defer=True)
    active = torch.tensor([[True, True, False], [True, True, False]])
    with pytest.raises(ValueError, match=r"has 1 id\(s\).*first: -100"):
        deferred.check_token_ids("token_ids", ids, 50, None, defer=True, active=active)
    deferred.check_token_ids("token_ids", torch.where(active, ids.clamp(0, 49), 99), 50, None,
                             defer=False, active=active)  # fmt: skip
    assert pending == []


@pytest.mark.parametrize("wait", [1, "yes", None])
def test_wait_must_be_a_bool(wait):
    with pytest.raises(TypeError, match="wait"):
        rk.raise_pending_errors(wait=wait)


def test_report_read_defers_or_raises(pending):
    """``report_read`` (a check whose numbers the caller read with its own host sync): deferred, a
    bad count is pending and ready at once (raised by the next poll, once; earlier finished checks
    first); not deferred, it raises here; a clean count leaves nothing pending."""
    key = (4 << 32) | (61 + 2**31)
    deferred.report_read("token_ids", 0, key, 50, None, defer=True)
    assert pending == []
    add(pending, 1, -9, done=True, what="earlier")
    with pytest.raises(ValueError, match=r"earlier has 1 id"):  # the earlier check first
        deferred.report_read("token_ids", 2, key, 50, None, defer=True)
    deferred.report_read("token_ids", 2, key, 50, None, defer=True)
    assert len(pending) == 1
    with pytest.raises(ValueError, match=r"token_ids has 2 id\(s\) outside \[0, 50\) \(first: 61\)"):
        deferred.raise_pending_errors(wait=False)
    assert pending == []
    with pytest.raises(ValueError, match=r"token_ids has 3 id\(s\).*first: 61"):
        deferred.report_read("token_ids", 3, key, 50, None, defer=False)
    assert pending == []
