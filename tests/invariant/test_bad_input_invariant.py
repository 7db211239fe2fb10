"""Bad input to the public functions of ``rlkernel.invariant``: one case each, a TypeError/ValueError
naming the argument. The ops' full bad-input tables live beside their tests (test_matmul.py,
test_rmsnorm.py, test_attention.py, test_patch.py); ``COVERED`` registers them for the public-API
walker (tests/test_public_api_bad_input.py)."""

from __future__ import annotations

import pytest
import torch

from rlkernel import invariant

COVERED = [
    invariant.attention,
    invariant.matmul,
    invariant.linear,
    invariant.rms_norm,
    invariant.patch_hf_model,
    invariant.unpatch_hf_model,
]


def test_linear_weight_must_match_x():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"weight must be \[N, K\] with K = x.shape\[-1\] = 8"):
        invariant.linear(x, torch.randn(4, 7))


def test_matmul_b_must_match_a():
    with pytest.raises(ValueError, match=r"b must be \[K, N\] with K = a.shape\[-1\] = 8"):
        invariant.matmul(torch.randn(3, 8), torch.randn(7, 4))


def test_rms_norm_weight_must_be_hidden_sized():
    with pytest.raises(ValueError, match="weight must have shape"):
        invariant.rms_norm(torch.randn(3, 8), torch.randn(7))


def test_attention_kv_heads_must_divide_q_heads():
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match="must be a multiple of the number of kv heads"):
        invariant.attention(q, k, k.clone())


@pytest.mark.parametrize("fn", [invariant.patch_hf_model, invariant.unpatch_hf_model])
def test_patch_needs_a_supported_hf_model(fn):
    pytest.importorskip("transformers")
    with pytest.raises(TypeError, match=f"{fn.__name__}: model must be one of transformers'"):
        fn(torch.nn.Linear(4, 4))
