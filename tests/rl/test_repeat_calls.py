"""A repeat call of ``fused_policy_loss`` from logits (``rlkernel.rl.repeat_calls``, issue 28): it
takes what the first call of its signature decided, checks nothing again, gives the same bits, and
every property a check reads is in the signature (a call that differs in one is checked in full)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import rlkernel as rk
from rlkernel.rl import _fused_call, repeat_calls

from .helpers import make_batch

B, T, P, V = 3, 5, 2, 13


def _args(seed=0, *, dtype=torch.float32, **changes) -> dict:
    """``fused_policy_loss``'s keyword arguments: logits sliced from a ``[B, P + T, V]`` output."""
    g = torch.Generator().manual_seed(seed)
    b = make_batch(B, T, seed=seed, dtype=dtype)
    base = torch.randn(B, P + T, V, generator=g, dtype=dtype, requires_grad=True)
    args = dict(
        logits=base[:, P - 1 : -1], token_ids=torch.randint(0, V, (B, T), generator=g),
        old_logp=b["old_logp"].detach(), advantages=b["advantages"].detach(), mask=b["mask"],
        ref_logp=b["ref_logp"].detach(), rollout_logp=None, rollout_weights=None, global_tokens=None,
        global_seqs=None, temperature=0.7, validate=True, inplace_backward=False, hidden=None, weight=None,
        bias=None, tp_group=None, cu_seqlens=None, invariant=False, logits_dtype=None, cp_group=None,
        cp_positions=None,
    )  # fmt: skip
    args.update(changes)
    return args


CFG = rk.PolicyLossConfig.preset("dapo", kl_coef=0.05)


@pytest.fixture
def full_checks(monkeypatch):
    """Counts the calls checked in full (from an empty table)."""
    repeat_calls.forget()
    seen = []
    real = _fused_call._full_checks

    def spy(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_fused_call, "_full_checks", spy)  # seam: count the full checks
    yield seen
    repeat_calls.forget()


def _loss_and_grad(cfg, args):
    out = rk.fused_policy_loss(cfg, **args)
    (grad,) = torch.autograd.grad(out.loss, args["logits"]._base)
    return out, grad


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("preset", ["dapo", "gspo"])
def test_a_repeat_call_checks_nothing_and_gives_the_same_bits(full_checks, backend, preset):
    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("CPU tensors reach the Triton kernels only in the interpreter (CPU suite)")
    cfg = rk.PolicyLossConfig.preset(preset)
    with rk.use_backend(backend):
        _loss_and_grad(cfg, _args(seed=1))  # the first call of the signature: checked, kept
        assert len(full_checks) == 1
        fresh = _args(seed=2)  # new values, same metadata
        out, grad = _loss_and_grad(cfg, fresh)
        assert len(full_checks) == 1  # the repeat checked nothing
        repeat_calls.forget()
        ref_out, ref_grad = _loss_and_grad(cfg, fresh)  # the same inputs, checked in full
        assert len(full_checks) == 2
    assert out.route == ref_out.route
    assert torch.equal(out.loss, ref_out.loss)
    assert torch.equal(grad, ref_grad)
    assert out.metrics.keys() == ref_out.metrics.keys()
    for name, value in out.metrics.items():
        assert torch.equal(value, ref_out.metrics[name]), name


