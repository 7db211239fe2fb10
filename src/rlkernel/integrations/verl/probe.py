"""The registration probe: how the installed verl aggregates each loss, read off its own functions.

verl changed what its policy losses compute between releases without changing their signatures
(verl 0.7.0 → 0.9.1, both read from verl's source):

    seq-mean-token-sum-norm   0.7: Σ mℓ / loss_scale_factor (or T)
                              0.9: Σ mℓ / (global_batch_size · loss_scale_factor) × dp_size
    gspo                      0.7: seq-mean-token-mean whatever loss_agg_mode says
                              0.9: loss_agg_mode as given
    sapo                      both: seq-mean-token-mean whatever loss_agg_mode says
    geo_mean                  both: the mean over all B rows, loss_agg_mode and dp_size unused

So the version string is not trusted. At registration, :func:`plan_mode` runs verl's own function
of each mode on a fixed probe batch (``[4, 6]``, float32, CPU: a full, an empty and two ragged rows,
ratios on both sides of every clip) for each ``loss_agg_mode``, once with an empty
``global_batch_info`` and once with all four entries set (``dp_size=2``), and keeps the first
:class:`~.losses.Convention` under which rlkernel's loss equals verl's (to 1e-5 relative). A
``loss_agg_mode`` that no convention reproduces is refused: the registered loss raises
``RuntimeError`` naming it, what verl computed and what each convention gave. A mode whose verl
function is missing, whose signature is not verl's ``PolicyLossFn`` of 0.9.1, or whose metrics
(names and values) differ from rlkernel's reproduction of them is refused as a whole. The probe
costs about 270 tiny loss evaluations at import (verl's and rlkernel's), no gradient (0.4 s on one CPU core);
``bypass_mode`` (probed with verl's default ``rollout_correction``: ppo_clip, sequence IS weights for
its metrics) about 22 more.

Caveats:
    * The probe tells apart the conventions listed; it is not a proof of agreement. CI compares
      every mode and aggregation with verl 0.9.1's code on random batches, loss and gradients
      (tests/integrations/test_verl.py); another verl version is only as good as its probe.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from rlkernel.integrations.verl.losses import (
    AGG_MODES,
    CONVENTIONS,
    POLICY_LOSS_PARAMETERS,
    VERL_AGG_MODES,
    Batch,
    Convention,
    LossMode,
    ModePlan,
    PolicyLossFn,
    compute,
)

# The two global_batch_info of the probe: none (local normalizers), and every entry set.
PROBE_INFOS: tuple[Mapping[str, int], ...] = (
    {},
    {"dp_size": 2, "batch_num_tokens": 13, "global_batch_size": 7, "loss_scale_factor": 9},
)
# The actor settings of the probe's config: clip bounds and temperatures that every ratio straddles.
PROBE_SETTINGS: Mapping[str, float] = {
    "clip_ratio": 0.2,
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.28,
    "clip_ratio_c": 3.0,
    "tau_pos": 1.0,
    "tau_neg": 1.05,
}
# The nested ``policy_loss`` settings of the probe's config: dro's β; covariance windows and ratios
# that select tokens on the probe batch (verl's defaults, 2e-4 of the tokens in [1, 5], select none).
PROBE_POLICY_LOSS: Mapping[str, float] = {
    "dro_beta": 0.3,
    "clip_cov_ratio": 0.3,
    "clip_cov_lb": -0.5,
    "clip_cov_ub": 0.8,
    "kl_cov_ratio": 0.3,
    "ppo_kl_coef": 0.7,
}
TOLERANCE = 1e-5
# clip_cov draws its tokens from torch's default CPU generator: every probe call (verl's and ours)
# starts from this seed, inside a forked RNG state (the caller's generator is left as it was).
PROBE_SEED = 0


def probe_batch() -> Batch:
    """The fixed probe micro-batch: ``[4, 6]`` float32 on the CPU, rows of 6, 0, 2 and 5 tokens.

    The log-ratio is N(0, 0.6²), so ratios fall below 1 − 0.2, above 1 + 0.28 and above the dual
    clip 3; advantages per token of both signs (sequences of mixed sign: gspo's per-token A and
    geo_mean's per-sequence mean differ from a plain mean). Masked positions hold finite values.
    """
    # Explicitly float32 on the CPU: a caller's default dtype or device must not change the probe.
    g, cpu = torch.Generator().manual_seed(0), dict(dtype=torch.float32, device="cpu")
    log_prob = -3 * torch.rand(4, 6, generator=g, **cpu) - 0.01
    old_log_prob = log_prob + 0.6 * torch.randn(4, 6, generator=g, **cpu)
    advantages = torch.randn(4, 6, generator=g, **cpu)
    mask = torch.arange(6, device="cpu")[None, :] < torch.tensor([6, 0, 2, 5], device="cpu")[:, None]
    return Batch(old_log_prob, log_prob, advantages, mask)


def close(ours: float, theirs: float) -> bool:
    """``|ours − theirs| <= TOLERANCE · max(1, |theirs|)``, both finite."""
    return (
        math.isfinite(ours)
        and math.isfinite(theirs)
        and abs(ours - theirs) <= TOLERANCE * max(1.0, abs(theirs))
    )


def _run_verl(verl_fn: PolicyLossFn, batch: Batch, agg: str, config: Any) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(PROBE_SEED)
    return verl_fn(
        old_log_prob=batch.old_log_prob,
        log_prob=batch.log_prob,
        advantages=batch.advantages,
        response_mask=batch.mask,
        loss_agg_mode=agg,
        config=config,
        rollout_is_weights=None,
    )


def _run_ours(mode: LossMode, convention: Convention, agg: str, config: Any, batch: Batch):
    torch.manual_seed(PROBE_SEED)
    return compute(mode, convention, agg, config, batch)


def _disagreement(
    mode: LossMode,
    convention: Convention,
    agg: str,
    verl_fn: PolicyLossFn,
    make_config: Callable[[Mapping], Any],
    batch: Batch,
) -> str | None:
    """``None`` when rlkernel under ``convention`` gives verl's loss for every probe info; else how
    they differ (for the refusal message)."""
    for info in PROBE_INFOS:
        try:
            theirs = float(_run_verl(verl_fn, batch, agg, make_config(info))[0])
        except Exception as error:  # verl's own code failing on the probe: say so, refuse the mode
            return f"verl raised {type(error).__name__}: {error}"
        try:
            ours = float(_run_ours(mode, convention, agg, make_config(info), batch)[0])
        except (TypeError, ValueError) as error:
            return f"rlkernel raised {type(error).__name__}: {error}"
        if not close(ours, theirs):
            return f"global_batch_info={dict(info)}: verl {theirs:.7g}, rlkernel {ours:.7g}"
    return None


def _metrics_problem(
    mode: LossMode,
    convention: Convention,
    agg: str,
    verl_fn: PolicyLossFn,
    make_config: Callable[[Mapping], Any],
    batch: Batch,
) -> str | None:
    """How verl's metrics of the probe differ from rlkernel's reproduction of them, or ``None``."""
    info = PROBE_INFOS[-1]
    theirs = _run_verl(verl_fn, batch, agg, make_config(info))[1]
    ours = _run_ours(mode, convention, agg, make_config(info), batch)[1]
    if not isinstance(theirs, Mapping) or list(theirs) != list(ours):
        shown = list(theirs) if isinstance(theirs, Mapping) else type(theirs).__name__
        return f"verl returns the metrics {shown}, rlkernel reproduces {list(ours)}"
    for key, value in theirs.items():
        if not isinstance(value, (int, float)) or not close(ours[key], float(value)):
            return f"metric {key!r}: verl {value!r}, rlkernel {ours[key]!r}"
    return None


def plan_mode(
    mode: LossMode, verl_fn: PolicyLossFn | None, make_config: Callable[[Mapping], Any], version: str
) -> ModePlan:
    """Probe verl's ``mode.verl_name`` (``verl_fn``, or ``None`` when the registry has none).

    Args:
        mode: the row of :data:`~.losses.LOSS_MODES`.
        verl_fn: verl's registered function of the mode.
        make_config: ``global_batch_info`` → a verl actor config with :data:`PROBE_SETTINGS`.
        version: the installed verl's version, for messages only.

    Returns:
        :class:`~.losses.ModePlan`: the convention per ``loss_agg_mode``, the refused ones, or why
        the whole mode is refused.
    """
    where = f"{mode.name}: the installed verl {version}"
    if verl_fn is None:
        return ModePlan(
            mode, "token-mean", {}, {}, f"{where} has no loss_mode {mode.verl_name!r} to reproduce"
        )
    try:
        signature = inspect.signature(verl_fn)
    except (TypeError, ValueError):
        signature = None
    params = tuple(signature.parameters) if signature is not None else ()
    if params != POLICY_LOSS_PARAMETERS:
        return ModePlan(
            mode,
            "token-mean",
            {},
            {},
            f"{where}'s {mode.verl_name!r} takes {params}; rlkernel reproduces verl's policy-loss signature "
            f"{POLICY_LOSS_PARAMETERS} (verl 0.9.1)",
        )
    default_agg = signature.parameters["loss_agg_mode"].default
    if default_agg not in VERL_AGG_MODES:
        default_agg = "token-mean"
    batch = probe_batch()
    conventions: dict[str, Convention] = {}
    refused: dict[str, str] = {}
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for agg in AGG_MODES:
            tried = []
            for convention in CONVENTIONS:
                if not convention.applies_to(agg):
                    continue
                problem = _disagreement(mode, convention, agg, verl_fn, make_config, batch)
                if problem is None:
                    conventions[agg] = convention
                    break
                tried.append(f"[{convention.label}] {problem}")
            else:
                refused[agg] = (
                    f"{where}'s {mode.verl_name!r} with loss_agg_mode={agg!r} computes a loss rlkernel does "
                    f"not reproduce; on the registration probe batch: {'; '.join(tried)}"
                )
        if conventions:
            agg, convention = next(iter(conventions.items()))
            problem = _metrics_problem(mode, convention, agg, verl_fn, make_config, batch)
            if problem is not None:
                return ModePlan(mode, default_agg, {}, {}, f"{where}'s {mode.verl_name!r}: {problem}")
    return ModePlan(mode, default_agg, MappingProxyType(conventions), MappingProxyType(refused))
