"""A repeat call of ``fused_policy_loss`` from logits on CUDA (``rlkernel.rl.repeat_calls``, issue 28)
at real sizes: the call that takes its first call's kept decision gives the bits of the same call
checked in full (loss, the base's gradient, metrics), on the device-plan routes (DAPO + KL: mask
counts + rows with the gradient written in the forward; GSPO: + the sequence kernel), for logits
sliced from a model output ``[B, P + T, V]``; and its id check still runs (deferred on CUDA: a bad
active id makes the loss NaN and is raised by the next checking call).

Inputs: bf16 ``2·randn``, B = 8, T = 1024, P = 128, V ∈ {151,936, 32,768}, ragged lengths in
[T/4, T], garbage ids (-1) at masked positions.
"""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk
from rlkernel.rl import repeat_calls

from .conftest import DEVICE, SIZES, SMOKE, generator

pytestmark = pytest.mark.gpu

S = SIZES.loss
CONFIGS = {
    "dapo+kl": rk.PolicyLossConfig.preset("dapo", kl_coef=1e-3),
    "gspo": rk.PolicyLossConfig.preset("gspo"),
}


def _inputs(vocab: int, seed: int):
    g = generator(seed)
    b, t, p = S.batch, S.seq_len, 8 if S.seq_len < 64 else 128
    base = torch.randn(b, p + t, vocab, device=DEVICE, generator=g, dtype=torch.bfloat16).mul_(2)
    ids = torch.randint(0, vocab, (b, t), device=DEVICE, generator=g)
    lengths = torch.randint(max(t // 4, 1), t + 1, (b,), device=DEVICE, generator=g)
    mask = torch.arange(t, device=DEVICE)[None, :] < lengths[:, None]
    kw = dict(
        token_ids=torch.where(mask, ids, -1),
        old_logp=-torch.rand(b, t, device=DEVICE, generator=g) * 5,
        ref_logp=-torch.rand(b, t, device=DEVICE, generator=g) * 5,
        advantages=torch.randn(b, device=DEVICE, generator=g),
        mask=mask,
        temperature=0.9,
    )
    return base.requires_grad_(True), p, kw


def _call(cfg, base, p, kw):
    out = rk.fused_policy_loss(cfg, logits=base[:, p - 1 : -1], **kw)
    (grad,) = torch.autograd.grad(out.loss, base)
    return out, grad


SMOKE_CASE = (S.vocabs[-1], "dapo+kl")  # also run in the CPU suite (cpu_smoke): keeps this code working
CASES = [
    pytest.param(vocab, label, marks=[pytest.mark.cpu_smoke] if (vocab, label) == SMOKE_CASE else [])
    for vocab in S.vocabs
    for label in CONFIGS
]


@pytest.mark.parametrize(("vocab", "label"), CASES)
def test_a_repeat_call_gives_the_bits_of_the_full_checks(vocab, label):
    cfg = CONFIGS[label]
    repeat_calls.forget()
    _call(cfg, *_inputs(vocab, seed=1))  # the first call of the signature: checked in full, kept
    base, p, kw = _inputs(vocab, seed=2)  # new values, the same metadata
    out, grad = _call(cfg, base, p, kw)
    signature = repeat_calls.signature(cfg, rk.current_options(), _arguments(base, p, kw))
    assert repeat_calls.lookup(signature) is not None  # (the call above took the kept decision)
    repeat_calls.forget()
    full, full_grad = _call(cfg, base, p, kw)  # the same inputs, checked in full
    assert out.route == full.route and out.route.plan == "device"
    assert torch.equal(out.loss, full.loss)
    assert torch.equal(grad, full_grad)
    for name, value in full.metrics.items():
        assert torch.equal(out.metrics[name], value), name
    repeat_calls.forget()


def _arguments(base, p, kw) -> dict:
    """``fused_policy_loss``'s keyword arguments of :func:`_call` (its defaults for the rest)."""
    none = ("rollout_logp", "rollout_weights", "global_tokens", "global_seqs", "hidden", "weight", "bias",
            "tp_group", "cu_seqlens", "logits_dtype", "cp_group", "cp_positions")  # fmt: skip
    return dict(dict.fromkeys(none), logits=base[:, p - 1 : -1], validate=True, inplace_backward=False,
                invariant=False, **kw)  # fmt: skip


@pytest.mark.skipif(SMOKE, reason="the deferral is CUDA's (the CPU raises inside the call)")
def test_a_bad_id_in_a_repeat_call_is_nan_now_and_raised_by_the_next_call():
    cfg = CONFIGS["dapo+kl"]
    vocab = S.vocabs[-1]
    rk.raise_pending_errors()
    repeat_calls.forget()
    _call(cfg, *_inputs(vocab, seed=3))  # kept
    rk.raise_pending_errors()  # nothing pending
    base, p, kw = _inputs(vocab, seed=4)
    ids = kw["token_ids"].clone()
    ids[0, 0] = vocab + 5  # active: every length >= T/4
    out, _ = _call(cfg, base, p, {**kw, "token_ids": ids})
    assert bool(torch.isnan(out.loss))
    with pytest.raises(ValueError, match=rf"1 id\(s\) outside \[0, {vocab}\).*first: {vocab + 5}"):
        rk.raise_pending_errors(wait=False)
    repeat_calls.forget()
