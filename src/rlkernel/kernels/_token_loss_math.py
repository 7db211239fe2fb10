"""The per-token math of the fused token-level RL loss: one ``@triton.jit`` helper for both kernels.

For every active token t (see :mod:`rlkernel.rl.token_loss` for the plan that supplies the per-token
constants, :mod:`rlkernel.reference.token_loss` for the oracle, and
:mod:`rlkernel.kernels.token_loss` for the two kernels that call :func:`token_terms`):

    lr  = logp − old,   r = exp(clamp(lr, ±20))      (on-policy, BRANCH.HAS_OLD False: old = logp)
    P   = the loss type's term (ppo with δ cap and dual clip | cispo | sapo | reinforce), dP/dlogp
    K   = the KL estimator at d = logp − ref (k1 | k2 | k3 with verl's clamps | abs | k3_unclamped,
          TRL's k3; "+" forms: the value of the base, the gradient d of k2), dK/dlogp
    w   = factor_t / D,  D = norm_mult · max(denom, denom_floor)    (aggregation weight)
    ℓ_t = w·(ρ_t·P + kl_coef·K − entropy_coef·H_t)
    g_logp = w·(ρ_t·dP/dlogp + kl_coef·dK/dlogp),   g_entropy = −w·entropy_coef

with ρ_t the detached rollout-correction weight (1 without one) and ``factor_t`` 1/n_i for
``seq-mean-token-mean`` (1 otherwise).

Gradients follow PyTorch's autograd conventions exactly, so the result matches ``policy_loss``
under autograd: ``clamp`` passes the gradient on the closed interval, ``maximum``/``minimum`` split
it in halves on ties.

Caveats:
    * NaN or ±inf in logp, old (not read by reinforce), advantage, ref or entropy, and NaN in the
      rollout weight, at an active token give NaN (loss and coefficients) explicitly: Triton's
      ``minimum``/``maximum`` do not promise NaN propagation, and the log-ratio and k3 clamps would
      turn ±inf into finite values. An out-of-range id (``validate=False``) reaches here as a NaN
      logp. The plan makes the rollout weight NaN where old or rollout log-probs are not finite.
    * A denominator D that is 0, negative or not finite gives NaN at active tokens; the callers
      store 0 at inactive tokens whatever D is, so an all-masked call gives 0 with a global
      normalizer of 0.
    * ``expm1`` is Kahan's ``(u − 1)·z / log u`` (no libdevice call, so the CPU interpreter runs
      it): within a few ulp of ``torch.expm1``, not bitwise equal.
"""

from __future__ import annotations

import triton
import triton.language as tl

from rlkernel import _token_loss_plan as token_loss_plan
from rlkernel._token_loss_plan import KL_CODES, LOSS_CODES
from rlkernel.kernels._reduce import is_nonfinite

# constexpr: compiled kernels may read module globals only when they are constexpr (the interpreter
# does not enforce it; tests/kernels/test_jit_globals.py does).
LOG_RATIO_BOUND = tl.constexpr(token_loss_plan.LOG_RATIO_BOUND)
K3_LOG_RATIO_BOUND = tl.constexpr(token_loss_plan.K3_LOG_RATIO_BOUND)
K3_VALUE_BOUND = tl.constexpr(token_loss_plan.K3_VALUE_BOUND)
# The branch codes of BRANCH.LOSS and BRANCH.KL, named (the one table is in _token_loss_plan).
PPO = tl.constexpr(LOSS_CODES["ppo"])
CISPO = tl.constexpr(LOSS_CODES["cispo"])
SAPO = tl.constexpr(LOSS_CODES["sapo"])
REINFORCE = tl.constexpr(LOSS_CODES["reinforce"])
NO_KL = tl.constexpr(KL_CODES[None])
K1 = tl.constexpr(KL_CODES["k1"])
K2 = tl.constexpr(KL_CODES["k2"])
K3 = tl.constexpr(KL_CODES["k3"])
K3_UNCLAMPED = tl.constexpr(KL_CODES["k3_unclamped"])


