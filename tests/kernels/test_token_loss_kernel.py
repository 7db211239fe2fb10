"""The token-loss Triton kernel against its reference, and the fused logits path built on it.

Without a GPU the kernel runs in the Triton interpreter (conftest), at tiny sizes.
"""

import itertools

import pytest
import torch

import rlkernel as rk
from rlkernel.rl import token_loss as tl_mod

from .conftest import DEVICE

# Kernel vs reference: the same fp32 formulas; only exp/log/expm1 implementations and the order of
# the partial sums differ.
TOL = dict(atol=1e-6, rtol=1e-5)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _batch(b=3, t=7, seed=0, per_token_adv=False):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[0, 0] = True
    mask[1] = False
    logp = -torch.rand(b, t, generator=g) * 3 - 0.05
    old = logp + 0.4 * torch.randn(b, t, generator=g)
    # Extremes on row 0: ratio exactly 1 (max ties), the ±20 clamp, a dual-clip-sized drift.
    old[0, :4] = logp[0, :4] - torch.tensor([0.0, 25.0, -25.0, 2.5])
    adv = torch.randn(b, t, generator=g) if per_token_adv else torch.randn(b, generator=g)
    ref = logp + torch.randn(b, t, generator=g)
    ref[0, 4] = logp[0, 4] + 12.0  # k3 clamps
    return dict(
        logp=logp,
        entropy=torch.rand(b, t, generator=g) * 2,
        old_logp=old,
        advantages=adv,
        mask=mask,
        ref_logp=ref,
        rollout_logp=old + 0.3 * torch.randn(b, t, generator=g),
        ids=torch.where(mask, torch.randint(0, 9, (b, t), generator=g), -7),
    )


def _plan(cfg, d, **kw):
    return tl_mod.build_plan(
        cfg,
        token_ids=d["ids"].to(DEVICE),
        old_logp=d["old_logp"].to(DEVICE),
        advantages=d["advantages"].to(DEVICE),
        mask=d["mask"].to(DEVICE),
        ref_logp=d["ref_logp"].to(DEVICE),
        rollout_logp=d["rollout_logp"].to(DEVICE),
        **kw,
    )


def _compare(cfg, d, **kw):
    plan = _plan(cfg, d, **kw)
    logp = d["logp"].reshape(-1).to(DEVICE)
    ent = d["entropy"].reshape(-1).to(DEVICE) if plan.want_entropy else None
    got = tl_mod.token_loss(plan, logp, ent, backend="triton")
    want = tl_mod.token_loss(plan, logp, ent, backend="reference")
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    torch.testing.assert_close(got.g_logp, want.g_logp, **TOL)
    if plan.want_entropy:
        torch.testing.assert_close(got.g_entropy, want.g_entropy, **TOL)
    return plan, got


