"""``fused_policy_loss(logits=...)`` at real sizes: the fused token-level path against the composed
path ``policy_loss(token_logprobs(...))``, the 2-pass gradient-in-forward path against the 3-pass
one, an out-of-range id without validation, peak memory and kernel launches.

Inputs (one set per V, shared by the tests of a module run): bf16 logits ``2·randn [B, T, V]``,
B = 8, T = 1024, V ∈ {151,936, 32,768}; uniform ids, garbage (-1) at masked positions; response
lengths uniform in [0.8 T, T] (right padding); old/ref log-probs = the true log-probs + 0.1·randn
(a few % of the tokens clip); advantages ``randn [B]``; temperature 0.9.

Tolerances: the fused path computes the same fp32 per-token coefficients as autograd on the
composed path, up to the last bits: the loss within 1e-5 relative, the bf16 logits gradient within
2^-7 of its max (about one bf16 ulp), metrics within 1e-4.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import rlkernel as rk
from rlkernel.rl import token_loss

from .conftest import DEVICE, SIZES, generator, real_size_only

pytestmark = pytest.mark.gpu

S = SIZES.loss
TEMPERATURE = 0.9
LOSS_RTOL = 1e-5
GRAD_RTOL = 2**-7
METRIC_ATOL = 1e-4
CONFIGS = {  # label: (preset, overrides, has a token-level plan; else the fused coefficient path)
    "dapo+kl": ("dapo", dict(kl_coef=1e-3, kl_estimator="k3"), True),
    "cispo+kl(k3_unclamped)": ("cispo", dict(kl_coef=1e-3, kl_estimator="k3_unclamped"), True),
    "ppo": ("ppo", {}, True),
    "cispo": ("cispo", {}, True),
    "sapo": ("sapo", {}, True),
    "gspo": ("gspo", {}, False),
    "gspo_token+kl": ("gspo", dict(loss_type="gspo_token", kl_coef=1e-3), False),
    "gmpo+entropy": ("gmpo", dict(entropy_coef=1e-3), False),
}
THREE_PASS = dict(grad_in_forward_max_vocab=0)
TWO_PASS = dict(grad_in_forward_max_vocab=1 << 30)


def make_inputs(vocab: int, seed: int) -> SimpleNamespace:
    g = generator(seed)
    b, t = S.batch, S.seq_len
    logits = torch.randn(b, t, vocab, device=DEVICE, generator=g, dtype=torch.bfloat16).mul_(2)
    ids = torch.randint(0, vocab, (b, t), device=DEVICE, generator=g)
    lengths = torch.randint(int(0.8 * t), t + 1, (b,), device=DEVICE, generator=g)
    mask = torch.arange(t, device=DEVICE)[None, :] < lengths[:, None]
    with torch.no_grad():
        true = rk.token_logprobs(logits, ids, temperature=TEMPERATURE)
    return SimpleNamespace(
        logits=logits.requires_grad_(True),
        ids=torch.where(mask, ids, -1),
        mask=mask,
        old_logp=true + 0.1 * torch.randn(b, t, device=DEVICE, generator=g),
        ref_logp=true + 0.1 * torch.randn(b, t, device=DEVICE, generator=g),
        advantages=torch.randn(b, device=DEVICE, generator=g),
    )


@pytest.fixture(scope="module", params=S.vocabs, ids=lambda v: f"V{v}")
def inputs(request):
    """One set of inputs per vocabulary size, kept for the module's tests of that size."""
    return make_inputs(request.param, seed=request.param % 97)


def run_loss(cfg, inp, *, logits=None, validate=True, inplace=False, **options):
    """``fused_policy_loss`` on ``inp`` under ``rk.use_options(**options)``."""
    with rk.use_options(**options):
        return rk.fused_policy_loss(
            cfg,
            logits=inp.logits if logits is None else logits,
            token_ids=inp.ids,
            old_logp=inp.old_logp,
            advantages=inp.advantages,
            mask=inp.mask,
            ref_logp=inp.ref_logp if cfg.kl_coef > 0 else None,
            temperature=TEMPERATURE,
            validate=validate,
            inplace_backward=inplace,
        )


def loss_and_grad(cfg, inp, **options):
    out = run_loss(cfg, inp, **options)
    (grad,) = torch.autograd.grad(out.loss, inp.logits)
    return out, grad


