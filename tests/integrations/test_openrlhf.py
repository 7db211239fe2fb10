"""``rlkernel.integrations.openrlhf.PolicyLoss`` against OpenRLHF 0.11.2's own ``PolicyLoss``.

The reference is the installed OpenRLHF code (fixture ``openrlhf_policy_loss``, tests/integrations/
conftest.py), run on the same fresh random batches: ragged masks with a full and an empty row,
per-token advantages of both signs (OpenRLHF's GAE case) and per-sequence ones (its GRPO case),
ratios and rollout weights that straddle every clip and window, float32 and float64, with and without
OpenRLHF's global normalizers and ``dp_size``.

* Every combination of OpenRLHF's constructor choices (loss type × correction level × mode × gating ×
  dual clip × aggregation): OpenRLHF rejects it and so do we, or it is one of the documented
  unsupported settings and we raise ``ValueError`` at construction, or loss, gradient and the four
  statistics agree.
* "Agree" is bitwise for ppo (the same operations in the same order: measured, and the module
  docstring says so) and ≤ 1e-6 (float32) / 1e-12 (float64) for gspo, whose sequence advantage
  rlkernel averages before, OpenRLHF after, the ratio.
"""

from __future__ import annotations

import inspect
import itertools
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlkernel.integrations import openrlhf as integration
from rlkernel.integrations.openrlhf import PolicyLoss

DTYPES = (torch.float32, torch.float64)
GSPO_TOL = {torch.float32: 1e-6, torch.float64: 1e-12}
# OpenRLHF rejects some combinations itself: its constructor raises ValueError, or asserts.
REJECTED = (ValueError, AssertionError)


def make_batch(seed: int, dtype: torch.dtype, *, advantages: str = "token", B: int = 6, T: int = 13):
    """A fresh batch: ``(log_probs, old, advantages, mask, rollout)``, all ``[B, T]``.

    Row 0 is full and row 1 empty; the others have random lengths. lp − old ~ N(0, 0.6²) puts ratios
    below 1 − 0.2, above 1 + 0.28 and above a dual clip of 2.5; old − rollout ~ N(0, 0.6²) puts ρ on
    both sides of the (0.5, 2.0) window. Masked positions hold random (finite) values too.
    """
    g = torch.Generator().manual_seed(seed)
    log_probs = -3 * torch.rand(B, T, generator=g, dtype=dtype) - 0.01
    old = log_probs + 0.6 * torch.randn(B, T, generator=g, dtype=dtype)
    rollout = old + 0.6 * torch.randn(B, T, generator=g, dtype=dtype)
    if advantages == "token":
        adv = torch.randn(B, T, generator=g, dtype=dtype)
    else:  # one value per sequence, broadcast to its tokens as OpenRLHF stores it
        adv = torch.randn(B, 1, generator=g, dtype=dtype).expand(B, T).contiguous()
    lengths = torch.randint(1, T, (B,), generator=g)
    lengths[0], lengths[1] = T, 0
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return log_probs, old, adv, mask, rollout


def run(cls: type, settings: dict, batch, **forward):
    """``(outputs, d loss / d log_probs)`` of ``cls(**settings)`` on ``batch``."""
    log_probs, old, adv, mask, rollout = batch
    x = log_probs.clone().requires_grad_(True)
    out = cls(**settings)(x, old, adv, mask, rollout, **forward)
    (grad,) = torch.autograd.grad(out[0], x)
    return out, grad


def assert_same(ours, theirs, settings: dict, dtype: torch.dtype) -> None:
    (out, grad), (ref, ref_grad) = ours, theirs
    assert out[0].dtype == ref[0].dtype
    assert torch.isfinite(ref[0]) and torch.isfinite(ref_grad).all()
    if settings.get("policy_loss_type", "ppo") == "ppo":
        assert torch.equal(out[0], ref[0]), (out[0].item(), ref[0].item())
        assert torch.equal(grad, ref_grad), (grad - ref_grad).abs().max().item()
    else:
        tol = GSPO_TOL[dtype]
        torch.testing.assert_close(out[0], ref[0], atol=tol, rtol=tol)
        torch.testing.assert_close(grad, ref_grad, atol=tol, rtol=tol)
    names = ("clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio")
    for name, mine, theirs_ in zip(names, out[1:], ref[1:], strict=True):
        assert (mine is None) == (theirs_ is None), name
        if mine is not None:
            assert mine.dtype == theirs_.dtype, name
            assert torch.equal(mine, theirs_), (name, mine.item(), theirs_.item())


def threshold_for(gating: str) -> tuple[float, float]:
    # OpenRLHF takes a divergence gate as (0, delta) only; the ratio window straddles make_batch's ρ.
    return (0.5, 2.0) if gating == "ratio" else (0.0, 0.3)