CASES = [
    dict(loss_type="ppo", clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.1, kl_estimator="k3"),
    dict(loss_type="ppo", clip_low=0.2, clip_high=0.2, delta=1.5, aggregation="seq-mean-token-mean"),
    dict(loss_type="cispo", clip_low=None, clip_high=0.3, kl_coef=0.2, kl_estimator="k2"),
    dict(loss_type="cispo", clip_low=0.2, clip_high=0.3, aggregation="seq-mean-token-sum"),
    dict(loss_type="sapo", kl_coef=0.1, kl_estimator="abs", aggregation="seq-mean-token-sum-norm"),
    dict(loss_type="reinforce", kl_coef=0.1, kl_estimator="k1+", entropy_coef=0.05),
    dict(
        loss_type="ppo", kl_coef=0.1, kl_estimator="k3+", rollout_correction="seq_mis", rollout_clip_min=0.5
    ),
    dict(loss_type="ppo", kl_coef=0.1, kl_estimator="k1", rollout_correction="token_tis", entropy_coef=-0.01),
    # ref − logp = 12 on row 0 (_batch): TRL's k3 without the clamps, e^12 ≈ 1.6e5
    dict(loss_type="cispo", clip_low=0.2, clip_high=0.3, kl_coef=0.1, kl_estimator="k3_unclamped"),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_reference(case):
    _compare(rk.PolicyLossConfig(**CASES[case]), _batch(seed=case, per_token_adv=case % 2 == 1))


def test_k3_unclamped_at_large_drifts():
    """The kernel's k3_unclamped against the reference per token where the exponential is large,
    near the float32 maximum (e^88) and overflows (e^95: +inf, as torch.expm1, not NaN)."""
    d = _batch(b=2, t=8, seed=4)
    d["mask"][:] = True
    d["ids"] = d["ids"].abs()
    drift = torch.tensor([0.3, -0.4, 2.9, 12.0, 40.0, 60.0, 88.0, 95.0])  # ref − logp
    d["ref_logp"] = d["logp"] + drift
    cfg = rk.PolicyLossConfig(loss_type="reinforce", kl_coef=0.5, kl_estimator="k3_unclamped")
    plan = _plan(cfg, d, global_tokens=1.0)
    logp = d["logp"].reshape(-1).to(DEVICE)
    got = tl_mod.token_loss(plan, logp, None, backend="triton")
    want = tl_mod.token_loss(plan, logp, None, backend="reference")
    finite = torch.isfinite(want.g_logp)
    assert finite.sum() == 14 and bool((want.g_logp[~finite] == -float("inf")).all())
    torch.testing.assert_close(got.g_logp[finite], want.g_logp[finite], **TOL)
    assert torch.equal(got.g_logp[~finite], want.g_logp[~finite])
    assert got.loss == want.loss == float("inf")


def test_global_normalizer_tensor_and_floor():
    cfg = rk.PolicyLossConfig(loss_type="ppo", aggregation="token-mean")
    _compare(cfg, _batch(seed=3), global_tokens=torch.tensor(0.5, device=DEVICE))
    cfg = rk.PolicyLossConfig(loss_type="ppo", aggregation="seq-mean-token-mean")
    _compare(cfg, _batch(seed=3), global_seqs=2.5)


def test_more_tokens_than_one_block_and_slices():
    d = _batch(b=3, t=700, seed=9)  # 2100 tokens: three kernel blocks of 1024
    cfg = rk.PolicyLossConfig(loss_type="ppo", dual_clip=3.0, kl_coef=0.1, entropy_coef=0.01)
    plan, whole = _compare(cfg, d)
    logp, ent = d["logp"].reshape(-1).to(DEVICE), d["entropy"].reshape(-1).to(DEVICE)
    cuts = [0, 1000, 1030, 2100]
    parts = [
        tl_mod.token_loss(plan, logp[a:b], ent[a:b], start=a, stop=b) for a, b in itertools.pairwise(cuts)
    ]
    torch.testing.assert_close(sum(p.loss for p in parts), whole.loss, **TOL)
    assert torch.equal(torch.cat([p.g_logp for p in parts]), whole.g_logp)


def test_all_masked_and_nan():
    d = _batch(seed=2)
    cfg = rk.PolicyLossConfig(loss_type="sapo", kl_coef=0.1)
    d["mask"][:] = False
    d["ids"][:] = -7
    _, got = _compare(cfg, d)
    assert got.loss.item() == 0.0 and torch.count_nonzero(got.g_logp) == 0
    d = _batch(seed=2)
    d["logp"][0, 0] = float("nan")
    plan = _plan(cfg, d)
    got = tl_mod.token_loss(plan, d["logp"].reshape(-1).to(DEVICE), backend="triton")
    assert torch.isnan(got.loss) and torch.isnan(got.g_logp[0])


def test_empty_batch():
    d = {k: v[:0] for k, v in _batch().items()}
    _, got = _compare(rk.PolicyLossConfig(), d)
    assert got.loss.item() == 0.0 and got.g_logp.numel() == 0


def test_backward_kernel_scale_is_read_on_device():
    from rlkernel.kernels import logprobs as k

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 19, generator=g).to(DEVICE)
    ids = torch.tensor([3, -100, 0, 18], device=DEVICE)
    _, ent, lse = k.token_logprobs_fwd(x, ids, return_entropy=True)
    gl, gh = torch.randn(4, generator=g).to(DEVICE), torch.randn(4, generator=g).to(DEVICE)
    base = k.token_logprobs_bwd(x, ids, lse, ent, gl, gh)
    out = torch.empty_like(x)
    k.token_logprobs_bwd_into(
        x,
        ids,
        lse,
        ent,
        gl,
        gh,
        out,
        temperature=1.0,
        ignore_index=-100,
        grad_scale=torch.tensor([-2.5], device=DEVICE),
    )
    torch.testing.assert_close(out, -2.5 * base)


# ------------------------------------------------------------------ gradient in forward (2 passes)
@pytest.mark.parametrize("case", [0, 4, 5, 6])
@pytest.mark.parametrize("scale", [1.0, -2.5])
def test_gradient_in_forward_matches_three_pass(case, scale):
    d = _batch(b=3, t=5, seed=case, per_token_adv=case % 2 == 1)
    cfg = rk.PolicyLossConfig(**CASES[case])
    g = torch.Generator().manual_seed(case)
    logits = (2 * torch.randn(3, 5, 37, generator=g)).to(DEVICE)
    ids = torch.where(d["mask"], torch.randint(0, 37, (3, 5), generator=g), -1).to(DEVICE)

    def run(max_vocab):
        leaf = logits.clone().requires_grad_(True)
        with rk.use_options(grad_in_forward_max_vocab=max_vocab):
            out = rk.fused_policy_loss(
                cfg,
                logits=leaf,
                token_ids=ids,
                old_logp=d["old_logp"].to(DEVICE),
                advantages=d["advantages"].to(DEVICE),
                mask=d["mask"].to(DEVICE),
                ref_logp=d["ref_logp"].to(DEVICE),
                rollout_logp=d["rollout_logp"].to(DEVICE),
                temperature=0.8,
            )
        (scale * out.loss).backward()
        return out, leaf.grad

    two, g_two = run(1 << 20)
    three, g_three = run(0)
    torch.testing.assert_close(two.loss, three.loss, **TOL)
    torch.testing.assert_close(g_two, g_three, **TOL)
    assert two.metrics.keys() == three.metrics.keys()
    # Same tiles as the log-prob forward: the same logp bits, hence the same metrics exactly.
    for key in three.metrics:
        assert torch.equal(two.metrics[key], three.metrics[key]), key


def test_scale_kernel_is_a_no_op_at_one():
    from rlkernel.kernels import token_loss as k

    g = torch.randn(5, 7).to(DEVICE)
    before = g.clone()
    k.scale_(g, torch.ones(1, device=DEVICE))
    assert torch.equal(g, before)
    k.scale_(g, torch.full((1,), 0.5, device=DEVICE))
    torch.testing.assert_close(g, 0.5 * before)