def assert_same_loss_and_grad(got, g_got, want, g_want):
    assert bool(torch.isfinite(got.loss)), got.loss
    dloss = (got.loss - want.loss).abs().item()
    assert dloss <= LOSS_RTOL * max(abs(want.loss.item()), 1e-3), f"|Δloss| {dloss:.2e}"
    scale = g_want.abs().max().float().item()
    dgrad = (g_got.float() - g_want.float()).abs().max().item() / max(scale, 1e-30)
    assert dgrad <= GRAD_RTOL, f"max|Δgrad|/max|grad| {dgrad:.2e}"


def dapo_kl():
    return rk.PolicyLossConfig.preset("dapo", kl_coef=1e-3, kl_estimator="k3")


@pytest.mark.parametrize("label", list(CONFIGS))
def test_fused_path_matches_composed_path(inputs, label):
    """Loss, logits gradient and metrics of each objective on its fused path (the token-level plan,
    3-pass; the sequence-level ones: the fused coefficient path) against the composed path
    (``token_level_fusion=False``)."""
    preset, overrides, eligible = CONFIGS[label]
    cfg = rk.PolicyLossConfig.preset(preset, **overrides)
    assert token_loss.is_eligible(cfg) == eligible
    got, g_got = loss_and_grad(cfg, inputs, token_level_fusion=True, **THREE_PASS)
    want, g_want = loss_and_grad(cfg, inputs, token_level_fusion=False)
    assert_same_loss_and_grad(got, g_got, want, g_want)
    assert got.metrics.keys() == want.metrics.keys()
    for key, value in want.metrics.items():
        assert (got.metrics[key] - value).abs().item() <= METRIC_ATOL, key


def test_two_pass_matches_three_pass(inputs):
    """The gradient-in-forward path (2 passes over the logits) against the 3-pass fused path, for
    DAPO + KL at both vocabulary sizes (it is the default only for V <= 65,536)."""
    cfg = dapo_kl()
    got, g_got = loss_and_grad(cfg, inputs, **TWO_PASS)
    want, g_want = loss_and_grad(cfg, inputs, **THREE_PASS)
    assert_same_loss_and_grad(got, g_got, want, g_want)


@pytest.mark.cpu_smoke
def test_out_of_range_active_id_without_validation_gives_nan(inputs):
    """``validate=False`` and an active id >= V: the loss is NaN (the kernel flags it), not a number
    read out of bounds."""
    vocab = inputs.logits.shape[-1]
    ids = inputs.ids.clone()
    ids[0, 0] = vocab + 12345  # position (0, 0) is active: lengths >= 0.8 T
    bad = SimpleNamespace(**{**vars(inputs), "ids": ids})
    loss = run_loss(dapo_kl(), bad, validate=False).loss
    assert bool(torch.isnan(loss)), loss


def test_active_ignore_index_id_without_validation_gives_nan(inputs):
    """An *active* id equal to ignore_index (-100), ``validate=False``: NaN, not a dropped token."""
    ids = inputs.ids.clone()
    ids[0, 0] = -100
    loss = run_loss(dapo_kl(), SimpleNamespace(**{**vars(inputs), "ids": ids}), validate=False).loss
    assert bool(torch.isnan(loss)), loss


