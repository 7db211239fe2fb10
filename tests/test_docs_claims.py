"""Statements of the docs that the code decides, checked against the code.

* The gradient-in-forward path of ``fused_policy_loss`` is on by default (option ``grad_in_forward_max_vocab``
  = 65,536): no page or docstring that names it may call it opt-in or off by default, and the
  default path of a small-vocabulary call with logits that require grad is that path.
* Masked rows whose logits or hidden states hold NaN/±inf get exactly 0 gradient on every backend
  (the reference included): no page may say the reference gives NaN there.
* Supported features (issue 29: the first files a user opens called token-sum and verl's
  ``rollout_is_weights`` unsupported, listed 7 of the 12 verl losses, counted seven loss types and
  four aggregations, and called the batch-invariant chain "the next milestone"): no sentence of the
  docs, the README, the examples or a docstring may call a feature the code supports unsupported or
  future; every list of verl ``rk_*`` losses names exactly the registered ones; a count of
  rlkernel's loss types or aggregations is the code's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import rlkernel as rk

ROOT = Path(__file__).resolve().parents[1]
STALE = re.compile(r"opt-in|off by default|off until", re.IGNORECASE)
# Words that say a feature is missing or still to come.
MISSING = re.compile(
    r"unsupported|not supported|not in rlkernel|are refused|is refused|not yet|next milestone|"
    r"coming soon|will be added|not implemented|planned",
    re.IGNORECASE,
)
NUMBERS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen".split()
)}  # fmt: skip


def _paragraphs(text: str) -> list[str]:
    """Markdown bullets/paragraphs and Python comment or docstring blocks: split at blank lines and
    at the start of each bullet (a statement about another option may share a bullet list)."""
    return [p for p in re.split(r"\n\s*\n|\n(?=\s*[*-] )", text) if p.strip()]


def _sources() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "src" / "rlkernel").rglob("*.py"))


def _user_facing() -> list[Path]:
    """What a user reads first and what states features: the README, the docs, the examples."""
    docs = sorted((ROOT / "docs").rglob("*.md"))
    return [ROOT / "README.md", *docs, *sorted((ROOT / "examples").glob("*"))]


def _sentences(text: str) -> list[str]:
    """Sentences, bullets, table rows and comment lines' runs: a claim and its subject together."""
    out = []
    for para in _paragraphs(text):
        out += [s for s in re.split(r"(?<=[.;!?])\s+(?=[A-Z`(])|\n\s*\|", para) if s.strip()]
    return out


def _verl_modes() -> set[str]:
    """The ``rk_*`` names rlkernel.integrations.verl registers, read from its source (importing it
    imports verl): ``LossMode("<verl name>", ...)`` rows of ``LOSS_MODES`` and ``BYPASS_MODE``."""
    package = ROOT / "src" / "rlkernel" / "integrations" / "verl"
    names = set()
    for module in ("losses.py", "bypass.py"):
        names |= set(re.findall(r'LossMode\(\s*"(\w+)"', (package / module).read_text()))
    return {f"rk_{n}" for n in names}


def _supported_features() -> dict[str, re.Pattern]:
    """Feature -> the pattern that names it, for every feature whose support the code shows."""
    import inspect

    import rlkernel.invariant
    from rlkernel.rl.config import AGGREGATIONS, LOSS_TYPES

    features = {f"aggregation {a}": re.compile(rf"`{re.escape(a)}`|\b{re.escape(a)}\b") for a in AGGREGATIONS}
    features |= {f"loss type {t}": re.compile(rf"`{t}`") for t in LOSS_TYPES}
    assert "rollout_weights" in inspect.signature(rk.policy_loss).parameters
    assert "rollout_is_weights" in (ROOT / "src/rlkernel/integrations/verl/losses.py").read_text()
    features["verl's rollout_is_weights"] = re.compile(r"rollout_is(_weights)?\b")
    assert callable(rlkernel.invariant.patch_hf_model)
    features["the batch-invariant chain"] = re.compile(r"invariant (forward )?chain|patch_hf_model", re.I)
    features |= {f"verl loss {m}": re.compile(rf"\b{m}\b") for m in _verl_modes()}
    return features


def test_gradient_in_forward_is_described_as_on_by_default():
    assert rk.Options().grad_in_forward_max_vocab == 262144  # the default the docs state
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


def test_no_supported_feature_is_called_missing():
    features = _supported_features()
    bad = []
    for path in _user_facing():
        for sentence in _sentences(path.read_text()):
            if not MISSING.search(sentence):
                continue
            named = [f for f, pattern in features.items() if pattern.search(sentence)]
            if named:
                bad.append(f"{path.relative_to(ROOT)}: {named}:\n  {sentence.strip()[:300]}")
    assert not bad, "supported features called unsupported / future:\n" + "\n".join(bad)


def test_every_list_of_verl_losses_is_complete():
    """A paragraph naming five or more ``rk_*`` losses lists the supported ones: all of them; no page
    names an ``rk_*`` loss that is not registered."""
    modes = _verl_modes()
    assert len(modes) == 12, sorted(modes)
    lists = 0
    for path in _user_facing():
        for para in _paragraphs(path.read_text()):
            named = set(re.findall(r"\brk_[a-z_]*[a-z]\b", para)) - {"rk_verl"}
            assert named <= modes, f"{path.relative_to(ROOT)} names unknown {sorted(named - modes)}"
            if len(named) >= 5:
                lists += 1
                assert named == modes, f"{path.relative_to(ROOT)} leaves out {sorted(modes - named)}:\n{para}"
    assert lists >= 3  # the README, the verl page, the config snippet


def test_counts_of_loss_types_and_aggregations_are_the_codes():
    from rlkernel.rl.config import AGGREGATIONS, LOSS_TYPES

    want = {"loss types": len(LOSS_TYPES), "aggregations": len(AGGREGATIONS)}
    found = 0
    for path in _user_facing():
        for sentence in _sentences(path.read_text()):
            if re.search(r"TRL|verl|OpenRLHF|issue", sentence):
                continue  # a count of a framework's settings, or of one issue's additions
            counts = rf"\b({'|'.join(NUMBERS)}|\d+) (loss types|aggregations)\b"
            for word, what in re.findall(counts, sentence):
                found += 1
                n = int(word) if word.isdigit() else NUMBERS[word.lower()]
                assert n == want[what], f"{path.relative_to(ROOT)}: {word} {what}; the code has {want[what]}"
    assert found >= 2


def test_the_claim_checks_catch_the_stale_sentences():
    """The sentences issue 29 found, checked by the same functions."""
    features = _supported_features()
    for stale in (
        "loss_agg_mode: token-mean  # not token-sum (not in rlkernel yet)",
        "Not with rk_*: algorithm.rollout_correction.rollout_is (rollout_is_weights are refused for now).",
        "the batch-invariant forward chain that extends this to the whole model is the next milestone.",
    ):
        sentence = _sentences(stale)[-1]
        assert MISSING.search(sentence) and any(p.search(sentence) for p in features.values()), stale
