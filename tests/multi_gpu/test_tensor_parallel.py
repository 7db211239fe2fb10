"""The vocab-parallel LM head on NCCL, 2 and 4 GPUs, at real size (``_tp_worker.py`` under torchrun).

One run per world size (2; 4: TP = 4 and a 2 × 2 TP × DP mesh) starts
``torch.distributed.run --standalone --nproc_per_node=<world>`` on
``_tp_worker.py``, which runs every check on both ranks (see its docstring: uneven vocabulary shards
of V = 151,936, ``linear_token_logprobs(tp_group=...)`` and ``fused_policy_loss(hidden=...,
tp_group=...)`` against the unsharded computation, the error path raising on every rank,
``global_normalizers``); each test below then reports one check on every rank, with the rank's
traceback on failure.

Never hangs: the collectives time out (``_tp_worker.COLLECTIVE_TIMEOUT_S``), a failing rank exits and
torchrun stops its peers, and the whole run is killed (its process group) after ``DEADLINE_S``.
Each world size skips on a machine with fewer CUDA devices. On a CPU-only machine it runs the
2-rank checks with gloo at
tiny sizes (``cpu_smoke``: the worker and the torchrun plumbing stay tested in the CPU suite, whose
own gloo tests of the vocab-parallel path are ``tests/distributed``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _rank_checks import fail_unless_ok, run_torchrun, runs_by_world

from . import _tp_worker

pytestmark = [pytest.mark.multi_gpu, pytest.mark.cpu_smoke]

DEADLINE_S = 240  # below scripts/gpu_suite.sh's step limit (300 s): the run is killed here, not orphaned
SMOKE = not torch.cuda.is_available()  # gloo on the CPU, tiny sizes, 2 ranks
WORLDS = (2,) if SMOKE else (2, 4)  # 4: TP = 4, and the 2 x 2 TP x DP mesh


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(world)``: ``({rank: {check: "ok" | traceback}}, problem)`` after one torchrun of every
    check on ``world`` ranks (once per world size; a session of its own, killed whole at the
    deadline; skipped with fewer CUDA devices)."""
    worker = Path(_tp_worker.__file__)
    launch = lambda world, out: run_torchrun(worker, out, world, DEADLINE_S, SMOKE)  # noqa: E731
    return runs_by_world(tmp_path_factory, "tensor_parallel", launch, cuda=not SMOKE)


@pytest.mark.parametrize(("world", "check"), [(w, c) for w in WORLDS for c in _tp_worker.checks(SMOKE, w)])
def test_check(runs, world, check):
    fail_unless_ok(*runs(world), check, f"on {world} ranks")
