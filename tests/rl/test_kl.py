"""kl_penalty: values and gradients of every estimator against the analytic formulas."""

import pytest
import torch

import rlkernel as rk

from . import formulas


def _inputs(seed=0, n=64, spread=1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(n, generator=g, dtype=torch.float64) * 3).to(dtype).requires_grad_(True)
    ref = (logp.detach() + spread * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype)
    return logp, ref


# estimator -> (value(d), d value / d logp) with d = logp − ref, inside the k3 clamps.
ANALYTIC = {
    "k1": (lambda d: d, lambda d: torch.ones_like(d)),
    "k2": (lambda d: 0.5 * d**2, lambda d: d),
    "k3": (lambda d: torch.exp(-d) - 1 + d, lambda d: 1 - torch.exp(-d)),
    "abs": (lambda d: d.abs(), lambda d: d.sign()),
    "k1+": (lambda d: d, lambda d: d),
    "k3+": (lambda d: torch.exp(-d) - 1 + d, lambda d: d),
    "k3_unclamped": (lambda d: torch.exp(-d) - 1 + d, lambda d: 1 - torch.exp(-d)),
}
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "kl+": "k1+", "low_var_kl+": "k3+"}


@pytest.mark.parametrize("estimator", list(ANALYTIC) + list(ALIASES))
def test_value_and_gradient(estimator):
    logp, ref = _inputs(seed=len(estimator), spread=0.8)
    d = (logp - ref).detach()
    assert bool(((-d).abs() < 2.5).all())  # inside the k3 value clamp
    value_fn, grad_fn = ANALYTIC[ALIASES.get(estimator, estimator)]
    kl = rk.kl_penalty(logp, ref, estimator)
    torch.testing.assert_close(kl.detach(), value_fn(d), atol=1e-12, rtol=1e-12)
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    torch.testing.assert_close(grad, grad_fn(d), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("estimator", list(ANALYTIC))
def test_matches_formula_module(estimator):
    logp, ref = _inputs(seed=3, spread=2.0)
    ours = rk.kl_penalty(logp, ref, estimator)
    theirs = torch.stack([formulas.kl_one(logp[i], ref[i], estimator) for i in range(logp.shape[0])])
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-12)
    g1, g2 = (torch.autograd.grad(x.sum(), logp)[0] for x in (ours, theirs))
    torch.testing.assert_close(g1, g2, atol=1e-12, rtol=1e-12)


def test_k3_reproduces_verl_clamps():
    logp = torch.tensor([-1.0, -1.0, -30.0, -1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.0, 4.0, -1.0, -50.0], dtype=torch.float64)
    kl = rk.kl_penalty(logp, ref, "k3")
    # d = 0 -> 0; ref − logp = 5 -> e^5 − 6 > 10 -> 10; ref − logp = 29 -> clamped to 20 first, then 10;
    # ref − logp = −49 -> clamped to −20: e^−20 + 19 > 10 -> 10.
    assert kl.tolist() == [0.0, 10.0, 10.0, 10.0]
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    assert grad.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_k3_unclamped_has_no_clamps():
    """TRL's k3: e^{−d} − 1 + d and its gradient 1 − e^{−d} where k3's clamps bite (k3 > 10, |d| > 20),
    against the float64 formula; the clamped k3 differs there."""
    g = torch.Generator().manual_seed(5)
    drift = torch.tensor([4.0, 7.5, 25.0, 40.0, -12.0, -30.0, 0.3, -0.2], dtype=torch.float64)
    logp = (-3 * torch.rand(8, generator=g, dtype=torch.float64)).requires_grad_(True)
    ref = logp.detach() + drift  # ref − logp = drift = −d
    d = -drift
    kl = rk.kl_penalty(logp, ref, "k3_unclamped")
    torch.testing.assert_close(kl.detach(), torch.exp(-d) - 1 + d, atol=0, rtol=1e-13)
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    torch.testing.assert_close(grad, 1 - torch.exp(-d), atol=0, rtol=1e-13)
    clamped = rk.kl_penalty(logp.detach(), ref, "k3")
    assert bool((clamped[:6] == 10.0).all()) and bool((kl[:6] > 10.0).all())
    torch.testing.assert_close(clamped[6:], kl.detach()[6:], atol=1e-15, rtol=0)  # no clamp active
    # float32: the same values (relative), and +inf once e^{−d} overflows (as TRL's exp), never NaN
    kl32 = rk.kl_penalty(logp.detach().float(), ref.float(), "k3_unclamped")
    torch.testing.assert_close(kl32.double(), kl.detach(), atol=1e-6, rtol=2e-6)
    far = rk.kl_penalty(torch.tensor([-1.0, -1.0]), torch.tensor([-1.0 + 88.0, -1.0 + 95.0]), "k3_unclamped")
    assert torch.isfinite(far[0]) and far[0] > 1e38 and far[1] == float("inf")


def test_k3_is_accurate_for_tiny_differences():
    logp = torch.full((3,), -2.0)
    ref = logp + torch.tensor([1e-4, -3e-4, 2e-5])
    d = (logp - ref).double()
    exact = d**2 / 2 - d**3 / 6
    for estimator in ("k3", "k3_unclamped"):
        kl = rk.kl_penalty(logp, ref, estimator)
        # expm1(−d) + d errs by ~ε·|d|; the naive exp(−d) − 1 + d would err by ~ε (6e-8 in fp32).
        assert bool(((kl.double() - exact).abs() <= 1e-6 * d.abs()).all())


def test_ref_logp_gets_no_gradient_and_dtypes():
    logp, ref = _inputs(dtype=torch.float32)
    ref.requires_grad_(True)
    kl = rk.kl_penalty(logp, ref, "k2")
    assert kl.dtype == torch.float32
    (g_ref,) = torch.autograd.grad(kl.sum(), ref, allow_unused=True)
    assert g_ref is None
    assert rk.kl_penalty(logp.detach().bfloat16(), ref.detach().bfloat16()).dtype == torch.float32
    assert rk.kl_penalty(logp.double(), ref.double()).dtype == torch.float64


def test_nan_propagates_elementwise():
    logp = torch.tensor([float("nan"), -1.0])
    out = rk.kl_penalty(logp, torch.tensor([-1.0, -1.0]))
    assert torch.isnan(out[0]) and out[1] == 0
