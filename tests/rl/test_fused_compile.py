"""``fused_policy_loss(logits=...)`` inside ``torch.compile(fullgraph=True)``: an objective with a
token-level plan stays fused — its kernels are ONE registered custom op,
``rlkernel::token_loss_from_logits`` (no graph break, no fallback to the composed path) — with the
loss and the logits gradient of the eager call. CPU: Triton interpreter, ``aot_eager`` and a
graph-recording backend; the GPU suite compiles with Inductor (tests/gpu/test_loss.py)."""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk
from rlkernel._token_loss_plan import TokenLossPlan
from rlkernel.rl import token_loss

from .helpers import config

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # the interpreter's log(0), inf - inf
    # CPU tensors through the Triton kernels need the interpreter, which tests/conftest.py turns on
    # only on machines without CUDA; there tests/gpu/test_loss.py covers the compiled op.
    pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (GPU: tests/gpu/test_loss.py)"),
]
B, T, V = 2, 6, 11


def _op():
    """The registered op (importing the module that registers it, which needs Triton)."""
    import rlkernel.ops._logprobs_function  # noqa: F401

    return torch.ops.rlkernel.token_loss_from_logits.default


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[0, 0] = True
    return dict(
        token_ids=torch.where(mask, torch.randint(0, V, (B, T), generator=g), -1),
        old_logp=-torch.rand(B, T, generator=g) * 3,
        ref_logp=-torch.rand(B, T, generator=g) * 3,
        rollout_logp=-torch.rand(B, T, generator=g) * 3,
        advantages=torch.randn(B, generator=g),
        mask=mask,
    ), torch.randn(B, T + 1, V, generator=g)


CONFIGS = {
    "dapo+kl+entropy": config("ppo", kl_coef=0.1, entropy_coef=0.02, dual_clip=3.0),
    "cispo+seq_tis": config("cispo", rollout_correction="seq_tis", aggregation="seq-mean-token-mean"),
    "sapo+k1+": config("sapo", kl_coef=0.05, kl_estimator="k1+", aggregation="seq-mean-token-sum-norm"),
}


def _loss(cfg, logits, kw):
    return rk.fused_policy_loss(cfg, logits=logits, validate=False, **kw).loss


@pytest.mark.parametrize("label", list(CONFIGS))
def test_compiled_fused_loss_is_one_custom_op_and_matches_eager(label):
    cfg = CONFIGS[label]
    assert token_loss.is_eligible(cfg)
    kw, base = _inputs(seed=len(label))
    targets = []

    def recording_backend(gm, example_inputs):
        targets.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    results = []
    with rk.use_backend("triton"):
        for compiled in (False, True):
            x = base.clone().requires_grad_(True)
            fn = torch.compile(_loss, fullgraph=True, backend=recording_backend) if compiled else _loss
            loss = fn(cfg, x[:, :-1], kw)
            (grad,) = torch.autograd.grad(loss, x)
            results.append((loss, grad))
    called = {getattr(t, "overloadpacket", t) for t in targets}  # Dynamo records the op packets
    assert _op().overloadpacket in called, "the compiled graph does not call rlkernel::token_loss_from_logits"
    assert torch.ops.rlkernel.token_logprobs_fwd not in called  # not the composed path
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], atol=1e-6, rtol=1e-6)
    assert torch.count_nonzero(results[1][1][:, -1]) == 0  # the row outside the slice


def test_compiled_with_aot_autograd_matches_eager():
    cfg = CONFIGS["dapo+kl+entropy"]
    kw, base = _inputs(seed=3)
    out = []
    with rk.use_backend("triton"):
        for fn in (_loss, torch.compile(_loss, fullgraph=True, backend="aot_eager")):
            x = base.clone().requires_grad_(True)
            loss = fn(cfg, x[:, :-1], kw)
            out.append((loss, *torch.autograd.grad(loss, x)))
    torch.testing.assert_close(out[1][0], out[0][0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[1][1], out[0][1], atol=1e-6, rtol=1e-6)


def test_plan_round_trips_through_the_op_arguments():
    cfg = CONFIGS["dapo+kl+entropy"]
    kw, _ = _inputs(seed=5)
    plan = token_loss.build_plan(cfg, **{k: v for k, v in kw.items() if k != "rollout_logp"})
    again = TokenLossPlan.from_op_args(*plan.op_args())
    assert again.scalars == plan.scalars
    for name in ("ids", "old", "adv", "ref", "rollout_w", "factor", "denom"):
        a, b = getattr(plan, name), getattr(again, name)
        assert (a is None and b is None) or a is b
    assert (again.seq_len, again.adv_per_seq, again.factor_per_seq, again.row0, again.ignore_index) == (
        plan.seq_len, plan.adv_per_seq, plan.factor_per_seq, plan.row0, plan.ignore_index
    )  # fmt: skip


def test_custom_op_registration_passes_opcheck():
    """``torch.library.opcheck``: the fake (meta) implementation, the schema and the autograd
    registration agree with the real kernel."""
    cfg = CONFIGS["dapo+kl+entropy"]
    kw, base = _inputs(seed=6)
    plan = token_loss.build_plan(cfg, **{k: v for k, v in kw.items() if k != "rollout_logp"})
    logits = base[:, :-1].contiguous().requires_grad_(True)
    with rk.use_backend("triton"):
        utils = ("test_schema", "test_faketensor", "test_autograd_registration")
        torch.library.opcheck(_op(), (logits, *plan.op_args(), 1.0), test_utils=utils)
