"""The sequence-ratio loss from logits with its plan built on the device (route ``sequence``/``device``:
``rl.seq_token_loss.device_seq_plan``, ``kernels.seq_plan``, ``ops.device_seq_plan``).

Each call is compared with (1) the same call on the host-built plan (route ``sequence``/``host``,
taken because ``old_logp`` is given as a non-contiguous view: the route's own rule, no patching):
the same kernels' code on the same per-token constants, so log-probs and gradients are bitwise
equal and the loss equal to fp32 rounding (a fixed-order sum either way, of other partials); and
(2) the composed path on the reference backend (``policy_loss`` under autograd). Inputs are fresh
random, ragged masks with an all-masked row and garbage ids at masked positions; the Triton kernels
run in the CPU interpreter at tiny sizes.
"""

import itertools

import pytest
import torch

import rlkernel as rk
from rlkernel.ops.routes import Route

from .helpers import AGGREGATIONS as HELPER_AGGREGATIONS
from .helpers import config

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
B, T, V = 3, 5, 11
TOL = dict(atol=2e-6, rtol=2e-5)
DEVICE_ROUTE = Route("logits", "sequence", "triton", passes=3, plan="device")
HOST_ROUTE = Route("logits", "sequence", "triton", passes=3, plan="host")
SEQ_TYPES = ("gspo", "gspo_token", "gmpo")
AGGREGATIONS = (*HELPER_AGGREGATIONS, "token-sum")

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's NaN/inf warnings


