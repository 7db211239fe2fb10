"""The sequence-ratio loss with its plan built on the device (route ``logits/sequence/device``) at real
sizes: its log-probs-derived gradient is bitwise the host-built plan's (the same row statistics, the
same sequence kernel on the same constants), its loss equal to fp32 rounding, for logits sliced from
a model output ``[B, P + T, V]`` (the users' layout: the backward writes the base's zero rows).

The host-built route is taken for the same values by giving ``old_logp`` as a non-contiguous view
(the route's own rule). Inputs: bf16 ``2·randn``, B = 8, T = 1024, P = 128, V ∈ {151,936, 32,768},
ragged lengths in [T/4, T], garbage ids (-1) at masked positions, old log-probs near the true ones.
"""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk
from rlkernel.ops.routes import Route

from .conftest import DEVICE, SIZES, generator

pytestmark = pytest.mark.gpu

S = SIZES.loss
CONFIGS = {
    "gspo": rk.PolicyLossConfig.preset("gspo"),
    "gspo_token+kl": rk.PolicyLossConfig.preset("gspo", loss_type="gspo_token", kl_coef=1e-3),
    "gmpo+entropy": rk.PolicyLossConfig.preset("gmpo", entropy_coef=1e-3),
}


def _inputs(vocab: int, seed: int):
    g = generator(seed)
    b, t, p = S.batch, S.seq_len, 8 if S.seq_len < 64 else 128
    base = torch.randn(b, p + t, vocab, device=DEVICE, generator=g, dtype=torch.bfloat16).mul_(2)
    logits = base[:, p - 1 : -1]
    ids = torch.randint(0, vocab, (b, t), device=DEVICE, generator=g)
    lengths = torch.randint(max(t // 4, 1), t + 1, (b,), device=DEVICE, generator=g)
    mask = torch.arange(t, device=DEVICE)[None, :] < lengths[:, None]
    true = torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None])[..., 0]
    kw = dict(
        token_ids=torch.where(mask, ids, -1),
        old_logp=true + 0.1 * torch.randn(b, t, device=DEVICE, generator=g),
        ref_logp=true + 0.1 * torch.randn(b, t, device=DEVICE, generator=g),
        advantages=torch.randn(b, device=DEVICE, generator=g),
        mask=mask,
        temperature=0.9,
    )
    return base.requires_grad_(True), p, kw


SMOKE_CASE = (S.vocabs[-1], "gspo")  # also run in the CPU suite (cpu_smoke): keeps this code working
CASES = [
    pytest.param(vocab, label, marks=[pytest.mark.cpu_smoke] if (vocab, label) == SMOKE_CASE else [])
    for vocab in S.vocabs
    for label in CONFIGS
]


@pytest.mark.parametrize(("vocab", "label"), CASES)
def test_device_plan_equals_the_host_plan(vocab, label):
    cfg = CONFIGS[label]
    base, p, kw = _inputs(vocab, seed=len(label))
    results = []
    for host in (False, True):
        call = dict(kw)
        if host:
            call["old_logp"] = kw["old_logp"].t().contiguous().t()
        out = rk.fused_policy_loss(cfg, logits=base[:, p - 1 : -1], **call)
        (grad,) = torch.autograd.grad(out.loss, base)
        results.append((out.route, out.loss.detach(), grad))
    rk.raise_pending_errors()
    (r_dev, l_dev, g_dev), (r_host, l_host, g_host) = results
    assert r_dev == Route("logits", "sequence", "triton", passes=3, plan="device"), str(r_dev)
    assert r_host == Route("logits", "sequence", "triton", passes=3, plan="host"), str(r_host)
    assert torch.equal(g_dev, g_host)
    torch.testing.assert_close(l_dev, l_host, atol=0, rtol=1e-5)
    assert bool((g_dev[:, : p - 1] == 0).all()) and bool((g_dev[:, -1] == 0).all())
