"""An enclosing ``torch.autocast`` changes no public op's numbers (DESIGN.md: logits and log-prob math
stay fp32 "under autocast"), on both backends, forward and backward.

For every public op: the result and the gradients computed inside ``torch.autocast`` (backward inside
it too, and backward after it) are bitwise equal to those computed outside. ``invariant.linear`` and
``matmul`` keep ``F.linear``'s one documented autocast rule, the cast of their floating inputs to the
autocast dtype (a model patched with them must run the GEMMs ``F.linear`` would run), and are
otherwise independent of it: bitwise equal to the same call on explicitly cast operands outside.

CPU autocast always; CUDA autocast (bf16 and fp16) when a GPU is present. The Triton backend runs in
the interpreter on CPU.
"""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk
from rlkernel import invariant as inv

ON_GPU = torch.cuda.is_available()
CASES = [("cpu", torch.bfloat16)] + ([("cuda", torch.bfloat16), ("cuda", torch.float16)] if ON_GPU else [])
BACKENDS = ["reference", "triton"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    params = getattr(request.node, "callspec", None)
    device = params.params.get("amp", ("cpu",))[0] if params else "cpu"
    if request.param == "triton" and ON_GPU and device == "cpu":
        pytest.skip("CPU tensors reach the Triton kernels only in the interpreter (CPU suite)")
    with rk.use_backend(request.param):
        yield request.param


@pytest.fixture(params=CASES, ids=lambda c: f"{c[0]}-{str(c[1]).removeprefix('torch.')}")
def amp(request):
    """``(device, autocast dtype)``."""
    return request.param


pytestmark = pytest.mark.usefixtures("smallest_linear_chunks")  # tests/conftest.py


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _run(fn, inputs, autocast=None, backward_inside=True):
    """``(outputs, grads)`` of ``fn(*leaves)`` with fresh leaves; ``autocast = (device, dtype)``
    wraps the forward (and the backward when ``backward_inside``)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    ctx = torch.autocast(autocast[0], dtype=autocast[1]) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        out = fn(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        weights = [torch.randn(o.shape, generator=_gen(7)).to(o.device, torch.float32) for o in outs]
        total = sum((o.float() * w).sum() for o, w in zip(outs, weights, strict=True))
        if backward_inside:
            grads = _grads(total, leaves)
    if not backward_inside:
        grads = _grads(total, leaves)
    # An input the op treats as a constant (kl_penalty's ref_logp) has no gradient in either run.
    return [o.detach() for o in outs], [torch.empty(0) if gr is None else gr for gr in grads]


def _grads(total, leaves):
    if not total.requires_grad:  # a detached result (group_advantages): nothing to differentiate
        return [None] * len(leaves)
    return torch.autograd.grad(total, leaves, allow_unused=True)


def _assert_bitwise(a, b):
    (out_a, grads_a), (out_b, grads_b) = a, b
    for x, y in zip(out_a + grads_a, out_b + grads_b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y), (x - y).abs().max()


def _assert_autocast_free(fn, inputs, amp):
    outside = _run(fn, inputs)
    _assert_bitwise(_run(fn, inputs, amp), outside)
    _assert_bitwise(_run(fn, inputs, amp, backward_inside=False), outside)


# ---------------------------------------------------------------------------------- primitives
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs(backend, amp, dtype):
    device = amp[0]
    g = _gen(1)
    logits = _randn(g, 2, 5, 37, dtype=dtype, device=device) * 3
    ids = torch.randint(0, 37, (2, 5), generator=g).to(device)
    _assert_autocast_free(
        lambda x: rk.token_logprobs(x, ids, temperature=0.8, return_entropy=True), [logits], amp
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_token_logprobs(backend, amp, dtype):
    device = amp[0]
    g = _gen(2)
    hidden = _randn(g, 2, 5, 24, dtype=dtype, device=device)
    weight = _randn(g, 37, 24, dtype=dtype, device=device) / 3
    bias = _randn(g, 37, dtype=dtype, device=device)
    ids = torch.randint(0, 37, (2, 5), generator=g).to(device)
    ids[1, 3] = -100
    _assert_autocast_free(
        lambda h, w, b: rk.linear_token_logprobs(h, w, ids, bias=b, temperature=0.8, return_entropy=True),
        [hidden, weight, bias],
        amp,
    )


# ------------------------------------------------------------------------------ the RL algebra
def _rl_batch(g, b, t, device):
    mask = torch.ones(b, t, device=device)
    mask[0, -2:] = 0
    return dict(
        old_logp=-_randn(g, b, t, device=device).abs(),
        advantages=_randn(g, b, device=device),
        mask=mask,
        ref_logp=-_randn(g, b, t, device=device).abs(),
    )


CONFIGS = {
    "ppo_kl_entropy": rk.PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01),  # the token-level fused path
    "gspo": rk.PolicyLossConfig.preset("gspo"),  # sequence-coupled: the composed path
}


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_policy_loss(backend, amp, cfg):
    device = amp[0]
    g = _gen(3)
    batch = _rl_batch(g, 3, 6, device)
    logp = -_randn(g, 3, 6, device=device).abs()
    entropy = _randn(g, 3, 6, device=device).abs()

    def fn(lp, ent):
        return rk.policy_loss(lp, cfg=CONFIGS[cfg], entropy=ent, **batch).loss

    _assert_autocast_free(fn, [logp, entropy], amp)


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_policy_loss_logits(backend, amp, cfg, dtype):
    device = amp[0]
    g = _gen(4)
    batch = _rl_batch(g, 3, 6, device)
    logits = _randn(g, 3, 6, 29, dtype=dtype, device=device) * 2
    ids = torch.randint(0, 29, (3, 6), generator=g).to(device)
    _assert_autocast_free(
        lambda x: rk.fused_policy_loss(CONFIGS[cfg], logits=x, token_ids=ids, **batch).loss, [logits], amp
    )


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_policy_loss_hidden(backend, amp, cfg, dtype):
    device = amp[0]
    g = _gen(5)
    batch = _rl_batch(g, 3, 6, device)
    hidden = _randn(g, 3, 6, 24, dtype=dtype, device=device)
    weight = _randn(g, 29, 24, dtype=dtype, device=device) / 3
    ids = torch.randint(0, 29, (3, 6), generator=g).to(device)

    def fn(h, w):
        return rk.fused_policy_loss(CONFIGS[cfg], hidden=h, weight=w, token_ids=ids, **batch).loss

    _assert_autocast_free(fn, [hidden, weight], amp)


def test_kl_penalty_and_group_advantages(backend, amp):
    device = amp[0]
    g = _gen(6)
    logp, ref = -_randn(g, 4, 5, device=device).abs(), -_randn(g, 4, 5, device=device).abs()
    for estimator in ("k1", "k2", "k3", "abs"):
        _assert_autocast_free(lambda a, b, e=estimator: rk.kl_penalty(a, b, e), [logp, ref], amp)
    rewards = _randn(g, 8, device=device)
    for estimator in ("grpo", "dr_grpo", "rloo"):
        _assert_autocast_free(lambda r, e=estimator: rk.group_advantages(r, 4, estimator=e), [rewards], amp)


# --------------------------------------------------------------------------- invariant chain
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(backend, amp, dtype):
    device = amp[0]
    g = _gen(7)
    x = _randn(g, 5, 3, 32, dtype=dtype, device=device)
    w = _randn(g, 32, dtype=dtype, device=device)
    _assert_autocast_free(lambda a, b: inv.rms_norm(a, b, 1e-6), [x, w], amp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention(backend, amp, dtype):
    device = amp[0]
    g = _gen(8)
    q = _randn(g, 2, 5, 4, 16, dtype=dtype, device=device)
    k = _randn(g, 2, 7, 2, 16, dtype=dtype, device=device)
    v = _randn(g, 2, 7, 2, 16, dtype=dtype, device=device)
    _assert_autocast_free(lambda a, b, c: inv.attention(a, b, c), [q, k, v], amp)


def test_linear_and_matmul_in_the_autocast_dtype(backend, amp):
    """Operands already in the autocast dtype: nothing to cast, so bitwise the same result."""
    device, dtype = amp
    g = _gen(9)
    x = _randn(g, 7, 40, dtype=dtype, device=device)
    w = _randn(g, 24, 40, dtype=dtype, device=device) / 6
    b = _randn(g, 24, dtype=dtype, device=device)
    _assert_autocast_free(lambda a, c, d: inv.linear(a, c, d), [x, w, b], amp)
    _assert_autocast_free(lambda a, c: inv.matmul(a, c), [x, w.t().contiguous()], amp)


def test_linear_and_matmul_cast_like_f_linear_then_ignore_autocast(backend, amp):
    """fp32 operands: cast to the autocast dtype, as ``F.linear`` does; then bitwise the call on
    the cast operands outside autocast (gradients with respect to the fp32 leaves included)."""
    device, dtype = amp
    g = _gen(10)
    x = _randn(g, 7, 40, device=device)
    w = _randn(g, 24, 40, device=device) / 6
    b = _randn(g, 24, device=device)

    def cast_outside(fn):
        return lambda *ts: fn(*(t.to(dtype) for t in ts))

    for fn, inputs in (
        (lambda a, c, d: inv.linear(a, c, d), [x, w, b]),
        (lambda a, c: inv.matmul(a, c), [x, w.t().contiguous()]),
    ):
        inside = _run(fn, inputs, amp)
        assert inside[0][0].dtype == dtype
        _assert_bitwise(inside, _run(cast_outside(fn), inputs))
        _assert_bitwise(_run(fn, inputs, amp, backward_inside=False), _run(cast_outside(fn), inputs))