def documented_unsupported(s: dict) -> bool:
    """The settings the module docstring lists as not supported (OpenRLHF accepts them)."""
    ppo = s["policy_loss_type"] == "ppo"
    if not ppo and s["dual_clip"] is not None:
        return True
    correction = s["is_correction_level"] != "off"
    return ppo and correction and (s["is_correction_level"] == "seq" or s["is_correction_gating"] != "ratio")


GRID = [
    dict(
        policy_loss_type=loss_type,
        is_correction_level=level,
        is_correction_mode=mode,
        is_correction_gating=gating,
        is_correction_threshold=threshold_for(gating),
        dual_clip=dual_clip,
        token_level_loss=token_level,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
    )
    for loss_type, level, mode, gating, dual_clip, token_level in itertools.product(
        ("ppo", "gspo"),
        ("off", "token", "seq"),
        ("mask", "clip"),
        ("ratio", "binary_kl", "tv"),
        (None, 2.5),
        (True, False),
    )
]


def _grid_id(s: dict) -> str:
    return (
        "-".join(
            str(s[k])
            for k in ("policy_loss_type", "is_correction_level", "is_correction_mode", "is_correction_gating")
        )
        + f"-dual{s['dual_clip']}-{'tok' if s['token_level_loss'] else 'seq'}"
    )


@pytest.mark.parametrize("index", range(len(GRID)), ids=[_grid_id(s) for s in GRID])
def test_every_constructor_choice_matches_or_is_refused(openrlhf_policy_loss, index):
    settings = GRID[index]
    try:
        openrlhf_policy_loss(**settings)
    except REJECTED:
        with pytest.raises(ValueError):
            PolicyLoss(**settings)
        return
    if documented_unsupported(settings):
        with pytest.raises(ValueError, match="not supported"):
            PolicyLoss(**settings)
        return
    batch = make_batch(index, torch.float32)
    normalizers = dict(dp_size=3, batch_num_tokens=torch.tensor(97.0), global_batch_size=torch.tensor(11.0))
    ours, theirs = (
        run(PolicyLoss, settings, batch, **normalizers),
        run(openrlhf_policy_loss, settings, batch, **normalizers),
    )
    assert_same(ours, theirs, settings, torch.float32)


def test_the_grid_reaches_every_outcome(openrlhf_policy_loss):
    """The grid above is not vacuous: OpenRLHF rejects some, we refuse some, and most compare."""
    outcomes = []
    for s in GRID:
        try:
            openrlhf_policy_loss(**s)
        except REJECTED:
            outcomes.append("rejected")
            continue
        outcomes.append("unsupported" if documented_unsupported(s) else "compared")
    counts = {k: outcomes.count(k) for k in ("rejected", "unsupported", "compared")}
    assert counts["rejected"] > 0 and counts["unsupported"] > 0 and counts["compared"] >= 40, counts


# Settings compared across dtypes, normalizers and advantage layouts: every loss type, aggregation,
# dual clip and supported correction, thresholds with a zero low bound and an infinite high one.
SWEEP = [
    dict(),
    dict(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=2.5),
    dict(clip_eps_low=0.1, clip_eps_high=0.3, token_level_loss=False),
    dict(dual_clip=2.5, token_level_loss=False),
    dict(is_correction_level="token", is_correction_mode="clip", is_correction_threshold=(0.5, 2.0)),
    dict(is_correction_level="token", is_correction_mode="mask", is_correction_threshold=(0.5, 2.0)),
    dict(is_correction_level="token", is_correction_mode="mask", is_correction_threshold=[0.0, 1.5]),
    dict(is_correction_level="token", is_correction_mode="clip", is_correction_threshold=(0.7, math.inf)),
    dict(
        is_correction_level="token",
        is_correction_mode="clip",
        is_correction_threshold=(0.5, 2.0),
        dual_clip=2.5,
        token_level_loss=False,
    ),
    dict(policy_loss_type="gspo", clip_eps_low=0.2, clip_eps_high=0.28),
    dict(policy_loss_type="gspo", clip_eps_low=0.05, clip_eps_high=0.08, token_level_loss=True),
    dict(policy_loss_type="gspo", is_correction_level="token", is_correction_mode="clip"),
    dict(
        policy_loss_type="gspo",
        is_correction_level="seq",
        is_correction_gating="binary_kl",
        is_correction_threshold=(0.0, 0.1),
    ),
]
NORMALIZERS = {
    "local": {},
    "global": dict(dp_size=4, batch_num_tokens=torch.tensor(123.0), global_batch_size=torch.tensor(17.0)),
    "python-numbers": dict(dp_size=2, batch_num_tokens=61, global_batch_size=9.0),
}


