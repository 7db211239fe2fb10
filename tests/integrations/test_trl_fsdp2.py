"""The TRL integration's LM head under FSDP2 (issue 29), on gloo in 2 CPU processes.

``add_rlkernel_lm_head`` and ``RLKernelGRPOTrainer`` read the LM head inside the model's forward. With
the head in a ``fully_shard`` unit of its own it is a sharded ``DTensor`` there; TRL 1.16's fused
head gathers it with ``weight.full_tensor()``, whose backward keeps only this rank's gradient (off the
data-parallel mean by 1.8 on 2 ranks, issue 29). rlkernel's head gathers it with
``rlkernel.distributed.gather_lm_head`` (gradient averaged and reduce-scattered). The worker checks
(``_trl_fsdp2_workers.py``) compare every parameter's gradient with the unsharded rank-mean, for both
routes and three layouts (head in its own unit, in the root unit, tied to the embedding).

Plumbing as ``tests/distributed/test_fsdp2_lm_head.py``: a forkserver that imported torch, rlkernel
and transformers once, a 20 s gloo timeout per collective, a deadline for the whole group.
"""

from __future__ import annotations

import sys

import pytest
import torch.distributed as dist

from _rank_checks import fail_unless_ok, run_spawned, start_method

from . import _trl_fsdp2_workers
from .trl_helpers import require_trl

DEADLINE_S = 150
WORLD = 2

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()) or sys.platform == "win32",
    reason="needs torch.distributed with gloo",
)


def _start_method() -> str:
    return start_method(["torch", "torch.distributed", "rlkernel", "torch.distributed.fsdp", "transformers"])


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    """``({rank: {check: "ok" | traceback}}, problem)`` after running all checks."""
    require_trl()
    out = tmp_path_factory.mktemp("trl_fsdp2")
    return run_spawned(_trl_fsdp2_workers.run, WORLD, out, DEADLINE_S, _start_method())


@pytest.mark.parametrize("check", list(_trl_fsdp2_workers.CHECKS))
def test_check(outcome, check):
    fail_unless_ok(*outcome, check, f"in a {WORLD}-process group")