def _inputs(seed, *, per_seq_adv=True, mask_dtype=torch.bool, ids_dtype=torch.int64):
    """A base ``[B, T + 2, V]`` leaf whose window ``[:, 1:-1]`` are the logits, and the call's kwargs:
    a ragged mask with row 1 all masked, ids with garbage (-1, V + 3) at masked positions."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, T + 2, V, generator=g) * 2
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0, 0] = True
    mask[1] = False
    ids = torch.randint(0, V, (B, T), generator=g)
    garbage = torch.where(torch.rand(B, T, generator=g) > 0.5, -1, V + 3)
    ids = torch.where(mask, ids, garbage if ids_dtype.is_signed else V + 3)  # no -1 in an unsigned dtype
    true = torch.log_softmax(base[:, 1:-1], -1).gather(-1, ids.clamp(0, V - 1)[..., None])[..., 0]
    kw = dict(
        token_ids=ids.to(ids_dtype),
        old_logp=true + 0.2 * torch.randn(B, T, generator=g),
        ref_logp=true + 0.3 * torch.randn(B, T, generator=g),
        advantages=torch.randn(B, generator=g) if per_seq_adv else torch.randn(B, T, generator=g),
        mask=mask.to(mask_dtype),
    )
    kw = {k: v.to(DEVICE) for k, v in kw.items()}
    return base.to(DEVICE).requires_grad_(True), kw


def _run(cfg, base, kw, *, backend="triton", host=False, window=True, **extra):
    """``(out, loss, grad of base)``; ``host``: old_logp as a non-contiguous view (the host route)."""
    kw = dict(kw)
    if host and kw.get("old_logp") is not None:
        kw["old_logp"] = kw["old_logp"].t().contiguous().t()
        assert not kw["old_logp"].is_contiguous()
    logits = base[:, 1:-1] if window else base
    with rk.use_backend(backend):
        out = rk.fused_policy_loss(cfg, logits=logits, **kw, **extra)
        (grad,) = torch.autograd.grad(out.loss, base)
    return out, out.loss.detach(), grad


def _check(cfg, base, kw, **extra):
    dev, loss, grad = _run(cfg, base, kw, **extra)
    host, h_loss, h_grad = _run(cfg, base, kw, host=True, **extra)
    ref, r_loss, r_grad = _run(cfg, base, kw, backend="reference", **extra)
    assert dev.route == DEVICE_ROUTE, str(dev.route)
    assert host.route == HOST_ROUTE, str(host.route)
    torch.testing.assert_close(grad, h_grad, rtol=0, atol=0, equal_nan=True)  # same constants, same code
    torch.testing.assert_close(loss, h_loss, **TOL, equal_nan=True)
    torch.testing.assert_close(loss, r_loss.to(loss.dtype), **TOL, equal_nan=True)
    torch.testing.assert_close(grad, r_grad, **TOL, equal_nan=True)
    for key, value in ref.metrics.items():
        torch.testing.assert_close(dev.metrics[key], value, atol=1e-5, rtol=1e-5, equal_nan=True)
    return loss, grad


@pytest.mark.parametrize(("name", "aggregation"), list(itertools.product(SEQ_TYPES, AGGREGATIONS)))
def test_matches_the_host_plan_and_policy_loss(name, aggregation):
    base, kw = _inputs(seed=len(name) + len(aggregation))
    _check(config(name, aggregation=aggregation), base, kw)


@pytest.mark.parametrize("name", SEQ_TYPES)
def test_kl_entropy_per_token_advantages_and_product_ratio(name):
    base, kw = _inputs(seed=7, per_seq_adv=False)
    extra = {} if name == "gmpo" else {"seq_ratio": "product"}
    cfg = config(name, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.05, **extra)
    _check(cfg, base, kw)


@pytest.mark.parametrize("name", SEQ_TYPES)
def test_on_policy(name):
    base, kw = _inputs(seed=8)
    kw["old_logp"] = None
    dev, loss, grad = _run(config(name, kl_coef=0.05), base, kw)
    ref, r_loss, r_grad = _run(config(name, kl_coef=0.05), base, kw, backend="reference")
    assert dev.route == DEVICE_ROUTE
    torch.testing.assert_close(loss, r_loss, **TOL)
    torch.testing.assert_close(grad, r_grad, **TOL)


@pytest.mark.parametrize("normalizer", ["float", "tensor", "zero"])
def test_global_normalizers(normalizer):
    base, kw = _inputs(seed=9)
    value = {"float": 4.0, "tensor": torch.tensor(6.0, device=DEVICE), "zero": 0.0}[normalizer]
    loss, _ = _check(config("gspo", aggregation="seq-mean-token-mean"), base, kw, global_seqs=value)
    assert torch.isnan(loss) == (normalizer == "zero")  # 0 with active tokens: NaN, as policy_loss
    _check(config("gspo_token", aggregation="token-mean"), base, kw, global_tokens=value)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.int32, torch.uint8, torch.float32])
def test_mask_dtypes(mask_dtype):
    base, kw = _inputs(seed=10, mask_dtype=mask_dtype)
    _check(config("gmpo"), base, kw)


def test_nan_mask_entries_are_active():
    base, kw = _inputs(seed=11, mask_dtype=torch.float32)
    kw["mask"][2, 1] = float("nan")  # != 0: active, as torch's mask != 0 everywhere
    _check(config("gspo", kl_coef=0.1), base, kw)


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_id_dtypes(ids_dtype):
    base, kw = _inputs(seed=12, ids_dtype=ids_dtype)
    _check(config("gspo_token"), base, kw)


def test_contiguous_logits_and_inplace_backward():
    base, kw = _inputs(seed=13)
    leaf = base.detach()[:, 1:-1].contiguous().requires_grad_(True)
    cfg = config("gspo", entropy_coef=0.01)
    _, loss, grad = _run(cfg, leaf, kw, window=False)
    _, r_loss, r_grad = _run(cfg, leaf, kw, window=False, backend="reference")
    torch.testing.assert_close(loss, r_loss, **TOL)
    torch.testing.assert_close(grad, r_grad, **TOL)
    inplace = leaf.detach().clone().requires_grad_(True)
    out, i_loss, i_grad = _run(cfg, inplace, kw, window=False, inplace_backward=True)
    assert out.route == DEVICE_ROUTE
    torch.testing.assert_close(i_loss, loss, rtol=0, atol=0)
    torch.testing.assert_close(i_grad, grad, rtol=0, atol=0)


def test_window_gradient_is_zero_outside_the_window():
    base, kw = _inputs(seed=14)
    _, grad = _check(config("gspo"), base, kw)
    assert torch.count_nonzero(grad[:, 0]) == 0 and torch.count_nonzero(grad[:, -1]) == 0
    assert torch.count_nonzero(grad[:, 1:-1]) > 0


def test_all_masked_batch_gives_zero():
    base, kw = _inputs(seed=15)
    kw["mask"] = torch.zeros_like(kw["mask"])
    out, loss, grad = _run(config("gmpo", entropy_coef=0.1, kl_coef=0.1), base, kw)
    assert out.route == DEVICE_ROUTE
    assert loss.item() == 0.0 and torch.count_nonzero(grad) == 0


def test_empty_batch():
    base, kw = _inputs(seed=16)
    kw = {k: v[:0] for k, v in kw.items()}
    out, loss, grad = _run(config("gspo"), base[:0].detach().requires_grad_(True), kw)
    assert loss.item() == 0.0 and grad.numel() == 0


@pytest.mark.parametrize("bad", [V, V + 100, -1, -100])
def test_bad_active_id_raises_as_the_host_route(bad):
    """The deferred id check (counted in the row kernel) raises the host route's error; here (the
    CPU interpreter) at the call, on CUDA at a later call."""
    base, kw = _inputs(seed=17)
    kw["token_ids"], kw["mask"] = kw["token_ids"].clone(), kw["mask"].clone()
    kw["token_ids"][2, 3], kw["token_ids"][0, 4] = bad, V + 1  # two bad ids: the count and the first
    kw["mask"][2, 3] = kw["mask"][0, 4] = True
    messages = []
    for host in (False, True):
        with pytest.raises(ValueError, match=r"token_ids \(at active mask positions\)") as err:
            _run(config("gspo"), base, kw, host=host)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and "2 id(s)" in messages[0], messages
    _, loss, _ = _run(config("gspo"), base, kw, validate=False)  # unchecked: the bad id's logp is NaN
    assert torch.isnan(loss)


def test_packed_per_sequence_advantages_keep_the_host_plan():
    """Packed input (``cu_seqlens``, ``[S, 1]`` advantages): the host-built plan, as before."""
    g = torch.Generator().manual_seed(18)
    cu = torch.tensor([0, 4, 6, 11], device=DEVICE)
    n = 11
    logits = (torch.randn(n, V, generator=g) * 2).to(DEVICE).requires_grad_(True)
    kw = dict(
        token_ids=torch.randint(0, V, (n,), generator=g).to(DEVICE),
        old_logp=(-torch.rand(n, generator=g) * 3).to(DEVICE),
        advantages=torch.randn(3, 1, generator=g).to(DEVICE),
        mask=(torch.rand(n, generator=g) > 0.2).to(DEVICE),
        cu_seqlens=cu,
    )
    results = []
    for backend in ("triton", "reference"):
        with rk.use_backend(backend):
            out = rk.fused_policy_loss(config("gspo"), logits=logits, **kw)
            results.append((out.route, out.loss.detach(), *torch.autograd.grad(out.loss, logits)))
    assert results[0][0] == HOST_ROUTE
    torch.testing.assert_close(results[0][1], results[1][1], **TOL)
    torch.testing.assert_close(results[0][2], results[1][2], **TOL)