@triton.jit
def _expm1(z):
    # Kahan: u = exp(z); (u − 1)·(z / log u) cancels the rounding of u; exact branches near 0 and
    # −inf, and +inf where exp overflows (z > ~88.7: only k3_unclamped gets there), as torch.expm1.
    # z / log u (≈ 1) first: (u − 1)·z would overflow for finite results near the float32 maximum.
    u = tl.exp(z)
    um1 = u - 1.0
    edge = (u == 1.0) | (um1 == -1.0) | (u == float("inf"))
    safe = tl.where(edge, 1.0, um1 * (z / tl.log(tl.where(edge, 2.0, u))))
    return tl.where(u == 1.0, z, tl.where(um1 == -1.0, -1.0, tl.where(u == float("inf"), u, safe)))


@triton.jit
def _pass(x, lo, hi):
    """1 where clamp(x, lo, hi) passes its gradient (closed interval, as torch.clamp), else 0."""
    return tl.where((x >= lo) & (x <= hi), 1.0, 0.0)


@triton.jit
def _max_grad(a, b, da, db):
    """(max(a, b), its gradient) with torch.maximum's half-and-half rule on ties."""
    return tl.maximum(a, b), tl.where(a > b, da, tl.where(a < b, db, 0.5 * (da + db)))


@triton.jit
def aggregation_weight(offs, active, seq, inputs, s, BRANCH: tl.constexpr):
    """The aggregation weight w = factor / (norm_mult · max(denom, floor)) of the tokens at ``offs``
    (0 where not ``active``); arguments as :func:`token_terms`'. Shared with the sequence-ratio
    kernel (``kernels.seq_token_loss``)."""
    den = s.norm_mult
    if BRANCH.HAS_DENOM:
        den = den * tl.maximum(tl.load(inputs.denom).to(tl.float32), s.denom_floor)
    # A (global) denominator that is 0, negative or not finite: NaN at active tokens; inactive ones
    # are stored as 0 by the callers, so an all-masked call gives 0 even with a normalizer of 0.
    den = tl.where((den > 0) & (den < float("inf")), den, float("nan"))
    if BRANCH.HAS_FACTOR:
        f_idx = seq if BRANCH.FACTOR_PER_SEQ else offs
        w = tl.load(inputs.factor + f_idx, mask=active, other=0.0).to(tl.float32) / den
    else:
        w = tl.where(active, 1.0 / den, 0.0)
    return w


