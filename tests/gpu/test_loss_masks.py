"""Real-size GPU checks of the token-mask and on-policy routes of ``fused_policy_loss``.

At the sizes of ``test_loss.py`` (bf16 logits, V = 151,936 and 32,000): each new route against the
composed path (``token_level_fusion=False``), on the 3-pass and the gradient-in-forward paths —
on-policy (``old_logp=None``, the kernels' ``HAS_OLD=False`` branch), given ``rollout_weights``,
rollout rejection (rejected tokens become ignored ids) — and the routes that are not eligible
(off-policy sequence mask, entropy quantile, on-policy rejection) taking the composed path either
way. The CPU suite checks the same at tiny sizes (``tests/rl/test_on_policy.py`` and neighbours).
"""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk
from rlkernel.rl import token_loss

from .conftest import DEVICE, generator
from .test_loss import (
    METRIC_ATOL,
    TEMPERATURE,
    THREE_PASS,
    TWO_PASS,
    S,
    assert_same_loss_and_grad,
    make_inputs,
)

pytestmark = pytest.mark.gpu

CASES = {  # label: (config overrides of the dapo preset, loss inputs, takes the fused token-level path)
    "on_policy": (dict(kl_coef=1e-3), dict(old_logp=None), True),
    "rollout_weights": (dict(kl_coef=1e-3), dict(rollout_weights=True), True),
    "rejection": (dict(rollout_rs="token_k1", rollout_rs_min=0.9, rollout_rs_max=1.1), {}, True),
    "rejection+seq_tis": (
        dict(rollout_rs="seq_mean_k3", rollout_rs_max=2e-3, rollout_correction="seq_tis"),
        {},
        True,
    ),
    "off_policy_mask": (dict(off_policy_mask_threshold=0.01), {}, False),
    "entropy_quantile": (dict(top_entropy_quantile=0.2), {}, False),
    "on_policy+rejection": (dict(rollout_rs="token_k2", rollout_rs_max=0.01), dict(old_logp=None), False),
}


@pytest.fixture(scope="module", params=S.vocabs, ids=lambda v: f"V{v}")
def inputs(request):
    inp = make_inputs(request.param, seed=request.param % 89)
    g = generator(request.param % 83)
    shape = inp.mask.shape
    inp.rollout_logp = inp.old_logp + 0.1 * torch.randn(shape, device=DEVICE, generator=g)
    inp.rollout_weights = torch.rand(shape, device=DEVICE, generator=g) * 1.5 + 0.25
    return inp


def _loss_and_grad(cfg, inp, extra, **options):
    kw = dict(old_logp=inp.old_logp, rollout_logp=inp.rollout_logp, ref_logp=inp.ref_logp)
    kw.update({k: (inp.rollout_weights if k == "rollout_weights" else v) for k, v in extra.items()})
    with rk.use_options(**options):
        out = rk.fused_policy_loss(
            cfg,
            logits=inp.logits,
            token_ids=inp.ids,
            advantages=inp.advantages,
            mask=inp.mask,
            temperature=TEMPERATURE,
            **kw,
        )
        (grad,) = torch.autograd.grad(out.loss, inp.logits)
    return out, grad


@pytest.mark.parametrize("passes", ["3pass", "2pass"])
@pytest.mark.parametrize("label", list(CASES))
def test_fused_route_matches_composed_path(inputs, label, passes):
    overrides, extra, eligible = CASES[label]
    cfg = rk.PolicyLossConfig.preset("dapo", **overrides)
    assert token_loss.is_eligible(cfg, on_policy=extra.get("old_logp", 0) is None) == eligible
    got, g_got = _loss_and_grad(cfg, inputs, extra, **(THREE_PASS if passes == "3pass" else TWO_PASS))
    want, g_want = _loss_and_grad(cfg, inputs, extra, token_level_fusion=False)
    assert_same_loss_and_grad(got, g_got, want, g_want)
    assert got.metrics.keys() == want.metrics.keys()
    for key, value in want.metrics.items():
        assert (got.metrics[key] - value).abs().item() <= METRIC_ATOL, key


@pytest.mark.cpu_smoke
def test_rejected_tokens_get_no_logit_gradient(inputs):
    cfg = rk.PolicyLossConfig.preset("dapo", rollout_rs="token_k1", rollout_rs_min=0.9, rollout_rs_max=1.1)
    _, grad = _loss_and_grad(cfg, inputs, {}, **THREE_PASS)
    keep = rk.rl.rollout.rejection_mask(cfg, inputs.old_logp, inputs.rollout_logp, inputs.mask)
    rejected = inputs.mask & ~keep
    assert bool(rejected.any()) and bool((keep).any())
    assert torch.count_nonzero(grad[rejected]) == 0
    assert torch.count_nonzero(grad[keep]) > 0