@pytest.mark.parametrize("label", ["dapo+kl", "gspo"])
def test_default_call_makes_no_host_sync(inputs, label):
    """Default arguments (``validate=True``), logits sliced from a larger output: forward and
    backward run under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any host sync."""
    preset, overrides, _ = CONFIGS[label]
    cfg = rk.PolicyLossConfig.preset(preset, **overrides)
    b, t, vocab = inputs.logits.shape
    base = torch.zeros(b, t + 1, vocab, device=DEVICE, dtype=inputs.logits.dtype)
    base[:, :-1].copy_(inputs.logits.detach())
    base.requires_grad_(True)
    run_loss(cfg, inputs, logits=base[:, :-1]).loss.backward()  # warm up (compiles, caches)
    torch.cuda.synchronize()
    rk.raise_pending_errors()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = run_loss(cfg, inputs, logits=base[:, :-1])
        out.loss.backward()
        rk.token_logprobs(inputs.logits.detach(), inputs.ids.clamp_min(0), return_entropy=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    rk.raise_pending_errors()  # nothing pending is bad: no error


def test_bad_id_with_default_validation_raises_at_the_next_call(inputs):
    """``validate=True`` (default) with an active id >= V on CUDA: no sync in the call, the loss is
    NaN at once, and the ValueError (count, first bad id) comes from the next checking call made
    after the GPU finished; ``rk.raise_pending_errors()`` raises it too (it waits)."""
    vocab = inputs.logits.shape[-1]
    ids = inputs.ids.clone()
    ids[0, 0], ids[1, 0] = vocab + 12345, vocab + 7
    bad = SimpleNamespace(**{**vars(inputs), "ids": ids})
    loss = run_loss(dapo_kl(), bad).loss
    assert bool(torch.isnan(loss)), loss
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=rf"2 id\(s\) outside \[0, {vocab}\).*first: {vocab + 12345}"):
        run_loss(dapo_kl(), inputs)
    rk.raise_pending_errors()  # raised once: nothing left
    run_loss(dapo_kl(), bad)
    with pytest.raises(ValueError, match="first: "):
        rk.raise_pending_errors()
    with pytest.raises(ValueError, match="token_ids has 2 id"):
        rk.token_logprobs(inputs.logits.detach(), ids.clamp(0, vocab), ignore_index=-100)
        rk.raise_pending_errors()


@real_size_only
def test_fused_inplace_peak_extra_memory_per_token(inputs):
    """DAPO + KL fused forward + backward with ``inplace_backward=True``, ``validate=False``: at most
    64 bytes per token of memory beyond the inputs (the per-token coefficients; measured 21 B/token
    on an H100 at V = 151,936, where one bf16 logits gradient would be 304 KB per token)."""
    cfg = dapo_kl()
    run_loss(cfg, inputs)  # compile and warm up on the shared inputs (no backward: nothing written)
    leaf = inputs.logits.detach().clone().requires_grad_(True)  # the in-place backward overwrites it
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = run_loss(cfg, inputs, logits=leaf, validate=False, inplace=True)
    out.loss.backward()
    torch.cuda.synchronize()
    per_token = (torch.cuda.max_memory_allocated() - before) / inputs.ids.numel()
    assert per_token <= 64, f"{per_token:.1f} bytes per token"


@real_size_only
def test_fused_loss_launches_far_fewer_kernels_than_composed(inputs):
    """CUDA kernels (memcpy/memset included, ``torch.profiler``) of one DAPO + KL forward + backward,
    ``validate=False``: the fused path at most a quarter of the composed path's (measured 10 vs
    141 on an H100; the composed path runs the loss algebra as ~100 small kernels)."""
    from torch.profiler import ProfilerActivity, profile

    cfg = dapo_kl()
    counts = {}
    for fused in (True, False):

        def call(fused=fused):
            out = run_loss(cfg, inputs, validate=False, token_level_fusion=fused)
            torch.autograd.grad(out.loss, (inputs.logits,))

        call()  # compile / warm up outside the profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        counts[fused] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    assert 0 < counts[True] and counts[True] * 4 <= counts[False], (
        f"fused {counts[True]}, composed {counts[False]}"
    )


