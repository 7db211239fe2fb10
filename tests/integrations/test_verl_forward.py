"""``forward_with_rlkernel_backend`` against verl 0.9.1's own fused forward (``torch`` backend).

A tiny random Llama (float32, CPU) and a copy of it with the same weights: verl's
``dense_common.forward_with_torch_backend`` on one, rlkernel's forward on the other, the same inputs
(padded ``[B, S]`` with ``input_ids``, ``labels`` or ``shift_labels``; verl's remove-padding layout
``[1, nnz]`` with ``shift_labels``), several temperatures. Log-probs and entropy agree to float32
rounding, and so do the gradients of a random combination of them with respect to every parameter
(‖Δ‖/‖ref‖ ≤ 1e-5, DESIGN.md's fp32 matmul bound). Installing it: on one model only, through verl's
``patch_forward_with_backends`` with ``impl_backend="rlkernel"``, other backends still verl's.
"""

from __future__ import annotations

import copy
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

VOCAB = 61


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def outputs_and_grads(model, forward, kwargs, seed):
    """``(log_probs, entropy, {param name: grad})`` of Σ (w1·log_probs + w2·entropy), random w."""
    model.zero_grad(set_to_none=True)
    out = forward(model, **kwargs)
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(out.log_probs.shape, generator=g)
    w2 = torch.randn(out.entropy.shape, generator=g)
    ((w1 * out.log_probs).sum() + (w2 * out.entropy).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.log_probs.detach(), out.entropy.detach(), grads


def assert_matches_verl(verl, kwargs, seed=0):
    ours_model = tiny_llama(seed)
    theirs_model = copy.deepcopy(ours_model)
    ours = outputs_and_grads(ours_model, verl.integration.forward_with_rlkernel_backend, kwargs, seed)
    theirs = outputs_and_grads(theirs_model, verl.dense_common.forward_with_torch_backend, kwargs, seed)
    (lp, ent, grads), (ref_lp, ref_ent, ref_grads) = ours, theirs
    assert lp.dtype == ref_lp.dtype == torch.float32 and lp.shape == ref_lp.shape
    assert ent.dtype == torch.float32 and ent.shape == ref_ent.shape
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    assert set(grads) == set(ref_grads) and len(grads) > 10
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) <= 1e-5, (name, rel_err(grad, ref_grads[name]))


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_padded_batch_matches_verls_torch_backend(verl, temperature):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0  # right padding
    kwargs = dict(input_ids=ids, attention_mask=mask, return_dict=True, temperature=temperature)
    assert_matches_verl(verl, kwargs)


def test_labels_and_shift_labels_match_verls_torch_backend(verl):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (2, 7), generator=g)
    labels = torch.randint(0, VOCAB, (2, 7), generator=g)
    assert_matches_verl(verl, dict(input_ids=ids, labels=labels, return_dict=True, temperature=0.9), seed=1)
    shift = torch.randint(0, VOCAB, (2, 7), generator=g)
    assert_matches_verl(
        verl, dict(input_ids=ids, shift_labels=shift, return_dict=True, temperature=0.9), seed=2
    )


def test_remove_padding_layout_matches_verls_torch_backend(verl):
    """verl's FSDP engine with use_remove_padding: one packed row [1, nnz], position ids restarting
    per sequence, the globally rolled labels passed as shift_labels."""
    g = torch.Generator().manual_seed(3)
    lengths = [5, 3, 7]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None, :]
    shift = torch.roll(ids, -1, dims=-1)
    kwargs = dict(
        input_ids=ids, position_ids=positions, shift_labels=shift, return_dict=True, temperature=1.0
    )
    assert_matches_verl(verl, kwargs, seed=3)