@triton.jit
def token_terms(offs, active, seq, x, h, inputs, s, BRANCH: tl.constexpr):
    """``(ℓ, g_logp, g_entropy)`` of the tokens at ``offs`` (a block, or one row's scalar index);
    the one definition of the token-level math, shared by the token-block kernel and the row kernel
    of the gradient-in-forward path.

    Args:
        offs: int64 flat indices of the tokens in this call (per-token loads read ``ptr + offs``).
        active: bool, the tokens that are in range and not ignored (nothing is read elsewhere).
        seq: int64 sequence index of each token (per-sequence loads read ``ptr + seq``).
        x, h: fp32 log-prob and entropy of the tokens (any value where not ``active``; ``h`` is
            read only with ``BRANCH.HAS_ENTROPY``).
        inputs: ``TokenLossKernelInputs``, the per-token pointers ``old`` (read only with
            ``BRANCH.HAS_OLD``), ``adv``, ``ref``, ``rollout_w``, ``factor`` and the 0-dim ``denom``.
        s: ``TokenLossKernelScalars``, the fp32 runtime scalars.
        BRANCH: ``TokenLossBranches``, the constexpr branch choices.

    Not masked by ``active`` (the caller stores 0 at inactive tokens); NaN inputs give NaN ℓ and
    g_logp (see the module's Caveats)."""
    if BRANCH.HAS_OLD:
        old = tl.load(inputs.old + offs, mask=active, other=0.0).to(tl.float32)
    else:  # on-policy: old = sg[logp], the token's own log-prob (lr = 0, r = 1, dr/dlogp = 1)
        old = x
    a_idx = seq if BRANCH.ADV_PER_SEQ else offs
    a = tl.load(inputs.adv + a_idx, mask=active, other=0.0).to(tl.float32)
    nan_in = is_nonfinite(x) | is_nonfinite(a)
    if BRANCH.LOSS != REINFORCE:  # reinforce's −A·logp does not read old
        nan_in = nan_in | is_nonfinite(old)

    lr = x - old
    r = tl.exp(tl.clamp(lr, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    dr = r * _pass(lr, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # d r / d logp
    if BRANCH.LOSS == PPO:  # max(−A·min(r, δ), −A·clip(r)), then min(·, −c·A) where A < 0
        u = tl.minimum(r, s.delta)
        c = tl.clamp(r, s.clip_lo, s.clip_hi)
        pol, d_pol = _max_grad(
            -a * u, -a * c, -a * tl.where(r <= s.delta, 1.0, 0.0), -a * _pass(r, s.clip_lo, s.clip_hi)
        )
        if BRANCH.HAS_DUAL:
            k = -s.dual_clip * a
            d_dual = tl.where(pol < k, d_pol, tl.where(pol == k, 0.5 * d_pol, 0.0))
            neg = a < 0
            d_pol = tl.where(neg, d_dual, d_pol)
            pol = tl.where(neg, tl.minimum(pol, k), pol)
        g = d_pol * dr
    elif BRANCH.LOSS == CISPO:  # −sg[clamp(r, lo, hi)]·A·logp
        wc = tl.clamp(r, s.clip_lo, s.clip_hi)
        pol = -wc * a * x
        g = -wc * a
    elif BRANCH.LOSS == SAPO:  # −(4/τ)·σ(τ(r − 1))·A
        tau = tl.where(a > 0, s.tau_pos, s.tau_neg)
        sig = tl.sigmoid(tau * (r - 1.0))
        pol = -(4.0 / tau) * sig * a
        g = -4.0 * sig * (1.0 - sig) * a * dr
    else:  # reinforce: −A·logp
        pol = -a * x
        g = -a
    if BRANCH.HAS_ROLLOUT:
        rho = tl.load(inputs.rollout_w + offs, mask=active, other=0.0).to(tl.float32)
        nan_in = nan_in | (rho != rho)
        pol = pol * rho
        g = g * rho
    if BRANCH.KL != NO_KL:
        ref = tl.load(inputs.ref + offs, mask=active, other=0.0).to(tl.float32)
        nan_in = nan_in | is_nonfinite(ref)
        d = x - ref
        if BRANCH.KL == K1:
            kv = d
            kg = tl.where(active, 1.0, 1.0)
        elif BRANCH.KL == K2:
            kv = 0.5 * d * d
            kg = d
        elif BRANCH.KL == K3:  # expm1(−d) + d with verl's clamps (gradient 0 where a clamp bites)
            nd = -d
            ndc = tl.clamp(nd, -K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
            em = _expm1(ndc)
            v = em - ndc
            kv = tl.clamp(v, -K3_VALUE_BOUND, K3_VALUE_BOUND)
            kg = (
                -em
                * _pass(nd, -K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
                * _pass(v, -K3_VALUE_BOUND, K3_VALUE_BOUND)
            )
        elif BRANCH.KL == K3_UNCLAMPED:  # expm1(−d) + d, no clamps (TRL's k3)
            em = _expm1(-d)
            kv = em + d
            kg = -em
        else:  # abs
            kv = tl.abs(d)
            kg = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
        if BRANCH.KL_STRAIGHT:
            kg = d
        pol = pol + s.kl_coef * kv
        g = g + s.kl_coef * kg

    w = aggregation_weight(offs, active, seq, inputs, s, BRANCH)
    loss = w * pol
    g_logp = w * g
    g_entropy = -s.entropy_coef * w
    if BRANCH.HAS_ENTROPY:
        nan_in = nan_in | is_nonfinite(h)
        loss = loss - s.entropy_coef * w * h
    loss = tl.where(nan_in, float("nan"), loss)
    g_logp = tl.where(nan_in, float("nan"), g_logp)
    return loss, g_logp, g_entropy