@pytest.mark.parametrize("advantages", ["token", "sequence"])
@pytest.mark.parametrize("normalizers", list(NORMALIZERS))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("index", range(len(SWEEP)))
def test_loss_gradient_and_statistics_match(openrlhf_policy_loss, index, dtype, normalizers, advantages):
    settings = SWEEP[index]
    batch = make_batch(
        1000 * index + 7 * DTYPES.index(dtype) + len(normalizers), dtype, advantages=advantages
    )
    forward = NORMALIZERS[normalizers]
    ours = run(PolicyLoss, settings, batch, **forward)
    theirs = run(openrlhf_policy_loss, settings, batch, **forward)
    assert_same(ours, theirs, settings, dtype)


def test_the_batches_exercise_every_branch():
    """make_batch reaches what the comparisons must see: clipped ratios on both sides, the dual clip,
    ρ on both sides of the window, sequences with advantages of both signs, an empty row."""
    log_probs, old, adv, mask, rollout = make_batch(0, torch.float32, B=8)
    r, rho = (log_probs - old).exp()[mask], (old - rollout).exp()[mask]
    assert (r < 0.8).any() and (r > 1.28).any() and (r > 2.5).any()
    assert (rho < 0.5).any() and (rho > 2.0).any() and ((rho > 0.5) & (rho < 2.0)).any()
    mixed = ((adv > 0) & mask).any(-1) & ((adv < 0) & mask).any(-1)
    assert mixed.any() and not mask[1].any() and mask[0].all()


def test_gspo_with_mixed_signs_is_not_the_mean_advantage(openrlhf_policy_loss):
    """Why gspo splits a sequence by the sign of its advantages: without the split (one gspo call on
    the per-token advantages) the loss is off by far more than rounding."""
    import rlkernel as rk

    log_probs, old, adv, mask, rollout = make_batch(3, torch.float64)
    settings = dict(policy_loss_type="gspo", clip_eps_low=0.05, clip_eps_high=0.08)
    ref = openrlhf_policy_loss(**settings)(log_probs, old, adv, mask)[0]
    ours = PolicyLoss(**settings)
    naive = rk.policy_loss(log_probs, old, adv, mask, ours.config).loss
    assert abs(naive - ref) > 1e-4
    torch.testing.assert_close(ours(log_probs, old, adv, mask)[0], ref, atol=1e-12, rtol=1e-12)


def test_action_mask_none_and_a_float_mask(openrlhf_policy_loss):
    """``action_mask=None`` is every token (OpenRLHF supports it where it takes a plain mean: ppo,
    token level, no normalizer); a float 0/1 mask is read as OpenRLHF multiplies by it."""
    log_probs, old, adv, mask, rollout = make_batch(5, torch.float32)
    assert_same(
        run(PolicyLoss, {}, (log_probs, old, adv, None, None)),
        run(openrlhf_policy_loss, {}, (log_probs, old, adv, None, None)),
        {},
        torch.float32,
    )
    for settings in (dict(), dict(token_level_loss=False), dict(policy_loss_type="gspo")):
        float_batch = (log_probs, old, adv, mask.to(torch.float32), rollout)
        assert_same(
            run(PolicyLoss, settings, float_batch),
            run(openrlhf_policy_loss, settings, float_batch),
            settings,
            torch.float32,
        )


@pytest.mark.parametrize("token_level_loss", [True, False])
def test_all_masked_micro_batch(openrlhf_policy_loss, token_level_loss):
    """With OpenRLHF's global normalizers both give loss 0 and zero gradients; without them OpenRLHF
    divides 0 by 0 and we give 0 (module docstring, Caveats)."""
    log_probs, old, adv, mask, rollout = make_batch(9, torch.float32)
    batch = (log_probs, old, adv, torch.zeros_like(mask), rollout)
    settings = dict(token_level_loss=token_level_loss)
    normalizers = dict(dp_size=2, batch_num_tokens=torch.tensor(50.0), global_batch_size=torch.tensor(6.0))
    (out, grad), (ref, ref_grad) = (
        run(PolicyLoss, settings, batch, **normalizers),
        run(openrlhf_policy_loss, settings, batch, **normalizers),
    )
    assert out[0].item() == ref[0].item() == 0.0
    assert torch.equal(grad, ref_grad) and not grad.any()
    (out, grad), (ref, _) = run(PolicyLoss, settings, batch), run(openrlhf_policy_loss, settings, batch)
    assert torch.isnan(ref[0]) and out[0].item() == 0.0 and not grad.any()
    assert all(m.item() == 0.0 for m in out[1:3])


