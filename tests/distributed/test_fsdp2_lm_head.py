"""FSDP2 / DTensor LM heads on the hidden-state path (issue 14), on gloo in 2 CPU processes.

Users wrap their model with ``torch.distributed.fsdp.fully_shard``; a loss computed after the
forward (``out.hidden_states[-1]``, ``model.lm_head.weight``) hands ``linear_token_logprobs`` and
``fused_policy_loss`` a ``DTensor`` weight sharded on dim 0. The worker checks
(``_fsdp2_workers.py``) run data parallel (different data per rank) and compare, ≤ 1e-6 in fp32,
with the unsharded single-process computation: DTensor ``Shard(0)``/``Replicate()`` weights and
biases, a replicated DTensor ``hidden``, a frozen weight, fp32 shards with bf16 hidden states (FSDP2's
mixed precision), and real ``fully_shard`` models: the loss outside the forward, inside it (the
LM head in the root group: FSDP2's own unsharded tensor; as its own unit: a DTensor), through the
Triton chunk engine (interpreter), a head tied to the embedding, HSDP's 2-D mesh
(``(Replicate(), Shard(0))``), ``invariant=True`` (bitwise), and mixed precision (outside ==
inside). The single-process tests at the bottom cover every raise, on a one-rank gloo mesh.

Plumbing as ``test_vocab_parallel.py``: workers from a ``forkserver`` that imported torch and
rlkernel once, a 20 s gloo timeout per collective, a failing worker exits (its peer then fails at
once), and the fixture gives up after ``DEADLINE_S``: hangs become failures.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import rlkernel as rk
from _rank_checks import fail_unless_ok, run_spawned, start_method

from . import _fsdp2_workers

DEADLINE_S = 150
WORLD = 2

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()) or sys.platform == "win32",
    reason="needs torch.distributed with gloo",
)


def _start_method() -> str:
    return start_method(
        ["torch", "torch.distributed", "rlkernel", "rlkernel.distributed", "torch.distributed.fsdp"]
    )


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    """``({rank: {check: "ok" | traceback}}, problem)`` after running all checks."""
    out = tmp_path_factory.mktemp("fsdp2_lm_head")
    return run_spawned(_fsdp2_workers.run, WORLD, out, DEADLINE_S, _start_method())


@pytest.mark.parametrize("check", list(_fsdp2_workers.CHECKS))
def test_check(outcome, check):
    fail_unless_ok(*outcome, check, f"in a {WORLD}-process group")


# ------------------------------------------------------------------- one process: every raise
N, V, H = 4, 6, 3


@pytest.fixture
def mesh(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    return hidden, weight, torch.randint(0, V, (N,), generator=g)


def _dtensors(mesh, case):
    """(hidden, weight, bias) for a bad case: DTensors with an unsupported placement."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    h, w, _ = _inputs()
    b = torch.randn(V)
    return {
        "weight Partial": (h, DTensor.from_local(w, mesh, [Partial()]), None),
        "weight Shard(1)": (h, distribute_tensor(w, mesh, [Shard(1)]), None),
        "bias Partial": (h, w, DTensor.from_local(b, mesh, [Partial()])),
        "hidden Shard(0)": (distribute_tensor(h, mesh, [Shard(0)]), w, None),
        "hidden Partial": (
            DTensor.from_local(h, mesh, [Partial()]), distribute_tensor(w, mesh, [Replicate()]), None
        ),
    }[case]


BAD = {
    "weight Partial": r"weight is a DTensor with placements \(Partial\(sum\)\) .*Partial\(sum\) is not supp",
    "weight Shard(1)": r"weight is a DTensor .*Shard\(dim=1\) is not supported; weight must be Shard\(0\)",
    "bias Partial": r"bias is a DTensor .*Partial\(sum\) is not supported; bias must be Shard\(0\)",
    "hidden Shard(0)": r"hidden is a DTensor with placements \(Shard\(dim=0\)\) .*only Replicate\(\)",
    "hidden Partial": r"hidden is a DTensor with placements \(Partial\(sum\)\) .*only Replicate\(\)",
}


