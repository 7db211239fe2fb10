"""The vocab-parallel LM head on NCCL, 2 GPUs, at real size (``_tp_worker.py`` under torchrun).

One module-scoped run starts ``torch.distributed.run --standalone --nproc_per_node=2`` on
``_tp_worker.py``, which runs every check on both ranks (see its docstring: uneven vocabulary shards
of V = 151,936, ``linear_token_logprobs(tp_group=...)`` and ``fused_policy_loss(hidden=...,
tp_group=...)`` against the unsharded computation, the error path raising on every rank,
``global_normalizers``); each test below then reports one check on every rank, with the rank's
traceback on failure.

Never hangs: the collectives time out (``_tp_worker.COLLECTIVE_TIMEOUT_S``), a failing rank exits and
torchrun stops its peers, and the whole run is killed (its process group) after ``DEADLINE_S``.
Skips on a machine with 1 CUDA device. On a CPU-only machine it runs the same checks with gloo at
tiny sizes (``cpu_smoke``: the worker and the torchrun plumbing stay tested in the CPU suite, whose
own gloo tests of the vocab-parallel path are ``tests/distributed``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _rank_checks import fail_unless_ok, run_torchrun

from . import _tp_worker

pytestmark = [pytest.mark.multi_gpu, pytest.mark.cpu_smoke]

WORLD = 2
DEADLINE_S = 240  # below scripts/gpu_suite.sh's step limit (300 s): the run is killed here, not orphaned
SMOKE = not torch.cuda.is_available()  # gloo on the CPU, tiny sizes
CHECK_NAMES = _tp_worker.SMOKE_CHECK_NAMES if SMOKE else _tp_worker.CHECK_NAMES


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    """``({rank: {check: "ok" | traceback}}, problem)`` after one torchrun of every check."""
    if not SMOKE and torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA devices (a CPU-only machine runs the checks tiny on gloo)")
    out = tmp_path_factory.mktemp("tensor_parallel")
    # A session of its own: on the deadline the whole group (torchrun and its workers) is killed.
    return run_torchrun(Path(_tp_worker.__file__), out, WORLD, DEADLINE_S, SMOKE)


@pytest.mark.parametrize("check", CHECK_NAMES)
def test_check(outcome, check):
    fail_unless_ok(*outcome, check, f"on {WORLD} ranks")
