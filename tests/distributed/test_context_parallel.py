"""Context-parallel losses (``cp_group=``) on gloo, in 2 and 3 CPU processes, and two 2 × 2 meshes in 4.

One process group starts per world size (a module-scoped fixture) and runs every check of
``_cp_workers.checks_for(world)`` in order; each test below asserts one check's outcome on every
rank, with the worker's traceback on failure. On 2 and 3 ranks: every loss type × aggregation, the
rollout corrections, rejection criteria, off-policy and entropy masks, on padded and packed
batches split contiguously (evenly, unevenly, with an empty slice), by Megatron's load-balanced
layout and at random, against the unsplit float64 loss, gradient and metrics; the fused paths
(reference backend; on 2 ranks the Triton interpreter for the token-level plan, the autograd
coefficients and the chunked linear engine); ``global_normalizers(cp_group=)``; bad layouts raising
the same error on every rank. On 4 ranks: CP × DP with global normalizers, and CP × TP through the
vocab-parallel head. About 30 s on 2 cores.

Hangs become failures: every collective has a 20 s gloo timeout, a failing worker exits (its peers
then fail at once in their next collective), and the fixture gives up after ``DEADLINE_S``.
"""

from __future__ import annotations

import pytest

from _rank_checks import fail_unless_ok, run_spawned, runs_by_world

from . import _cp_workers
from .test_vocab_parallel import _start_method, pytestmark  # noqa: F401 - the same skip condition

DEADLINE_S = 240
WORLDS = (2, 3, 4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(world)``: ``({rank: {check: "ok" | traceback}}, problem)`` after running every check of
    a world size, once per module (the processes start once per world size)."""
    launch = lambda world, out: run_spawned(_cp_workers.run, world, out, DEADLINE_S, _start_method())  # noqa: E731
    return runs_by_world(tmp_path_factory, "context_parallel", launch, cuda=False)


@pytest.mark.parametrize(
    ("world", "check"), [(world, check) for world in WORLDS for check in _cp_workers.checks_for(world)]
)
def test_check(runs, world, check):
    fail_unless_ok(*runs(world), check, f"in a {world}-process group")