def test_lm_head_bias_is_used(verl):
    """A head with a bias (verl's backends drop it): the log-probs of the model's own logits."""
    model = tiny_llama(4)
    model.lm_head = torch.nn.Linear(16, VOCAB, bias=True)
    torch.nn.init.normal_(model.lm_head.bias, std=0.5)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float() / 0.8
        out = verl.integration.forward_with_rlkernel_backend(
            model, input_ids=ids, return_dict=True, temperature=0.8
        )
    logp = torch.log_softmax(logits, -1)
    expected = logp.gather(-1, torch.roll(ids, -1, -1)[..., None])[..., 0]
    torch.testing.assert_close(out.log_probs, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.entropy, -(logp.exp() * logp).sum(-1), atol=1e-5, rtol=1e-5)


def test_install_patches_one_model_only(verl):
    model, other = tiny_llama(5), tiny_llama(5)
    before = type(model).forward
    assert verl.integration.install_fused_forward(model) is model
    assert model._verl_fused_kernels_backend == "rlkernel"
    assert type(model).forward is before and type(other).forward is before  # the class is untouched
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    out = model(input_ids=ids, return_dict=True, temperature=1.0)
    assert type(out).__name__ == "CausalLMOutputForPPO" and out.log_probs.shape == (2, 8)
    assert other(input_ids=ids).logits.shape == (2, 8, VOCAB)  # another instance: the HF forward
    with torch.no_grad():
        ref = verl.dense_common.forward_with_torch_backend(other, input_ids=ids, return_dict=True)
    torch.testing.assert_close(out.log_probs.detach(), ref.log_probs, atol=1e-5, rtol=1e-5)


def test_verls_backend_switch_installs_it_for_impl_backend_rlkernel(verl):
    monkey_patch = verl.monkey_patch
    # apply_monkey_patch ends by calling the module's patch_forward_with_backends, looked up when it
    # runs: the wrapped one.
    assert "patch_forward_with_backends(model" in inspect.getsource(monkey_patch.apply_monkey_patch)
    assert monkey_patch.patch_forward_with_backends.rlkernel_backend is True
    model = tiny_llama(6)
    monkey_patch.patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="rlkernel")
    assert model.forward.__func__ is verl.integration.forward_with_rlkernel_backend

    untouched = tiny_llama(6)
    monkey_patch.patch_forward_with_backends(
        untouched, use_fused_kernels=False, fused_kernels_backend="rlkernel"
    )
    assert "forward" not in vars(untouched)  # verl's "skipping" branch, as without the wrap

    cls = type(untouched)
    original = cls.forward
    try:  # verl's own backends still go to verl (it assigns them to the class: restored below)
        monkey_patch.patch_forward_with_backends(
            untouched, use_fused_kernels=True, fused_kernels_backend="torch"
        )
        assert cls.forward is verl.dense_common.forward_with_torch_backend
    finally:
        cls.forward = original


def test_the_example_runs_and_agrees(verl):
    """The documented command, ``python examples/verl_policy_loss.py`` in a fresh interpreter of the
    environment ``make setup-dev`` / ``make verl-example`` build (verl 0.9.1 without ray, tensordict
    or wandb; issue 29: the example ran from no documented setup): it exits 0, every rk_<mode> row
    agrees with verl's, and the fused forward does."""
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(filter(None, [str(root / "src"), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    done = subprocess.run(
        [sys.executable, "examples/verl_policy_loss.py"], cwd=root, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = done.stdout.strip().splitlines()
    losses, forward = rows[:-1], rows[-1]
    assert len(losses) == len(verl.integration.RK_LOSSES) * 5, rows
    for row in losses:
        assert row.endswith("metrics equal True"), row
        assert float(re.search(r"\|Δloss\| (\S+)", row).group(1)) <= 1e-6, row
        assert float(re.search(r"max\|Δgrad\| (\S+)", row).group(1)) <= 1e-6, row
    deltas = [float(x) for x in re.findall(r"\| (\d\.\de[-+]\d+)", forward)]
    assert len(deltas) == 3 and max(deltas) <= 1e-5, forward
