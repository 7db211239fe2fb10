"""An FSDP2 (``fully_shard``) LM head on NCCL, 2 and 4 GPUs, against one GPU (``_fsdp2_worker.py``
under torchrun; issue 15's FSDP2 part, issue 27's 4 GPUs).

One run per world size starts ``torch.distributed.run --standalone --nproc_per_node=<world>`` on
``_fsdp2_worker.py``, which runs every check on every rank (see its docstring: a model with a
V = 151,936 LM head wrapped with ``fully_shard``, the loss computed outside the forward from the
hidden states and ``model.lm_head.weight`` — a ``Shard(0)`` DTensor that rlkernel gathers — in fp32
and in bf16 mixed precision, against the unsharded model on one GPU; ``invariant=True`` bitwise; a
DTensor with ``tp_group`` raising on every rank; the cost of the gather in ``fsdp2_timings.json``).
Each test below reports one check on every rank, with the rank's traceback on failure.

Never hangs: the collectives time out, a failing rank exits and torchrun stops its peer, and the
whole run is killed (its process group) after ``DEADLINE_S``. Each world size skips on a machine
with fewer CUDA devices. On a CPU-only machine it runs the 2-rank checks with gloo at tiny sizes
(``cpu_smoke``; the CPU suite's own FSDP2 tests are ``tests/distributed/test_fsdp2_lm_head.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _rank_checks import fail_unless_ok, run_torchrun, runs_by_world

from . import _fsdp2_worker

pytestmark = [pytest.mark.multi_gpu, pytest.mark.cpu_smoke]

DEADLINE_S = 240  # below scripts/gpu_suite.sh's step limit (300 s): the run is killed here, not orphaned
SMOKE = not torch.cuda.is_available()  # gloo on the CPU, tiny sizes, 2 ranks
WORLDS = (2,) if SMOKE else (2, 4)  # 4: FSDP2 over 4 ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(world)``: ``({rank: {check: "ok" | traceback}}, problem)`` after one torchrun of every
    check on ``world`` ranks (once per world size; a session of its own, killed whole at the
    deadline; skipped with fewer CUDA devices)."""
    worker = Path(_fsdp2_worker.__file__)
    launch = lambda world, out: run_torchrun(worker, out, world, DEADLINE_S, SMOKE)  # noqa: E731
    return runs_by_world(tmp_path_factory, "fsdp2", launch, cuda=not SMOKE)


@pytest.mark.parametrize(("world", "check"), [(w, c) for w in WORLDS for c in _fsdp2_worker.CHECK_NAMES])
def test_check(runs, world, check):
    fail_unless_ok(*runs(world), check, f"on {world} ranks")
