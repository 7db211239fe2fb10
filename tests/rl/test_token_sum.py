"""The ``token-sum`` aggregation (verl ``loss_agg_mode="token-sum"``): Σ m·ℓ, no normalizer.

Against the float64 oracle for every loss type, padded and packed; micro-batches add up to the
whole batch without any global count (and the global normalizers are ignored); the token-level plan
and the fused Triton path (interpreter on the CPU) give the composed loss and gradients.
"""

import pytest
import torch

import rlkernel as rk
from rlkernel.rl import token_loss as tl_mod

from .formulas_more import oracle
from .helpers import LOSS_CONFIGS, assert_close, config, grads, make_batch, pack, run

F32 = torch.float32
TOL = dict(atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name", list(LOSS_CONFIGS))
def test_matches_formula(name, layout):
    cfg = config(name, aggregation="token-sum", kl_coef=0.05, entropy_coef=0.01)
    batch = make_batch(5, 7, seed=len(name))
    kwargs = {}
    if layout == "packed":
        batch, kwargs["cu_seqlens"], _ = pack(batch, [7, 0, 3, 5, 1])
    out = run(cfg, batch, **kwargs)
    expected = oracle(cfg, batch, kwargs.get("cu_seqlens"))
    assert_close(out.loss, expected)
    for got, want in zip(grads(out.loss, batch), grads(expected, batch), strict=True):
        assert_close(got, want)


def test_is_the_token_mean_times_the_token_count_and_ignores_normalizers():
    batch = make_batch(4, 6, seed=3)
    n = batch["mask"].sum().item()
    mean = run(config("ppo", aggregation="token-mean", kl_coef=0.1), batch).loss
    total = run(config("ppo", aggregation="token-sum", kl_coef=0.1), batch).loss
    assert_close(total, mean * n)
    with_norms = run(
        config("ppo", aggregation="token-sum", kl_coef=0.1), batch, global_tokens=7, global_seqs=3
    )
    assert torch.equal(with_norms.loss, total)


def test_micro_batches_add_up_to_the_whole_batch():
    batch = make_batch(6, 5, seed=4)
    cfg = config("cispo", aggregation="token-sum", entropy_coef=0.02)
    whole = run(cfg, batch).loss
    parts = []
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        part = {k: v.detach()[rows] for k, v in batch.items()}
        parts.append(run(cfg, part).loss)
    assert_close(sum(parts), whole)


def test_all_masked_gives_zero():
    batch = make_batch(3, 4, seed=5)
    batch["mask"] = torch.zeros_like(batch["mask"])
    out = run(config("ppo", aggregation="token-sum", kl_coef=0.1, entropy_coef=0.1), batch)
    assert out.loss.item() == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads(out.loss, batch))


@pytest.mark.parametrize(
    "name", [n for n, c in LOSS_CONFIGS.items() if c["loss_type"] in tl_mod.ELIGIBLE_LOSS_TYPES]
)
def test_token_level_plan_matches_policy_loss(name):
    cfg = config(name, aggregation="token-sum", kl_coef=0.1, entropy_coef=0.03, rollout_correction="seq_tis")
    batch = make_batch(4, 7, seed=len(name), dtype=F32)
    for cu in (None, "packed"):
        b, cu_seqlens = (batch, None) if cu is None else pack(batch, [7, 0, 3, 5])[:2]
        out = run(cfg, b, cu_seqlens=cu_seqlens)
        g_logp, g_entropy = grads(out.loss, b)
        plan = tl_mod.build_plan(
            cfg,
            token_ids=torch.zeros(b["mask"].shape, dtype=torch.long),
            old_logp=b["old_logp"],
            advantages=b["advantages"],
            mask=b["mask"],
            ref_logp=b["ref_logp"],
            rollout_logp=b["rollout_logp"],
            cu_seqlens=cu_seqlens,
            global_tokens=11.0,  # ignored by token-sum
        )
        assert plan.denom is None and plan.factor is None
        terms = tl_mod.token_loss(plan, b["logp"].reshape(-1), b["entropy"].reshape(-1), backend="reference")
        torch.testing.assert_close(terms.loss, out.loss.to(F32), **TOL)
        torch.testing.assert_close(terms.g_logp, g_logp.reshape(-1).to(F32), **TOL)
        torch.testing.assert_close(terms.g_entropy, g_entropy.reshape(-1).to(F32), **TOL)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked lanes
def test_fused_triton_path_matches_the_composed_reference(set_options):
    """The token-level fused kernels (Triton; the CPU interpreter here) with token-sum."""
    g = torch.Generator().manual_seed(0)
    batch = make_batch(3, 5, seed=9, dtype=F32)
    vocab = 11
    ids = torch.randint(0, vocab, batch["mask"].shape, generator=g)
    logits = torch.randn(3, 5, vocab, generator=g).requires_grad_(True)
    cfg = config("ppo", aggregation="token-sum", kl_coef=0.1, entropy_coef=0.02)
    kw = dict(
        token_ids=ids,
        old_logp=batch["old_logp"],
        advantages=batch["advantages"],
        mask=batch["mask"],
        ref_logp=batch["ref_logp"],
        logits=logits,
    )
    results, routes = [], []
    for backend, two_pass in (("triton", False), ("triton", True), ("reference", False)):
        set_options(grad_in_forward_max_vocab=1 << 30 if two_pass else 0)
        with rk.use_backend(backend):
            out = rk.fused_policy_loss(cfg, **kw)
            results.append((out.loss, torch.autograd.grad(out.loss, logits)[0]))
            routes.append((out.route.objective, out.route.passes))
    assert tl_mod.is_eligible(cfg)
    assert routes == [("token", 3), ("token", 2), ("composed", None)]
    for loss, grad in results[:2]:
        torch.testing.assert_close(loss, results[2][0], **TOL)
        torch.testing.assert_close(grad, results[2][1], **TOL)
