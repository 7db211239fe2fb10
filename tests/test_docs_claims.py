"""Statements of the docs that the code decides, checked against the code.

* The gradient-in-forward path of ``fused_policy_loss`` is on by default (option ``grad_in_forward_max_vocab``
  = 65,536): no page or docstring that names it may call it opt-in or off by default, and the
  default path of a small-vocabulary call with logits that require grad is that path.
* Masked rows whose logits or hidden states hold NaN/±inf get exactly 0 gradient on every backend
  (the reference included): no page may say the reference gives NaN there.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import rlkernel as rk

ROOT = Path(__file__).resolve().parents[1]
STALE = re.compile(r"opt-in|off by default|off until", re.IGNORECASE)


def _paragraphs(text: str) -> list[str]:
    """Markdown bullets/paragraphs and Python comment or docstring blocks: split at blank lines and
    at the start of each bullet (a statement about another option may share a bullet list)."""
    return [p for p in re.split(r"\n\s*\n|\n(?=\s*[*-] )", text) if p.strip()]


def _sources() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "src" / "rlkernel").rglob("*.py"))


def test_gradient_in_forward_is_described_as_on_by_default():
    assert rk.Options().grad_in_forward_max_vocab == 65536  # the default the docs state
    mentions = 0
    for path in _sources():
        for para in _paragraphs(path.read_text()):
            if not re.search(r"grad_in_forward_max_vocab|gradient[- ]in[- ]forward", para, re.IGNORECASE):
                continue
            mentions += 1
            stale = STALE.search(para)
            assert stale is None, f"{path.relative_to(ROOT)} says {stale.group(0)!r} about it:\n{para}"
    assert mentions >= 3


def test_no_page_claims_nan_gradients_in_masked_rows():
    for path in sorted((ROOT / "docs").rglob("*.md")):
        for para in _paragraphs(path.read_text()):
            if re.search(r"mask", para, re.IGNORECASE) and re.search(r"NaN gradient", para):
                raise AssertionError(f"{path.relative_to(ROOT)}:\n{para}")


def test_small_vocabulary_takes_the_gradient_in_forward_path_by_default():
    if torch.cuda.is_available():
        pytest.skip("CPU tensors reach the Triton kernels only in the interpreter (CPU suite)")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 17, generator=g, requires_grad=True)
    batch = dict(
        token_ids=torch.randint(0, 17, (2, 3), generator=g),
        old_logp=-torch.rand(2, 3, generator=g),
        advantages=torch.randn(2, generator=g),
        mask=torch.ones(2, 3),
    )
    with rk.use_backend("triton"):
        out = rk.fused_policy_loss(rk.PolicyLossConfig.preset("dapo"), logits=logits, **batch)
        out.loss.backward()
    assert out.route.passes == 2 and out.route.objective == "token"


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("preset", ["dapo", "gspo"])
@pytest.mark.parametrize("source", ["logits", "hidden"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # fp64: the reference under every mode
def test_nonfinite_masked_rows_get_exact_zero_gradient(
    backend, preset, source, dtype, smallest_linear_chunks
):
    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("CPU tensors reach the Triton kernels only in the interpreter (CPU suite)")
    g = torch.Generator().manual_seed(1)
    b, t, v, h = 2, 5, 11, 6
    mask = torch.ones(b, t)
    mask[0, 3:] = 0
    mask[1, 4] = 0
    off = mask == 0
    x = torch.randn(b, t, v if source == "logits" else h, generator=g, dtype=dtype)
    x[0, 3] = float("nan")
    x[0, 4, 0] = float("inf")
    x[1, 4, 1] = -float("inf")
    x.requires_grad_()
    kwargs = (
        dict(logits=x)
        if source == "logits"
        else dict(hidden=x, weight=torch.randn(v, h, generator=g, dtype=dtype))
    )
    ids = torch.randint(0, v, (b, t), generator=g).masked_fill(off, -1)
    # old_logp = the current log-probs at the active tokens: ratio 1, nothing clipped, so every
    # active row has a nonzero gradient to tell apart from the masked rows' exact zeros.
    clean = torch.where(off[..., None], 0.0, x.detach())
    safe_ids = ids.masked_fill(off, 0)
    if source == "logits":
        old_logp = rk.token_logprobs(clean, safe_ids)
    else:
        old_logp = rk.linear_token_logprobs(clean, kwargs["weight"], safe_ids)
    cfg = rk.PolicyLossConfig.preset(preset)
    with rk.use_backend(backend):
        out = rk.fused_policy_loss(
            cfg,
            token_ids=ids,
            old_logp=old_logp.detach(),
            advantages=torch.randn(b, generator=g),
            mask=mask,
            **kwargs,
        )
        (grad,) = torch.autograd.grad(out.loss, [x])
    assert torch.isfinite(out.loss)
    assert torch.equal(grad[off], torch.zeros_like(grad[off]))
    assert torch.isfinite(grad[~off]).all() and bool((grad[~off] != 0).any())