VARIANTS = {
    "on-policy": dict(old_logp=None),
    "per-token advantages": "per_token",
    "no ref_logp": dict(ref_logp=None),
    "global_tokens number": dict(global_tokens=7),
    "global_tokens tensor": dict(global_tokens=torch.tensor(7.0)),
    "global_seqs float": dict(global_seqs=2.0),
    "rollout weights": dict(rollout_weights=torch.rand(B, T) + 0.5),
    "no validate": dict(validate=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("preset", ["dapo", "grpo", "gspo"])
def test_a_repeat_builds_the_batch_the_checks_build(variant, preset):
    """Field by field: the repeat's ``LossBatch`` and call equal the full checks' (the tensors the
    very objects given), and the route is the same."""
    change = VARIANTS[variant]
    cfg = rk.PolicyLossConfig.preset(preset, kl_coef=0.0 if change == dict(ref_logp=None) else 0.05)
    args = _args(advantages=torch.randn(B, T)) if change == "per_token" else _args(**change)
    repeat_calls.forget()
    with rk.use_backend("reference"):
        full, route, _ = _fused_call.checked_call(cfg, **args)
        again, again_route, compiling = _fused_call.checked_call(cfg, **args)
        assert repeat_calls.lookup(repeat_calls.signature(cfg, rk.current_options(), args)) is not None
    assert again_route == route and compiling is False
    for f in dataclasses.fields(full):
        a, b = getattr(full, f.name), getattr(again, f.name)
        if f.name == "batch":
            for g in dataclasses.fields(a):
                x, y = getattr(a, g.name), getattr(b, g.name)
                assert x is y if isinstance(x, torch.Tensor) else x == y, g.name
        else:
            assert a is b if isinstance(a, torch.Tensor) else a == b, f.name
    repeat_calls.forget()


def _window(base):
    return base[:, P - 1 : -1]


def _window_shift(args):
    base = args["logits"]._base
    return dict(logits=base[:, P:])  # the same shape and strides, one row further


CHANGES = {
    "logits dtype": lambda a: dict(logits=_window(a["logits"]._base.detach().double().requires_grad_())),
    "logits vocabulary": lambda a: dict(logits=_window(torch.randn(B, P + T, V + 1, requires_grad=True))),
    "logits not a view": lambda a: dict(logits=a["logits"].detach().clone().requires_grad_()),
    "logits strides": lambda a: dict(logits=torch.randn(T, B, V, requires_grad=True).transpose(0, 1)),
    "logits without grad": lambda a: dict(logits=a["logits"]._base.detach()[:, P - 1 : -1]),
    "window position": _window_shift,
    "token_ids dtype": lambda a: dict(token_ids=a["token_ids"].int()),
    "mask dtype": lambda a: dict(mask=a["mask"].float()),
    "mask strides": lambda a: dict(mask=a["mask"].t().contiguous().t()),
    "mask layout": lambda a: dict(mask=a["mask"].to_sparse()),
    "advantages per token": lambda a: dict(advantages=torch.randn(B, T)),
    "old_logp dtype": lambda a: dict(old_logp=a["old_logp"].double()),
    "old_logp absent": lambda a: dict(old_logp=None),
    "old_logp requires grad": lambda a: dict(old_logp=a["old_logp"].clone().requires_grad_()),
    "ref_logp absent": lambda a: dict(ref_logp=None),
    "rollout_logp given": lambda a: dict(rollout_logp=a["old_logp"].clone()),
    "temperature value": lambda a: dict(temperature=0.8),
    "temperature type": lambda a: dict(temperature=1),
    "validate": lambda a: dict(validate=False),
    "inplace_backward": lambda a: dict(inplace_backward=True),
    "global_tokens given": lambda a: dict(global_tokens=9.0),
    "global_tokens a tensor": lambda a: dict(global_tokens=torch.tensor(9.0)),
    "global_seqs given": lambda a: dict(global_seqs=3),
}


@pytest.mark.parametrize("name", list(CHANGES))
def test_every_property_a_check_reads_is_in_the_signature(name):
    args = _args()
    sig = repeat_calls.signature(CFG, rk.current_options(), args)
    assert sig is not None
    changed = {**args, **CHANGES[name](args)}
    other = repeat_calls.signature(CFG, rk.current_options(), changed)
    assert other is not None and other != sig


def test_the_config_options_backend_and_grad_mode_are_in_the_signature():
    args = _args()

    def sig(cfg=CFG):
        return repeat_calls.signature(cfg, rk.current_options(), args)

    first = sig()
    assert sig(rk.PolicyLossConfig.preset("dapo", kl_coef=0.06)) != first
    assert sig(rk.PolicyLossConfig.preset("dapo", kl_coef=0.05)) == first  # by value
    with rk.use_options(grad_in_forward_max_vocab=0):
        assert sig() != first
    with rk.use_backend("reference"):
        assert sig() != first
    with torch.no_grad():
        assert sig() != first


NOT_KEPT = {
    "hidden path": dict(logits=None, hidden=torch.randn(B, T, 4), weight=torch.randn(V, 4)),
    "packed": dict(cu_seqlens=torch.tensor([0, 5, 10, 15])),
    "tp_group": dict(tp_group=object()),
    "cp_group": dict(cp_group=object()),
    "invariant": dict(invariant=True),
    "logits_dtype": dict(logits_dtype=torch.float32),
    "a Parameter as logits": dict(logits=torch.nn.Parameter(torch.randn(B, T, V))),
    "validate an int": dict(validate=1),
    "temperature a tensor": dict(temperature=torch.tensor(0.7)),
    "global_tokens a string": dict(global_tokens="7"),
    "cfg a dict": "cfg",
}


@pytest.mark.parametrize("name", list(NOT_KEPT))
def test_calls_that_are_always_checked_in_full_have_no_signature(name):
    change = NOT_KEPT[name]
    cfg = {"preset": "dapo"} if change == "cfg" else CFG
    args = _args() if change == "cfg" else _args(**change)
    assert repeat_calls.signature(cfg, rk.current_options(), args) is None


def test_no_signature_while_compiling(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # seam: as inside a trace
    assert repeat_calls.signature(CFG, rk.current_options(), _args()) is None


def test_a_call_whose_checks_fail_is_never_kept(full_checks):
    bad = _args(mask=torch.ones(B, T + 1, dtype=torch.bool))
    with rk.use_backend("reference"):
        for _ in range(2):
            with pytest.raises(ValueError, match="mask"):
                rk.fused_policy_loss(CFG, **bad)
    assert len(full_checks) == 2  # checked in full both times
    assert repeat_calls.lookup(repeat_calls.signature(CFG, rk.current_options(), bad)) is None


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(token_ids=torch.zeros(B, T)), TypeError, "token_ids"),
        (dict(token_ids=torch.zeros(B, T + 1, dtype=torch.long)), ValueError, "token_ids"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(validate="yes"), TypeError, "validate"),
        (dict(advantages=torch.randn(B + 1)), ValueError, "advantages"),
    ],
)
def test_bad_input_after_a_kept_call_still_raises(full_checks, change, error, match):
    with rk.use_backend("reference"):
        rk.fused_policy_loss(CFG, **_args())
        with pytest.raises(error, match=match):
            rk.fused_policy_loss(CFG, **_args(**change))


