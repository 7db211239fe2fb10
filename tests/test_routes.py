"""Routes (issue 28): the route of a call is a value, chosen by one pure function, run through one table.

* ``choose_route`` on facts alone (no tensors): every rule of ``rlkernel.rl.routes``, and every key
  of the builders' table is reached by some facts (no dead builder, no route without one).
* End to end on the CPU (the Triton kernels in the interpreter, or the reference): each route a
  call can take reports itself in ``out.route`` and gives the composed reference's loss and
  gradient; ``rk.record_routes`` sees the primitives' routes.
* The device-built token-level route (mask counts + one row kernel): the same gradient bits as the
  host-built plan, the id check folded into its kernel, every mask dtype, windows of a base,
  in-place and retained-graph backwards.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import rlkernel as rk
from rlkernel._options import DEFAULTS
from rlkernel.ops.routes import Route, record_routes
from rlkernel.rl.fused import ROUTES
from rlkernel.rl.routes import RouteFacts, choose_route

# In the CPU suite (the interpreter) and, selected by the marker, in the GPU suite (compiled kernels).
pytestmark = pytest.mark.gpu
quiet = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's masked lanes
# The kernels run where the inputs are: the CPU interpreter here, the GPU on a CUDA machine.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = dict(atol=2e-6, rtol=2e-5)


# ----------------------------------------------------------------------------- the pure choice
def facts(**kw) -> RouteFacts:
    base = dict(source="logits", kernels="triton", compiling=False, needs_grad=True, vocab=151_936,
                token_level=True, closed_form=False, device_plan=True)  # fmt: skip
    return RouteFacts(**{**base, **kw})


CASES = [
    ("dapo, padded, V = 151,936: 2 passes", facts(), Route("logits", "token", "triton", 2, "device")),
    (
        "V above grad_in_forward_max_vocab: 3 passes",
        facts(vocab=300_000),
        Route("logits", "token", "triton", passes=3, plan="device"),
    ),
    ("small V: gradient in forward", facts(vocab=32_768), Route("logits", "token", "triton", 2, "device")),
    (
        "in place: 3 passes",
        facts(vocab=32_768, inplace_backward=True),
        Route("logits", "token", "triton", 3, "device"),
    ),
    ("no grad", facts(needs_grad=False), Route("logits", "token", "triton", passes=1, plan="device")),
    ("packed / rollout correction", facts(device_plan=False), Route("logits", "token", "triton", 2, "host")),
    ("compiled", facts(compiling=True), Route("logits", "token", "compiled", passes=3, plan="host")),
    ("gspo", facts(token_level=False, closed_form=True), Route("logits", "sequence", "triton", 3, "device")),
    (
        "gspo packed / rollout correction",
        facts(token_level=False, closed_form=True, device_plan=False),
        Route("logits", "sequence", "triton", passes=3, plan="host"),
    ),
    ("vespo", facts(token_level=False), Route("logits", "autograd", "triton", passes=3)),
    (
        "gspo without grad",
        facts(token_level=False, needs_grad=False),
        Route("logits", "composed", "triton", 1),
    ),
    ("gspo compiled", facts(token_level=False, compiling=True), Route("logits", "composed", "compiled", 3)),
    ("reference", facts(kernels="reference"), Route("logits", "composed", "reference")),
    (
        "hidden dapo",
        facts(source="hidden", gemm="epilogue", weight_grad=True),
        Route("hidden", "token", "triton", passes=3, plan="host", gemm="epilogue", grouping="auto"),
    ),
    (
        "hidden frozen weight",
        facts(source="hidden", gemm="cublas"),
        Route("hidden", "token", "triton", passes=3, plan="host", gemm="cublas"),
    ),
    (
        "hidden gspo",
        facts(source="hidden", token_level=False, closed_form=True, gemm="epilogue", weight_grad=True),
        Route("hidden", "composed", "triton", passes=4, gemm="epilogue", grouping="auto"),
    ),
    (
        "hidden vocab-parallel",
        facts(source="hidden", vocab_parallel=True),
        Route("hidden", "composed", "triton", passes=4, vocab_parallel=True),
    ),
    (
        "hidden, weight of another dtype",
        facts(source="hidden", dtypes_match=False, gemm="cublas"),
        Route("hidden", "composed", "triton", passes=4, gemm="cublas"),
    ),
    (
        "hidden reference",
        facts(source="hidden", kernels="reference"),
        Route("hidden", "composed", "reference"),
    ),
]


@pytest.mark.parametrize(("what", "given", "expected"), CASES, ids=[c[0] for c in CASES])
def test_choose_route_rules(what, given, expected):
    assert choose_route(given, DEFAULTS) == expected, what


def test_token_level_fusion_off_takes_the_composed_path_everywhere():
    off = dataclasses.replace(DEFAULTS, token_level_fusion=False)
    for _, given, _ in CASES:
        assert choose_route(given, off).objective == "composed"


def test_every_route_has_one_builder_and_every_builder_is_reached():
    reached = {choose_route(given, DEFAULTS).key for _, given, _ in CASES}
    reached |= {
        choose_route(facts(kernels="reference", source=s), DEFAULTS).key for s in ("logits", "hidden")
    }
    reached.add(("hidden", "composed", "compiled", None))  # the composed table row of every kernel kind
    assert reached <= set(ROUTES), reached - set(ROUTES)
    assert set(ROUTES) == reached, set(ROUTES) - reached


def test_route_reads_as_text():
    assert str(Route("logits", "token", "triton", passes=3, plan="device")) == (
        "logits -> token-level loss (constants on the device), triton, 3 passes"
    )
    hidden = Route("hidden", "token", "triton", passes=3, plan="host", gemm="epilogue", grouping="auto")
    assert (
        str(hidden)
        == "hidden -> token-level loss (constants on the host), triton, epilogue GEMM, 3 GEMMs, auto"
    )
    assert (
        str(Route("logits", "composed", "reference"))
        == "logits -> composed: log-probs, then policy_loss, reference"
    )


# -------------------------------------------------------------------------------- end to end
def _inputs(seed=0, b=3, p=2, t=6, v=40, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    base = (2 * torch.randn(b, p + t, v, generator=g)).to(dtype).requires_grad_(True)
    ids = torch.randint(0, v, (b, t), generator=g)
    lengths = torch.tensor([t, 2, 0, 4, 1][:b])
    mask = torch.arange(t)[None] < lengths[:, None]
    kw = dict(
        token_ids=ids,
        old_logp=torch.randn(b, t, generator=g) * 0.3 - 3.5,
        ref_logp=torch.randn(b, t, generator=g) * 0.3 - 3.5,
        advantages=torch.randn(b, generator=g),
        mask=mask,
        temperature=0.8,
    )
    base = base.detach().to(DEVICE).requires_grad_(True)
    return base, {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def _run(cfg, base, kw, window=True, **extra):
    logits = base[:, 1:-1] if window else base
    out = rk.fused_policy_loss(cfg, logits=logits, **kw, **extra)
    (grad,) = torch.autograd.grad(out.loss, base)
    return out, grad


DAPO = rk.PolicyLossConfig.preset("dapo", kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01)


@quiet
@pytest.mark.parametrize(
    ("cfg", "options", "expected"),
    [
        (DAPO, {}, Route("logits", "token", "triton", passes=2, plan="device")),
        (DAPO, {"grad_in_forward_max_vocab": 0}, Route("logits", "token", "triton", passes=3, plan="device")),
        (
            dataclasses.replace(DAPO, rollout_correction="token_tis"),
            {"grad_in_forward_max_vocab": 0},
            Route("logits", "token", "triton", passes=3, plan="host"),
        ),
        (rk.PolicyLossConfig.preset("gspo"), {}, Route("logits", "sequence", "triton", 3, "device")),
        (
            rk.PolicyLossConfig.preset("gspo", rollout_correction="token_tis"),
            {},
            Route("logits", "sequence", "triton", passes=3, plan="host"),
        ),
        (rk.PolicyLossConfig(loss_type="vespo"), {}, Route("logits", "autograd", "triton", passes=3)),
        (DAPO, {"token_level_fusion": False}, Route("logits", "composed", "triton", passes=3)),
    ],
    ids=["device-2pass", "device-3pass", "host-3pass", "sequence", "sequence-host", "autograd", "composed"],
)
def test_each_logits_route_reports_itself_and_equals_the_reference(cfg, options, expected):
    base, kw = _inputs(seed=3)
    if cfg.rollout_correction is not None:
        kw["rollout_logp"] = kw["old_logp"] + 0.1
    with rk.use_backend("triton"), rk.use_options(**options):
        got, g_got = _run(cfg, base, kw)
    with rk.use_backend("reference"):
        want, g_want = _run(cfg, base, kw)
    assert got.route == expected, str(got.route)
    assert want.route == Route("logits", "composed", "reference")
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    torch.testing.assert_close(g_got, g_want, **TOL)
    assert f"route='{got.route}'" in repr(got)


@quiet
def test_hidden_routes_report_themselves(smallest_linear_chunks):
    g = torch.Generator().manual_seed(5)
    h = torch.randn(2, 5, 8, generator=g).to(DEVICE).requires_grad_(True)
    w = torch.randn(24, 8, generator=g).to(DEVICE).requires_grad_(True)
    _, kw = _inputs(seed=5, b=2, t=5, v=24)
    with rk.use_backend("triton"):
        tok = rk.fused_policy_loss(DAPO, hidden=h, weight=w, **kw)
        seq = rk.fused_policy_loss(rk.PolicyLossConfig.preset("gspo"), hidden=h, weight=w, **kw)
    with rk.use_backend("reference"):
        ref = rk.fused_policy_loss(DAPO, hidden=h, weight=w, **kw)
    assert tok.route == Route(
        "hidden", "token", "triton", passes=3, plan="host", gemm="cublas", grouping="auto"
    )
    assert seq.route == Route("hidden", "composed", "triton", passes=4, gemm="cublas", grouping="auto")
    assert ref.route == Route("hidden", "composed", "reference")
    torch.testing.assert_close(tok.loss, ref.loss, atol=1e-5, rtol=1e-4)


@quiet
def test_record_routes_sees_primitives_and_one_route_per_loss_call(smallest_linear_chunks):
    base, kw = _inputs(seed=6)
    g = torch.Generator().manual_seed(6)
    h = torch.randn(4, 8, generator=g).to(DEVICE)
    w = torch.randn(24, 8, generator=g).to(DEVICE).requires_grad_(True)
    ids = torch.randint(0, 24, (4,), generator=g).to(DEVICE)
    with rk.use_backend("triton"), record_routes() as outer:
        rk.token_logprobs(base.detach(), torch.zeros(base.shape[:-1], dtype=torch.long, device=DEVICE))
        with record_routes() as inner:
            rk.linear_token_logprobs(h, w, ids)
        out = rk.fused_policy_loss(DAPO, logits=base[:, 1:-1], **kw)
    assert outer == [
        Route("logits", "logprobs", "triton", passes=1),
        Route("hidden", "logprobs", "triton", passes=4, gemm="cublas", grouping="auto"),
        out.route,  # its own route only, not the routes of what it runs
    ]
    assert inner == [outer[1]]
    with rk.use_backend("triton"):
        rk.token_logprobs(base.detach(), torch.zeros(base.shape[:-1], dtype=torch.long, device=DEVICE))
    assert len(outer) == 3  # nothing is recorded after the block


def test_record_routes_blocks_may_exit_out_of_order():
    a, b = record_routes(), record_routes()
    first, second = a.__enter__(), b.__enter__()
    a.__exit__(None, None, None)  # the outer one first (two generators holding blocks)
    with rk.use_backend("reference"):
        rk.token_logprobs(torch.randn(2, 5), torch.tensor([1, 2]))
    b.__exit__(None, None, None)
    assert first == [] and len(second) == 1


# ------------------------------------------------------------------- the device-built plan
def _host_plan_mask(mask):
    """The same mask values, not contiguous: the route then builds its constants on the host."""
    return mask.t().contiguous().t()


@quiet
@pytest.mark.parametrize("two_pass", [False, True])
@pytest.mark.parametrize(
    "aggregation",
    ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"],
)
def test_device_plan_gradient_is_bitwise_the_host_plans(aggregation, two_pass):
    cfg = dataclasses.replace(DAPO, aggregation=aggregation)
    results = []
    for host in (False, True):
        base, kw = _inputs(seed=7, b=4)
        if host:
            kw["mask"] = _host_plan_mask(kw["mask"])
        with rk.use_backend("triton"), rk.use_options(grad_in_forward_max_vocab=(1 << 30) * two_pass):
            out, grad = _run(cfg, base, kw)
        assert out.route.plan == ("host" if host else "device")
        results.append((out, grad))
    (dev, g_dev), (host, g_host) = results
    if two_pass:  # the gradient written by two compilations of one formula (the device kernel's pass 2
        # runs over the base's rows): the GPU's FMA contraction may differ by an ulp in a few elements
        torch.testing.assert_close(g_dev, g_host, atol=1e-9, rtol=1e-6)
    else:  # the same backward kernel on the same coefficients
        assert torch.equal(g_dev, g_host)
    torch.testing.assert_close(dev.loss, host.loss, atol=1e-7, rtol=1e-6)  # sum orders may differ
    for key, value in host.metrics.items():  # same code on same values (other mask layout)
        torch.testing.assert_close(dev.metrics[key], value, atol=1e-6, rtol=1e-6)


@quiet
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8, torch.int32, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32, torch.uint8])
def test_device_plan_reads_every_mask_and_id_dtype(mask_dtype, id_dtype):
    base, kw = _inputs(seed=8)
    kw["mask"] = kw["mask"].to(mask_dtype) * (2 if mask_dtype.is_floating_point else 1)
    kw["token_ids"] = torch.where(kw["mask"] != 0, kw["token_ids"], 0).to(id_dtype)
    with rk.use_backend("triton"):
        got, g_got = _run(DAPO, base, kw)
    with rk.use_backend("reference"):
        want, g_want = _run(DAPO, base, kw)
    assert got.route.plan == "device"
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    torch.testing.assert_close(g_got, g_want, **TOL)


@quiet
def test_device_plan_nan_mask_entries_are_active_as_torchs_mask_ne_0():
    base, kw = _inputs(seed=9)
    mask = kw["mask"].float()
    mask[0, 0] = float("nan")
    mask[2, 3] = float("nan")  # a masked row made active by NaN
    kw["mask"] = mask
    with rk.use_backend("triton"):
        got, g_got = _run(DAPO, base, kw)
    with rk.use_backend("reference"):
        want, g_want = _run(DAPO, base, kw)
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    torch.testing.assert_close(g_got, g_want, **TOL)


@quiet
@pytest.mark.parametrize("bad", [40, -1, -100])
def test_device_plan_checks_active_ids_in_its_own_kernel(bad):
    base, kw = _inputs(seed=10)
    kw["token_ids"][1, 1] = bad  # active (length 2)
    kw["token_ids"][2, 0] = 10_000  # masked: never looked at
    with rk.use_backend("triton"), record_routes() as routes:
        message = rf"token_ids \(at active mask positions\) has 1 id\(s\) .*first: {bad}"
        with pytest.raises(ValueError, match=message):
            rk.fused_policy_loss(DAPO, logits=base[:, 1:-1], **kw)  # the CPU: raises in the call
            rk.raise_pending_errors()  # CUDA: no host sync in the call, the error comes here
        out = rk.fused_policy_loss(DAPO, logits=base[:, 1:-1], validate=False, **kw)
    assert routes[0].plan == "device"
    assert torch.isnan(out.loss)  # unchecked: the bad id's log-prob is NaN, never a silent number


@quiet
def test_device_plan_on_policy_global_normalizers_and_all_masked():
    base, kw = _inputs(seed=11)
    kw["old_logp"] = None
    for extra in ({"global_tokens": 9.0}, {"global_tokens": torch.tensor(7.0, device=DEVICE)}):
        with rk.use_backend("triton"):
            got, g_got = _run(DAPO, base, kw, **extra)
        with rk.use_backend("reference"):
            want, g_want = _run(DAPO, base, kw, **extra)
        assert got.route.plan == "device"
        torch.testing.assert_close(got.loss, want.loss, **TOL)
        torch.testing.assert_close(g_got, g_want, **TOL)
    kw["mask"] = torch.zeros_like(kw["mask"])
    with rk.use_backend("triton"):
        out, grad = _run(DAPO, base, kw)
    assert out.loss.item() == 0.0 and torch.count_nonzero(grad) == 0


@quiet
@pytest.mark.parametrize("two_pass", [False, True])
def test_device_plan_window_gradient_is_zero_outside_and_other_layouts_work(two_pass):
    opts = {"grad_in_forward_max_vocab": (1 << 30) * two_pass}
    base, kw = _inputs(seed=12)
    with rk.use_backend("triton"), rk.use_options(**opts):
        _, g_window = _run(DAPO, base, kw)  # base[:, 1:-1]: the rows window
        flat = base.detach()[:, 1:-1].clone().requires_grad_(True)  # a fresh leaf
        out = rk.fused_policy_loss(DAPO, logits=flat, **kw)
        (g_flat,) = torch.autograd.grad(out.loss, flat)
        odd = base.detach().clone().requires_grad_(True)  # a window that is not whole rows
        sliced = {k: v[1:] if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        out = rk.fused_policy_loss(DAPO, logits=odd[1:, 1:-1], **sliced)
        (g_odd,) = torch.autograd.grad(out.loss, odd)
    assert torch.count_nonzero(g_window[:, 0]) == 0 and torch.count_nonzero(g_window[:, -1]) == 0
    if two_pass:  # two compilations of pass 2 (over the base's rows, over the leaf's): an ulp apart on GPUs
        torch.testing.assert_close(g_window[:, 1:-1], g_flat, atol=1e-9, rtol=1e-6)
    else:
        assert torch.equal(g_window[:, 1:-1], g_flat)
    assert torch.count_nonzero(g_odd[0]) == 0 and torch.count_nonzero(g_odd[:, -1]) == 0


@quiet
def test_device_plan_inplace_and_retained_graph_backwards():
    base, kw = _inputs(seed=13)
    # 3 passes for every call (an in-place backward is never the 2-pass route): one backward kernel
    with rk.use_backend("triton"), rk.use_options(grad_in_forward_max_vocab=0):
        _, want = _run(DAPO, base, kw)
        inplace = base.detach().clone().requires_grad_(True)
        out = rk.fused_policy_loss(DAPO, logits=inplace[:, 1:-1], inplace_backward=True, **kw)
        out.loss.backward()
        assert torch.equal(inplace.grad, want)
        assert inplace.grad.data_ptr() == inplace.data_ptr()  # written into the logits' storage
        twice = base.detach().clone().requires_grad_(True)
        out = rk.fused_policy_loss(DAPO, logits=twice[:, 1:-1], **kw)
        out.loss.backward(retain_graph=True)
        out.loss.backward()
    torch.testing.assert_close(twice.grad, 2 * want)
