"""Per-token KL estimators between the policy and a reference policy (Schulman's k1/k2/k3).

With d = logp − ref_logp for a token sampled from the policy (ref_logp is a constant):

    estimator      value                              ∂/∂logp               unbiased for
    k1             d                                  1                     KL value
    k2             d² / 2                             d                     KL gradient
    k3             e^{−d} − 1 + d  (clamped, below)   1 − e^{−d}            KL value, low variance
    k3_unclamped   e^{−d} − 1 + d  (no clamps)        1 − e^{−d}            the same (TRL's k3)
    abs            |d|                                sign(d)               —
    k1+            value of k1                        d  (gradient of k2)   both (straight-through)
    k3+            value of k3                        d  (gradient of k2)   both (straight-through)

The "+" estimators are straight-through: ``k2 − sg(k2) + sg(base)``, so the loss reports the
low-variance value while the gradient is k2's, the one whose expectation is the true KL gradient.

verl's aliases are accepted: ``kl`` = k1, ``mse`` = k2, ``low_var_kl`` = k3, ``kl+`` = k1+,
``low_var_kl+`` = k3+.

Provenance: J. Schulman, "Approximating KL divergence" (2020); verl
``core_algos.kl_penalty``/``kl_penalty_forward`` (names, the straight-through "+" variants and the k3
clamps below); TRL ``GRPOTrainer`` (k3 with beta, no clamps: ``k3_unclamped``).

Caveats:
    * k3 reproduces verl's clamps: −d is clamped to [−20, 20] before the exponential and the result
      to [−10, 10]. Where a clamp is active the gradient is 0. The value clamp bites when
      ref_logp − logp ≳ 2.6 (k3 > 10) or logp − ref_logp > 11; TRL has no clamps and differs there.
    * ``k3_unclamped`` is k3 without either clamp (TRL 1.16's ``exp(ref − logp) − (ref − logp) − 1``,
      here ``expm1(−d) + d``): its value grows as e^{ref − logp} and its gradient is never 0. From
      finite inputs it overflows to +inf once ref_logp − logp > ~88.7 in float32 (as TRL's).
    * k3 is evaluated as ``expm1(−d) + d``: for small |d| its absolute error is ~ε·|d|, where
      ``exp(−d) − 1 + d`` loses everything to cancellation (error ~ε = 6e-8 in fp32, more than the
      value itself for |d| < 3e-4).
    * ref_logp is detached: the reference policy is frozen, gradients flow into ``logp`` only.
    * Non-finite input: NaN or ±inf in ``logp`` or ``ref_logp`` gives NaN at that element (±inf is
      made NaN before the clamps, which would otherwise hide it).
"""

from __future__ import annotations

import torch

from rlkernel import _validate as check
from rlkernel._autocast import without_autocast
from rlkernel._token_loss_plan import K3_LOG_RATIO_BOUND, K3_VALUE_BOUND  # verl's k3 guards (Caveats)
from rlkernel.rl.aggregate import finite_or_nan

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "abs", "k1+", "k3+", "k3_unclamped")
KL_ALIASES: dict[str, str] = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "kl+": "k1+", "low_var_kl+": "k3+"}


def canonical_kl_estimator(name: object, arg: str = "estimator") -> str:
    """``name`` as one of :data:`KL_ESTIMATORS` (aliases resolved); ValueError naming ``arg`` else."""
    if isinstance(name, str):
        resolved = KL_ALIASES.get(name, name)
        if resolved in KL_ESTIMATORS:
            return resolved
    valid = KL_ESTIMATORS + tuple(KL_ALIASES)
    raise ValueError(f"{arg} must be one of {valid}, got {name!r}")


def _k3(diff: torch.Tensor) -> torch.Tensor:
    neg = diff.neg().clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return (torch.expm1(neg) - neg).clamp(-K3_VALUE_BOUND, K3_VALUE_BOUND)


def _k3_unclamped(diff: torch.Tensor) -> torch.Tensor:
    neg = diff.neg()
    return torch.expm1(neg) - neg


def kl_terms(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """The estimator on already-validated tensors of one dtype (``estimator`` canonical)."""
    diff = logp - ref_logp.detach()
    base = estimator.rstrip("+")
    if base == "k1":
        value = diff
    elif base == "k2":
        value = 0.5 * diff.square()
    elif base == "k3":
        value = _k3(diff)
    elif base == "k3_unclamped":
        value = _k3_unclamped(diff)
    else:
        value = diff.abs()
    if not estimator.endswith("+"):
        return value
    grad_source = 0.5 * diff.square()
    return grad_source - grad_source.detach() + value.detach()


@without_autocast
def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference policy.

    Args:
        logp: ``[...]`` float, log-probabilities of the sampled tokens under the policy
            (differentiable).
        ref_logp: ``[...]`` float, the same tokens under the reference policy; same shape and device.
            Treated as a constant (detached).
        estimator: one of ``k1 | k2 | k3 | abs | k1+ | k3+ | k3_unclamped`` or a verl alias
            (``kl | mse | low_var_kl | kl+ | low_var_kl+``); see the module docstring.

    Returns:
        ``[...]`` float32 (float64 for float64 ``logp``), elementwise; no masking is applied
        (mask it with ``torch.where`` downstream). An element where ``logp`` or ``ref_logp`` is
        NaN, +inf or −inf is NaN for every estimator (the k3 clamps do not turn it into a finite
        value).

    Raises:
        TypeError: non-floating-point inputs.
        ValueError: shape or device mismatch, unknown estimator.
    """
    check.float_tensor("logp", logp)
    check.float_like("ref_logp", ref_logp, "logp", logp)
    name = canonical_kl_estimator(estimator)
    dtype = torch.float64 if logp.dtype == torch.float64 else torch.float32
    # ±inf becomes NaN first: the k3 clamps would turn it into a finite value.
    return kl_terms(finite_or_nan(logp.to(dtype)), finite_or_nan(ref_logp.detach().to(dtype)), name)