def test_gspo_differs_only_beyond_the_log_ratio_bound(openrlhf_policy_loss):
    """The documented gspo caveat, pinned: a sequence whose mean log-ratio exceeds 10 and whose
    advantage is negative gets a bounded loss here, an unbounded one in OpenRLHF; the other rows of
    the same batch still agree."""
    log_probs, old, adv, mask, rollout = make_batch(11, torch.float64, advantages="sequence")
    old[2] = log_probs[2] - 12.0  # row 2: log s = 12 > 10
    adv[2] = -1.0
    settings = dict(policy_loss_type="gspo")
    (out, grad), (ref, ref_grad) = (
        run(PolicyLoss, settings, (log_probs, old, adv, mask, rollout)),
        run(openrlhf_policy_loss, settings, (log_probs, old, adv, mask, rollout)),
    )
    assert ref[0] > out[0] + 1.0  # OpenRLHF's row-2 loss is e^12·1, ours e^10·1
    others = torch.ones(6, dtype=torch.bool)
    others[2] = False
    torch.testing.assert_close(grad[others], ref_grad[others], atol=1e-12, rtol=1e-12)


def test_signatures_are_openrlhfs(openrlhf_policy_loss):
    """Same constructor parameters (names, order, defaults) and forward parameters as OpenRLHF's."""

    def params(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert params(PolicyLoss.__init__) == params(openrlhf_policy_loss.__init__)
    assert params(PolicyLoss.forward) == params(openrlhf_policy_loss.forward)


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(policy_loss_type="gspo", token_level_loss=True),
        dict(dual_clip=3.0, is_correction_level="token", is_correction_mode="clip"),
    ],
)
def test_attributes_are_openrlhfs_and_read_only(openrlhf_policy_loss, settings):
    ours, theirs = PolicyLoss(**settings), openrlhf_policy_loss(**settings)
    for name in inspect.signature(PolicyLoss.__init__).parameters:
        if name != "self":
            assert getattr(ours, name) == getattr(theirs, name), name
            with pytest.raises(AttributeError):
                setattr(ours, name, getattr(ours, name))
    assert "config=PolicyLossConfig(" in repr(ours)


def test_mapping_onto_the_config():
    """The settings → PolicyLossConfig table of the docs."""
    cfg = PolicyLoss(clip_eps_low=0.1, clip_eps_high=0.3, dual_clip=3.0, token_level_loss=False).config
    assert (cfg.loss_type, cfg.clip_low, cfg.clip_high, cfg.dual_clip) == ("ppo", 0.1, 0.3, 3.0)
    assert cfg.aggregation == "seq-mean-token-mean" and cfg.rollout_correction is None
    assert PolicyLoss().config.aggregation == "token-mean"
    assert (
        PolicyLoss(policy_loss_type="gspo", token_level_loss=True).config.aggregation == "seq-mean-token-mean"
    )
    cfg = PolicyLoss(
        is_correction_level="token", is_correction_mode="clip", is_correction_threshold=(0, 2)
    ).config
    assert (cfg.rollout_correction, cfg.rollout_clip_min, cfg.rollout_clip_max) == ("token_tis", None, 2)
    cfg = PolicyLoss(is_correction_level="token", is_correction_threshold=(0.5, math.inf)).config
    assert (cfg.rollout_correction, cfg.rollout_clip_min, cfg.rollout_clip_max) == ("token_mis", 0.5, None)
    gspo = PolicyLoss(policy_loss_type="gspo", is_correction_level="seq", is_correction_mode="mask")
    assert gspo.config.rollout_correction is None  # its ratio moves onto the rollout policy instead


def test_version_check():
    integration._check_version(None)  # not installed: the documented 0.11.2 semantics
    integration._check_version("0.11.2")
    for other in ("0.11.1", "0.11.3", "0.10.4", "0.11.2.post1"):
        with pytest.raises(
            RuntimeError, match=r"0\.11\.2.*installed openrlhf is " + other.replace(".", r"\.")
        ):
            integration._check_version(other)


def test_installed_version_is_read_from_metadata(openrlhf_policy_loss):
    assert integration._installed_version() == "0.11.2"


def test_the_example_runs_and_agrees(openrlhf_policy_loss):
    """examples/openrlhf_policy_loss.py compares the two on the CPU: every row compared, ppo rows
    bitwise, the gspo row within rounding."""
    root = Path(__file__).resolve().parents[2]
    paths = [str(root / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    result = subprocess.run(
        [sys.executable, str(root / "examples" / "openrlhf_policy_loss.py")],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rows = result.stdout.strip().splitlines()
    assert len(rows) == 4 and all("| OpenRLHF" in row for row in rows), result.stdout
    assert [row.endswith("bitwise True") for row in rows] == [True, True, True, False], result.stdout
    deltas = [float(re.search(r"\|Δloss\| (\S+)", row).group(1)) for row in rows]
    assert max(deltas) <= 1e-6, result.stdout