def _fused(hidden, weight, bias, ids, **kw):
    cfg = rk.PolicyLossConfig.preset("dapo")
    mask = torch.ones(N, dtype=torch.bool)
    return rk.fused_policy_loss(
        cfg, hidden=hidden, weight=weight, bias=bias, token_ids=ids, old_logp=torch.zeros(N),
        advantages=torch.ones(N), mask=mask, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("api", ["linear_token_logprobs", "fused_policy_loss"])
@pytest.mark.parametrize("case", list(BAD))
def test_unsupported_placement_raises(mesh, api, case):
    hidden, weight, bias = _dtensors(mesh, case)
    ids = _inputs()[2]
    with pytest.raises(ValueError, match=BAD[case]):
        if api == "linear_token_logprobs":
            rk.linear_token_logprobs(hidden, weight, ids, bias=bias)
        else:
            _fused(hidden, weight, bias, ids)


@pytest.mark.parametrize("api", ["linear_token_logprobs", "fused_policy_loss"])
@pytest.mark.parametrize("which", ["weight", "bias", "hidden"])
def test_dtensor_with_tp_group_raises(mesh, one_rank_group, api, which):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    h, w, ids = _inputs()
    b = torch.randn(V)
    args = dict(hidden=h, weight=w, bias=b)
    placement = Replicate() if which == "hidden" else Shard(0)
    args[which] = distribute_tensor(args[which], mesh, [placement])
    hidden, weight, bias = args["hidden"], args["weight"], args["bias"]
    with pytest.raises(ValueError, match=f"{which} is a DTensor, which is not supported with tp_group"):
        if api == "linear_token_logprobs":
            rk.linear_token_logprobs(hidden, weight, ids, bias=bias, tp_group=one_rank_group)
        else:
            _fused(hidden, weight, bias, ids, tp_group=one_rank_group)


def test_dtype_mismatch_other_than_mixed_precision_raises(mesh):
    """Only fp32 shards with fp16/bf16 hidden are cast (FSDP2's mixed precision); e.g. a bf16
    DTensor weight with fp32 hidden raises as a plain one does."""
    from torch.distributed.tensor import Shard, distribute_tensor

    h, w, ids = _inputs()
    with pytest.raises(TypeError, match="weight dtype torch.bfloat16 must match hidden dtype torch.float32"):
        rk.linear_token_logprobs(h, distribute_tensor(w.bfloat16(), mesh, [Shard(0)]), ids)
    with pytest.raises(TypeError, match="weight dtype torch.float32 must match hidden dtype torch.float64"):
        rk.linear_token_logprobs(h.double(), distribute_tensor(w, mesh, [Shard(0)]), ids)


def test_one_rank_dtensor_matches_plain(mesh):
    """On a one-rank mesh the gathered weight is the weight: the same bits as the plain call, and
    the weight's gradient (a DTensor) is the plain gradient."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    h, w, ids = _inputs()
    dw = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    wr = w.clone().requires_grad_()
    logp = rk.linear_token_logprobs(h, dw, ids, temperature=0.7)
    logp_r = rk.linear_token_logprobs(h, wr, ids, temperature=0.7)
    assert torch.equal(logp, logp_r)
    logp.sum().backward()
    logp_r.sum().backward()
    assert isinstance(dw.grad, DTensor) and torch.equal(dw.grad.to_local(), wr.grad)


def test_plain_tensors_pass_through_without_importing_dtensor():
    """Plain tensors come back as the same objects, and a plain call never imports
    ``torch.distributed.tensor`` (a fresh interpreter: ~1.5 s of import the plain path must not pay)."""
    from rlkernel.ops import _dtensor_weight

    h, w, _ = _inputs()
    p = torch.nn.Parameter(w)
    for args in ((h, w, None), (h, p, torch.randn(V)), (h, w, "not a tensor")):
        out = _dtensor_weight.local_lm_head(*args)
        assert all(a is b for a, b in zip(out, args, strict=True))
    code = (
        "import sys, torch, rlkernel as rk\n"
        "h, w = torch.randn(4, 3, requires_grad=True), torch.nn.Parameter(torch.randn(6, 3))\n"
        "rk.linear_token_logprobs(h, w, torch.tensor([0, 1, 2, 5])).sum().backward()\n"
        "cfg = rk.PolicyLossConfig.preset('dapo')\n"
        "ids, mask = torch.tensor([[0, 1], [2, 5]]), torch.ones(2, 2, dtype=torch.bool)\n"
        "rk.fused_policy_loss(cfg, hidden=h.view(2, 2, 3), weight=w, token_ids=ids, old_logp=None,\n"
        "    advantages=torch.ones(2), mask=mask).loss.backward()\n"
        "assert 'torch.distributed.tensor' not in sys.modules, 'imported torch.distributed.tensor'\n"
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("invariant", [False, True])
def test_fp32_shards_with_bf16_hidden_are_cast_before_the_checks(mesh, invariant):
    """FSDP2's mixed precision on a one-rank mesh: fp32 DTensor weight and bias with bf16 hidden
    states give bitwise the plain call on the bf16-cast weight and bias, through both APIs, also
    with ``invariant=True`` (whose bias-dtype check must see the cast bias); the gradients come
    back in fp32."""
    from torch.distributed.tensor import Shard, distribute_tensor

    h, w, ids = _inputs()
    h, b = h.bfloat16(), torch.randn(V)
    dw = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    db = distribute_tensor(b, mesh, [Shard(0)]).requires_grad_()
    wr, br = w.bfloat16().requires_grad_(), b.bfloat16().requires_grad_()
    got = rk.linear_token_logprobs(h, dw, ids, bias=db, invariant=invariant)
    want = rk.linear_token_logprobs(h, wr, ids, bias=br, invariant=invariant)
    assert torch.equal(got, want)
    cfg = rk.PolicyLossConfig.preset("dapo")
    batch = dict(token_ids=ids.view(2, 2), old_logp=-torch.rand(2, 2), advantages=torch.randn(2),
                 mask=torch.ones(2, 2, dtype=torch.bool), invariant=invariant)  # fmt: skip
    loss = rk.fused_policy_loss(cfg, hidden=h.view(2, 2, H), weight=dw, bias=db, **batch).loss
    loss_r = rk.fused_policy_loss(cfg, hidden=h.view(2, 2, H), weight=wr, bias=br, **batch).loss
    assert torch.equal(loss, loss_r)
    (got.sum() + loss).backward()
    # The plain bf16 gradients of the two calls, each cast to fp32 and added in fp32: what the fp32
    # shards accumulate (not bf16's rounded sum).
    per_call = [torch.autograd.grad(y, [wr, br], retain_graph=True) for y in (want.sum(), loss_r)]
    assert dw.grad.dtype == db.grad.dtype == torch.float32
    assert torch.equal(dw.grad.to_local(), per_call[0][0].float() + per_call[1][0].float())
    assert torch.equal(db.grad.to_local(), per_call[0][1].float() + per_call[1][1].float())


def test_gather_lm_head_public_entry(mesh):
    """``rlkernel.distributed.gather_lm_head`` (the entry the TRL heads use, issue 29): plain tensors
    and None come back as the same objects; a one-rank DTensor head gives the plain values and its
    gradient lands, as a DTensor, on the shard; a float32 DTensor with ``dtype=bf16`` is gathered in
    bf16; a dtype other than None/fp16/bf16 raises."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from rlkernel.distributed import gather_lm_head

    _, w, _ = _inputs()
    b = torch.randn(V)
    assert all(a is c for a, c in zip(gather_lm_head(w, b), (w, b), strict=True))
    assert gather_lm_head(w)[1] is None
    dw = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    db = distribute_tensor(b, mesh, [Shard(0)]).requires_grad_()
    gw, gb = gather_lm_head(dw, db)
    assert type(gw) is torch.Tensor and torch.equal(gw, w) and torch.equal(gb, b)
    coef = torch.randn(V, H)
    ((gw * coef).sum() + 3 * gb.sum()).backward()
    assert isinstance(dw.grad, DTensor) and torch.equal(dw.grad.to_local(), coef)
    assert torch.equal(db.grad.to_local(), torch.full((V,), 3.0))
    half, _ = gather_lm_head(distribute_tensor(w, mesh, [Shard(0)]), dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, w.bfloat16())
    with pytest.raises(ValueError, match="dtype must be None, torch.float16 or torch.bfloat16"):
        gather_lm_head(dw, dtype=torch.float64)
