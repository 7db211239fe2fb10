"""Vocab-parallel linear_token_logprobs and global_normalizers on gloo, in 2 and 3 CPU processes.

The processes start once per world size (module-scoped fixture) and run every check of
``_workers.CHECKS`` in order; each test below then asserts one check's outcome on every rank, with
the worker's traceback on failure. Uneven shards: V = 37 split 20/17 and 13/11/13. Workers come
from a ``forkserver`` that has imported torch and rlkernel once (a fresh interpreter per worker
costs seconds on CI's 2 cores); the whole module takes a few seconds.

Hangs become failures: every collective has a 20 s gloo timeout, a failing worker exits (its peers
then fail at once in their next collective), and the fixture gives up after ``DEADLINE_S``.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from _rank_checks import fail_unless_ok, run_spawned, start_method

from . import _workers

DEADLINE_S = 120

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()) or sys.platform == "win32",
    reason="needs torch.distributed with gloo",
)


def _start_method() -> str:
    return start_method(["torch", "torch.distributed", "rlkernel", "rlkernel.distributed"])


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def outcome(request, tmp_path_factory):
    """``(world, {rank: {check: "ok" | traceback}}, problem)`` after running all checks."""
    world = request.param
    out = tmp_path_factory.mktemp(f"vocab_parallel_{world}")
    results, problem = run_spawned(_workers.run, world, out, DEADLINE_S, _start_method())
    return world, results, problem


@pytest.mark.parametrize("check", list(_workers.CHECKS))
def test_check(outcome, check):
    world, results, problem = outcome
    fail_unless_ok(results, problem, check, f"in a {world}-process group")


def test_normalizers_without_process_group():
    """One process, torch.distributed not initialized: the local counts are the global ones."""
    from rlkernel.distributed import global_normalizers

    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 1, 1]])
    tokens, seqs = global_normalizers(mask)
    assert (tokens.item(), seqs.item()) == (4.0, 2.0)
    tokens, seqs = global_normalizers(
        [mask.reshape(-1), mask[:2]], cu_seqlens=[torch.tensor([0, 3, 6, 9]), None], count_empty=True
    )
    assert (tokens.item(), seqs.item()) == (6.0, 5.0)
