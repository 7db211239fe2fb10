"""Context-parallel losses on NCCL at real size: CP = 2 on 2 GPUs, and the CP = 2 × DP = 2 and
CP = 2 × TP = 2 meshes on 4 (``_cp_worker.py`` under torchrun).

One run per world size starts ``torch.distributed.run --standalone --nproc_per_node=<world>`` on
``_cp_worker.py``, which runs every check on every rank (see its docstring: every preset on the
hidden path and three from logits, padded contiguous and packed load-balanced slices, rollout
corrections, rejection and masks, against the unsplit call on one GPU; bad layouts raising on every
rank; the meshes with ``global_normalizers`` and the vocab-parallel head); each test below reports
one check on every rank, with the rank's traceback on failure.

Never hangs: the collectives time out (``_cp_worker.COLLECTIVE_TIMEOUT_S``), a failing rank exits
and torchrun stops its peers, and the whole run is killed (its process group) after ``DEADLINE_S``.
Each world size skips on a machine with fewer CUDA devices. On a CPU-only machine the 2-rank run
goes through a subset of the checks with gloo at tiny sizes (``cpu_smoke``, ``SMOKE_CHECKS``: the
plumbing of each path; the CPU suite's own gloo tests
of context parallelism are ``tests/distributed/test_context_parallel.py``, which also run the
meshes on 4 processes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _rank_checks import fail_unless_ok, run_torchrun, runs_by_world

from . import _cp_worker

pytestmark = [pytest.mark.multi_gpu, pytest.mark.cpu_smoke]

DEADLINE_S = 280  # below scripts/gpu_suite.sh's step limit: the run is killed here, not orphaned
SMOKE = not torch.cuda.is_available()  # gloo on the CPU, tiny sizes, 2 ranks
WORLDS = (2,) if SMOKE else (2, 4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(world)``: ``({rank: {check: "ok" | traceback}}, problem)`` after one torchrun of every
    check on ``world`` ranks (once per world size; a session of its own, killed whole at the
    deadline; skipped with fewer CUDA devices)."""
    worker = Path(_cp_worker.__file__)
    launch = lambda world, out: run_torchrun(worker, out, world, DEADLINE_S, SMOKE)  # noqa: E731
    return runs_by_world(tmp_path_factory, "context_parallel", launch, cuda=not SMOKE)


@pytest.mark.parametrize(("world", "check"), [(w, c) for w in WORLDS for c in _cp_worker.checks(w, SMOKE)])
def test_check(runs, world, check):
    fail_unless_ok(*runs(world), check, f"on {world} ranks")