def test_a_number_normalizer_is_checked_on_every_call(full_checks):
    """A number ``global_tokens`` / ``global_seqs`` is in the signature by its type only (gradient
    accumulation passes a new count each step): a repeat with another count gives the full checks'
    bits, and a bad count raises what the full checks raise."""
    cfg = rk.PolicyLossConfig.preset("grpo", kl_coef=0.05)  # seq-mean-token-mean: global_seqs too
    with rk.use_backend("reference"):
        rk.fused_policy_loss(cfg, **_args(global_tokens=7, global_seqs=2.0))  # kept
        fresh = _args(seed=3, global_tokens=11, global_seqs=3.0)
        out, grad = _loss_and_grad(cfg, fresh)
        assert len(full_checks) == 1  # a repeat
        for name, value in (("global_tokens", -1), ("global_seqs", math.inf)):
            with pytest.raises(ValueError, match=name):
                rk.fused_policy_loss(cfg, **_args(**{"global_tokens": 7, "global_seqs": 2.0, name: value}))
        assert len(full_checks) == 1
        repeat_calls.forget()
        ref_out, ref_grad = _loss_and_grad(cfg, fresh)
    assert torch.equal(out.loss, ref_out.loss) and torch.equal(grad, ref_grad)


def test_an_out_of_range_id_in_a_repeat_call_still_raises(full_checks):
    """The id check reads values: it runs on every call, kept or not."""
    with rk.use_backend("reference"):
        rk.fused_policy_loss(CFG, **_args())
        bad = _args()
        bad["token_ids"][0, 0] = V  # active: make_batch keeps row 0's first token
        with pytest.raises(ValueError, match="token_ids"):
            rk.fused_policy_loss(CFG, **bad)
    assert len(full_checks) == 1


def test_the_table_is_bounded(monkeypatch):
    repeat_calls.forget()
    monkeypatch.setattr(repeat_calls, "MAX_ENTRIES", 2)  # seam: a small bound
    with rk.use_backend("reference"):
        for t in (0.5, 0.6, 0.7):
            rk.fused_policy_loss(CFG, **_args(temperature=t))
            assert len(repeat_calls._DECIDED) <= 2
    repeat_calls.forget()