@real_size_only
@pytest.mark.parametrize("route", ["3pass", "2pass", "inplace"])
def test_sliced_logits_backward_holds_one_base_sized_buffer(inputs, route):
    """The trainer's call: the logits are ``out[:, P - 1 : -1]`` of a ``[B, P + T, V]`` model output
    (P = 64) that requires grad. DAPO + KL forward + backward, ``validate=False``: the base's
    gradient is written directly, so the peak beyond the inputs is at most one base-sized bf16
    buffer plus 64 B/token (none in place), where autograd's slice backward would hold a zero-filled
    base plus the window's gradient; the base's gradient is bitwise the one through a contiguous
    copy of the view, exactly zero outside the window."""
    cfg = dapo_kl()
    b, t, vocab = inputs.logits.shape
    p = 64
    base = torch.empty(b, p + t, vocab, device=DEVICE, dtype=torch.bfloat16)
    base.normal_(generator=generator(5)).mul_(2)
    base[:, p - 1 : -1].copy_(inputs.logits.detach())
    options = dict(grad_in_forward_max_vocab=1 << 30 if route == "2pass" else 0)
    leaf = base.clone().requires_grad_(True)
    run_loss(cfg, inputs, logits=leaf[:, p - 1 : -1], validate=False, **options)  # warm up, no backward
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = run_loss(
        cfg, inputs, logits=leaf[:, p - 1 : -1], validate=False, inplace=route == "inplace", **options
    )
    out.loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before - (0 if route == "inplace" else leaf.numel() * 2)
    assert peak <= 64 * b * t, (
        f"{peak / 2**20:.0f} MiB beyond {'nothing' if route == 'inplace' else 'one base'}"
    )
    want_leaf = base.clone().requires_grad_(True)
    want = run_loss(cfg, inputs, logits=want_leaf[:, p - 1 : -1].contiguous(), validate=False, **options)
    want.loss.backward()
    assert torch.equal(out.loss, want.loss)
    if route != "inplace":  # in place, the base itself became the gradient: compare the same bits
        assert torch.equal(leaf.grad, want_leaf.grad)
    else:
        assert torch.equal(leaf.grad, want_leaf.grad) and leaf.grad.data_ptr() == leaf.data_ptr()
    assert bool((leaf.grad[:, : p - 1] == 0).all()) and bool((leaf.grad[:, -1] == 0).all())


@pytest.mark.parametrize("label", ["dapo+kl", "gspo"])
def test_forward_backward_captured_in_a_cuda_graph_replays_with_new_inputs(inputs, label):
    """``fused_policy_loss`` forward + backward (default arguments) captured in one CUDA graph and
    replayed after copying new inputs into the static tensors: loss and logits gradient equal an
    eager call on the new inputs (bitwise: the same kernels in the same order)."""
    preset, overrides, _ = CONFIGS[label]
    cfg = rk.PolicyLossConfig.preset(preset, **overrides)
    static = SimpleNamespace(**{k: v.detach().clone() for k, v in vars(inputs).items()})
    static.logits.requires_grad_(True)

    def step():
        out = run_loss(cfg, static)
        (grad,) = torch.autograd.grad(out.loss, static.logits)
        return out.loss.detach(), grad

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile, allocator) off the capture stream
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss_out, grad_out = step()

    fresh = make_inputs(inputs.logits.shape[-1], seed=123)
    with torch.no_grad():
        for name in ("logits", "ids", "mask", "old_logp", "ref_logp", "advantages"):
            getattr(static, name).copy_(getattr(fresh, name))
    graph.replay()
    torch.cuda.synchronize()
    want = run_loss(cfg, fresh)
    (g_want,) = torch.autograd.grad(want.loss, fresh.logits)
    assert torch.equal(loss_out, want.loss.detach()), (loss_out, want.loss)
    assert torch.equal(grad_out, g_want)


@pytest.mark.parametrize("label", ["dapo+kl", "sapo"])
def test_torch_compile_fullgraph_keeps_the_fused_op(inputs, label):
    """``torch.compile(fullgraph=True)`` (Inductor) of a forward + backward with ``validate=False``
    (the id check is eager-only): the token-level objective runs as the registered custom op
    ``rlkernel::token_loss_from_logits``; loss and logits gradient equal the eager fused call's."""
    preset, overrides, _ = CONFIGS[label]
    cfg = rk.PolicyLossConfig.preset(preset, **overrides)

    def step(logits, ids, mask, old, ref, adv):
        out = rk.fused_policy_loss(cfg, logits=logits, token_ids=ids, mask=mask, old_logp=old,
                                   ref_logp=ref if cfg.kl_coef > 0 else None, advantages=adv,
                                   temperature=TEMPERATURE, validate=False)  # fmt: skip
        return out.loss

    args = (inputs.ids, inputs.mask, inputs.old_logp, inputs.ref_logp, inputs.advantages)
    want = step(inputs.logits, *args)
    (g_want,) = torch.autograd.grad(want, inputs.logits)
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(inputs.logits, *args)
    (g_got,) = torch.autograd.grad(got, inputs.logits)
    assert_same_loss_and_grad(SimpleNamespace(loss=got), g_got, SimpleNamespace(loss=want), g_want)
