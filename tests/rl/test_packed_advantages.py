"""Packed per-sequence advantages when the token count equals the sequence count (issue 29).

``cu_seqlens = [0, 2, 2, 3]`` holds 3 tokens in 3 sequences (one empty): a 1-D advantages tensor of
length 3 could be one per sequence or one per token, and was read per token, silently (10.5 instead
of 2.5). The rule now (``rl.batch.advantages_layout``): ``[S, 1]`` is always one per sequence; a 1-D
``[N]`` with N = S raises ``ValueError`` unless every sequence holds one token (both readings agree).
Checked for ``policy_loss`` and ``fused_policy_loss`` against the float64 formulas.
"""

from __future__ import annotations

import pytest
import torch

import rlkernel as rk

from . import formulas
from .helpers import config

CU = torch.tensor([0, 2, 2, 3])  # N = S = 3, the middle sequence empty


def _inputs(seed=0, n=3):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, generator=g, dtype=torch.float64) * 2 - 0.1
    old = logp + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64) * 3
    return logp, old, adv, torch.ones(n, dtype=torch.bool)


def _oracle(cfg, logp, old, adv_tokens, mask, cu):
    seqs = formulas.sequences_from_packed(cu, mask, logp=logp, old=old, adv=adv_tokens)
    return formulas.policy_loss(cfg, seqs, width=int((cu[1:] - cu[:-1]).max()))


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_policy_loss_per_sequence_as_column(name, aggregation):
    cfg = config(name, aggregation=aggregation)
    logp, old, adv, mask = _inputs()
    per_token = adv[torch.repeat_interleave(torch.arange(3), CU[1:] - CU[:-1])]  # A_i at each token
    want = _oracle(cfg, logp, old, per_token, mask, CU)
    got = rk.policy_loss(logp, old, adv[:, None], mask, cfg, cu_seqlens=CU).loss
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-9)
    # and not the per-token reading of the same numbers (the old silent result)
    assert abs(got.item() - _oracle(cfg, logp, old, adv, mask, CU).item()) > 1e-3


@pytest.mark.parametrize("api", ["policy_loss", "fused_policy_loss"])
def test_ambiguous_1d_advantages_raise(api):
    logp, old, adv, mask = _inputs()
    cfg = config("ppo")
    with pytest.raises(ValueError, match=r"advantages of shape \(3,\) are ambiguous.*\[S, 1\]"):
        if api == "policy_loss":
            rk.policy_loss(logp, old, adv, mask, cfg, cu_seqlens=CU)
        else:
            logits = torch.randn(3, 11, dtype=torch.float64)
            rk.fused_policy_loss(cfg, logits=logits, token_ids=torch.tensor([1, 4, 7]), old_logp=old,
                                 advantages=adv, mask=mask, cu_seqlens=CU)  # fmt: skip


def test_one_token_per_sequence_is_not_ambiguous():
    """N = S with every sequence of one token: both readings are the same numbers; accepted."""
    logp, old, adv, mask = _inputs(1)
    cu = torch.arange(4)
    cfg = config("ppo", aggregation="seq-mean-token-mean")
    got = rk.policy_loss(logp, old, adv, mask, cfg, cu_seqlens=cu).loss
    torch.testing.assert_close(got, _oracle(cfg, logp, old, adv, mask, cu), atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(rk.policy_loss(logp, old, adv[:, None], mask, cfg, cu_seqlens=cu).loss, got)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("name", ["ppo", "gspo"])
def test_fused_policy_loss_per_sequence_as_column(backend, name):
    """``fused_policy_loss`` (token-level plan for ppo, the sequence plan for gspo) with ``[S, 1]``:
    the float64 formula on its own log-probs, and the gradient of ``policy_loss(token_logprobs)``."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 11, generator=g, requires_grad=True)
    ids = torch.tensor([1, 4, 7])
    _, old, adv, mask = _inputs(3)
    old, adv = old.float(), adv.float()
    cfg = config(name, aggregation="token-mean")
    with rk.use_backend(backend):
        out = rk.fused_policy_loss(cfg, logits=logits, token_ids=ids, old_logp=old, advantages=adv[:, None],
                                   mask=mask, cu_seqlens=CU)  # fmt: skip
        (grad,) = torch.autograd.grad(out.loss, [logits])
    logp = torch.log_softmax(logits.detach().double(), -1)[torch.arange(3), ids]
    per_token = adv.double()[torch.repeat_interleave(torch.arange(3), CU[1:] - CU[:-1])]
    want = _oracle(cfg, logp, old.double(), per_token, mask, CU)
    torch.testing.assert_close(out.loss.double(), want, atol=2e-6, rtol=2e-6)
    logp_t = rk.token_logprobs(logits, ids)
    ref_loss = rk.policy_loss(logp_t, old, adv[:, None], mask, cfg, cu_seqlens=CU).loss
    (ref_grad,) = torch.autograd.grad(ref_loss, [logits])
    torch.testing.assert_close(grad, ref_grad, atol=2e-6, rtol=2e-6)


def test_column_advantages_are_packed_only_and_sized_by_sequences():
    logp, old, adv, mask = _inputs()
    cfg = config("ppo")
    with pytest.raises(ValueError, match=r"advantages must have shape \(3,\), \(3, 1\)"):
        rk.policy_loss(logp, old, torch.zeros(2, 1, dtype=torch.float64), mask, cfg, cu_seqlens=CU)
    padded = (logp.view(1, 3), old.view(1, 3), None, mask.view(1, 3))
    with pytest.raises(ValueError, match=r"advantages must have shape \(1,\) \(one per sequence\)"):
        rk.policy_loss(padded[0], padded[1], torch.zeros(1, 1, dtype=torch.float64), padded[3], cfg)
