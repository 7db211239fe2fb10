"""Triton kernel for the token-level RL loss: per-token loss, dL/dlogp and dL/dentropy in one launch.

For every token t of a flat stream of N tokens (see :mod:`rlkernel.rl.token_loss` for the plan that
supplies the per-token constants, and :mod:`rlkernel.reference.token_loss` for the oracle):

    lr  = logp − old,   r = exp(clamp(lr, ±20))
    P   = the loss type's term (ppo with δ cap and dual clip | cispo | sapo | reinforce), dP/dlogp
    K   = the KL estimator at d = logp − ref (k1 | k2 | k3 with verl's clamps | abs; "+" forms:
          the value of the base, the gradient d of k2), dK/dlogp
    w   = factor_t / D,  D = norm_mult · max(denom, denom_floor)    (aggregation weight)
    ℓ_t = w·(ρ_t·P + kl_coef·K − entropy_coef·H_t)
    g_logp = w·(ρ_t·dP/dlogp + kl_coef·dK/dlogp),   g_entropy = −w·entropy_coef

with ρ_t the detached rollout-correction weight (1 without one) and ``factor_t`` 1/n_i for
``seq-mean-token-mean`` (1 otherwise). Inactive tokens (id == ignore_index, or past N) write
exactly 0 and read nothing. Each program also writes the sum of its ``BLOCK`` tokens' ℓ_t to
``partial[pid]``; the caller sums the partials in a fixed order (no atomics: deterministic).

Gradients follow PyTorch's autograd conventions exactly, so the result matches ``policy_loss``
under autograd: ``clamp`` passes the gradient on the closed interval, ``maximum``/``minimum`` split
it in halves on ties.

Memory traffic: reads ≤ 7 fp32/int64 values and writes ≤ 2 fp32 per token: ~50 B/token, 0.4 MB
at N = 8192 — a few µs, one launch instead of the ~40 small launches of the autograd algebra.

Gradient in forward (``_token_loss_rows_kernel``): with the upstream gradient of a scalar loss
known up to one factor, the gradient can be written during the forward. One program per row:
pass 1 streams the row for lse (and H) with the log-prob forward's tiles (same logp bits), the
token's ℓ, g_logp, g_H come from :func:`token_terms` (the one copy of the math), pass 2 streams
the row again writing dℓ/dx into a new ``[N, V]`` buffer. Traffic: 2 reads + 1 write of N·V·b
when the second read hits HBM; when the rows in flight fit in L2 (V ≤ ~64k in bf16 on an H100:
132 SMs × 64 KiB) the second read is an L2 hit and the loss costs 2 HBM passes instead of 3
(0.36 instead of 0.54 ms at N = 8192, V = 32,768 at 3 TB/s). The backward is ``_scale_kernel``:
g *= upstream gradient, read on the device; when it is 1 every lane is masked and no memory
moves (one tiny launch, no host sync). The dispatch rule (V threshold) lives in
``rlkernel.rl.fused.GRAD_IN_FORWARD_MAX_VOCAB``.

Caveats:
    * NaN or ±inf in logp, old (not read by reinforce), advantage, ref or entropy, and NaN in the
      rollout weight, at an active token give NaN (loss and coefficients) explicitly: Triton's
      ``minimum``/``maximum`` do not promise NaN propagation, and the log-ratio and k3 clamps would
      turn ±inf into finite values. An out-of-range id (``validate=False``) reaches here as a NaN
      logp. The plan makes the rollout weight NaN where old or rollout log-probs are not finite.
    * A denominator D that is 0, negative or not finite gives NaN at active tokens; inactive tokens
      write 0 whatever D is, so an all-masked call gives 0 with a global normalizer of 0.
    * The gradient-in-forward buffer is rounded to the logits' dtype in forward and scaled in
      backward: with an upstream gradient ≠ 1 that is two roundings instead of one.
    * ``expm1`` is Kahan's ``(u − 1)·z / log u`` (no libdevice call, so the CPU interpreter runs
      it): within a few ulp of ``torch.expm1``, not bitwise equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel.kernels._launch import FP_FUSION
from rlkernel.kernels._launch import device_guard as _device_guard
from rlkernel.kernels._reduce import is_nonfinite, pairwise_sum
from rlkernel.kernels.logprobs import row_logprob_stats

# Loss-type and KL codes (constexpr: each is a branch of the one kernel).
LOSS_CODES = {"ppo": 0, "cispo": 1, "sapo": 2, "reinforce": 3}
KL_CODES = {None: 0, "k1": 1, "k2": 2, "k3": 3, "abs": 4}
BLOCK = 1024
NUM_WARPS = 4
# constexpr: compiled kernels may read module globals only when they are constexpr (the interpreter
# does not enforce it).
LOG_RATIO_BOUND = tl.constexpr(20.0)  # rl.objectives.LOG_RATIO_BOUND
K3_LOG_RATIO_BOUND = tl.constexpr(20.0)  # rl.kl
K3_VALUE_BOUND = tl.constexpr(10.0)


@triton.jit
def _expm1(z):
    # Kahan: u = exp(z); (u − 1)·z / log(u) cancels the rounding of u; exact branches near 0 and −inf.
    u = tl.exp(z)
    um1 = u - 1.0
    safe = tl.where((u == 1.0) | (um1 == -1.0), 1.0, um1 * z / tl.log(tl.where(u == 1.0, 2.0, u)))
    return tl.where(u == 1.0, z, tl.where(um1 == -1.0, -1.0, safe))


@triton.jit
def _pass(x, lo, hi):
    """1 where clamp(x, lo, hi) passes its gradient (closed interval, as torch.clamp), else 0."""
    return tl.where((x >= lo) & (x <= hi), 1.0, 0.0)


@triton.jit
def _max_grad(a, b, da, db):
    """(max(a, b), its gradient) with torch.maximum's half-and-half rule on ties."""
    return tl.maximum(a, b), tl.where(a > b, da, tl.where(a < b, db, 0.5 * (da + db)))


@triton.jit
def token_terms(
    offs,
    active,
    seq,
    x,
    h,
    old_ptr,
    adv_ptr,
    ref_ptr,
    rollout_w_ptr,
    factor_ptr,
    denom_ptr,
    norm_mult,
    denom_floor,
    clip_lo,
    clip_hi,
    delta,
    dual_clip,
    tau_pos,
    tau_neg,
    kl_coef,
    entropy_coef,
    LOSS: tl.constexpr,
    KL: tl.constexpr,
    KL_STRAIGHT: tl.constexpr,
    HAS_DUAL: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    HAS_ROLLOUT: tl.constexpr,
    HAS_FACTOR: tl.constexpr,
    HAS_DENOM: tl.constexpr,
    ADV_PER_SEQ: tl.constexpr,
    FACTOR_PER_SEQ: tl.constexpr,
):
    """``(ℓ, g_logp, g_entropy)`` of the tokens at ``offs`` (a block, or one row's scalar index)
    with log-prob ``x`` and entropy ``h`` (fp32, any value where not ``active``); loads the
    per-token constants itself. The one definition of the token-level math, shared by the
    token-block kernel and the row kernel of the gradient-in-forward path. Not masked by
    ``active`` (the caller does that); NaN inputs give NaN ℓ and g_logp."""
    old = tl.load(old_ptr + offs, mask=active, other=0.0).to(tl.float32)
    a = tl.load(adv_ptr + (seq if ADV_PER_SEQ else offs), mask=active, other=0.0).to(tl.float32)
    nan_in = is_nonfinite(x) | is_nonfinite(a)
    if LOSS != 3:  # reinforce's −A·logp does not read old
        nan_in = nan_in | is_nonfinite(old)

    lr = x - old
    r = tl.exp(tl.clamp(lr, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    dr = r * _pass(lr, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # d r / d logp
    if LOSS == 0:  # ppo: max(−A·min(r, δ), −A·clip(r)), then min(·, −c·A) where A < 0
        u = tl.minimum(r, delta)
        c = tl.clamp(r, clip_lo, clip_hi)
        pol, d_pol = _max_grad(
            -a * u, -a * c, -a * tl.where(r <= delta, 1.0, 0.0), -a * _pass(r, clip_lo, clip_hi)
        )
        if HAS_DUAL:
            k = -dual_clip * a
            d_dual = tl.where(pol < k, d_pol, tl.where(pol == k, 0.5 * d_pol, 0.0))
            neg = a < 0
            d_pol = tl.where(neg, d_dual, d_pol)
            pol = tl.where(neg, tl.minimum(pol, k), pol)
        g = d_pol * dr
    elif LOSS == 1:  # cispo: −sg[clamp(r, lo, hi)]·A·logp
        wc = tl.clamp(r, clip_lo, clip_hi)
        pol = -wc * a * x
        g = -wc * a
    elif LOSS == 2:  # sapo: −(4/τ)·σ(τ(r − 1))·A
        tau = tl.where(a > 0, tau_pos, tau_neg)
        s = tl.sigmoid(tau * (r - 1.0))
        pol = -(4.0 / tau) * s * a
        g = -4.0 * s * (1.0 - s) * a * dr
    else:  # reinforce: −A·logp
        pol = -a * x
        g = -a
    if HAS_ROLLOUT:
        rho = tl.load(rollout_w_ptr + offs, mask=active, other=0.0).to(tl.float32)
        nan_in = nan_in | (rho != rho)
        pol = pol * rho
        g = g * rho
    if KL != 0:
        ref = tl.load(ref_ptr + offs, mask=active, other=0.0).to(tl.float32)
        nan_in = nan_in | is_nonfinite(ref)
        d = x - ref
        if KL == 1:
            kv = d
            kg = tl.where(active, 1.0, 1.0)
        elif KL == 2:
            kv = 0.5 * d * d
            kg = d
        elif KL == 3:  # expm1(−d) + d with verl's clamps (gradient 0 where a clamp bites)
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
        else:
            kv = tl.abs(d)
            kg = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
        if KL_STRAIGHT:
            kg = d
        pol = pol + kl_coef * kv
        g = g + kl_coef * kg

    # Aggregation weight w = factor / (norm_mult · max(denom, floor)).
    den = norm_mult
    if HAS_DENOM:
        den = den * tl.maximum(tl.load(denom_ptr).to(tl.float32), denom_floor)
    # A (global) denominator that is 0, negative or not finite: NaN at active tokens; inactive ones
    # are stored as 0 by the callers, so an all-masked call gives 0 even with a normalizer of 0.
    den = tl.where((den > 0) & (den < float("inf")), den, float("nan"))
    if HAS_FACTOR:
        f_idx = seq if FACTOR_PER_SEQ else offs
        w = tl.load(factor_ptr + f_idx, mask=active, other=0.0).to(tl.float32) / den
    else:
        w = tl.where(active, 1.0 / den, 0.0)
    loss = w * pol
    g_logp = w * g
    g_entropy = -entropy_coef * w
    if HAS_ENTROPY:
        nan_in = nan_in | is_nonfinite(h)
        loss = loss - entropy_coef * w * h
    loss = tl.where(nan_in, float("nan"), loss)
    g_logp = tl.where(nan_in, float("nan"), g_logp)
    return loss, g_logp, g_entropy


@triton.jit(do_not_specialize=["ignore_index", "n_tokens", "row0", "seq_len"])
def _token_loss_kernel(
    # outputs
    partial_ptr,
    g_logp_ptr,
    g_entropy_ptr,
    # inputs (flat [N] fp32 unless noted)
    logp_ptr,
    entropy_ptr,
    ids_ptr,  # any integer dtype
    old_ptr,
    adv_ptr,
    ref_ptr,
    rollout_w_ptr,
    factor_ptr,
    denom_ptr,  # 0-dim, any numeric dtype
    # sizes
    n_tokens,
    row0,
    seq_len,
    # runtime scalars
    ignore_index,
    norm_mult,
    denom_floor,
    clip_lo,
    clip_hi,
    delta,
    dual_clip,
    tau_pos,
    tau_neg,
    kl_coef,
    entropy_coef,
    # meta
    BLOCK: tl.constexpr,
    LOSS: tl.constexpr,
    KL: tl.constexpr,
    KL_STRAIGHT: tl.constexpr,
    HAS_DUAL: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    HAS_ROLLOUT: tl.constexpr,
    HAS_FACTOR: tl.constexpr,
    HAS_DENOM: tl.constexpr,
    ADV_PER_SEQ: tl.constexpr,
    FACTOR_PER_SEQ: tl.constexpr,
):
    """One block of tokens per program; see the module docstring for the formulas.

    ``*_PER_SEQ`` inputs are ``[S]`` per-sequence values of a padded ``[S, seq_len]`` batch, read at
    sequence (row0 + token) // seq_len, so that they need no broadcast copy; row0 is the flat index
    of this call's first token (a chunked caller's row offset)."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < n_tokens
    y = tl.load(ids_ptr + offs, mask=in_range, other=ignore_index).to(tl.int64)
    active = in_range & (y != ignore_index)
    x = tl.load(logp_ptr + offs, mask=active, other=0.0).to(tl.float32)
    h = x
    if HAS_ENTROPY:
        h = tl.load(entropy_ptr + offs, mask=active, other=0.0).to(tl.float32)
    loss, g_logp, g_entropy = token_terms(
        offs,
        active,
        (row0 + offs) // seq_len,
        x,
        h,
        old_ptr,
        adv_ptr,
        ref_ptr,
        rollout_w_ptr,
        factor_ptr,
        denom_ptr,
        norm_mult,
        denom_floor,
        clip_lo,
        clip_hi,
        delta,
        dual_clip,
        tau_pos,
        tau_neg,
        kl_coef,
        entropy_coef,
        LOSS,
        KL,
        KL_STRAIGHT,
        HAS_DUAL,
        HAS_ENTROPY,
        HAS_ROLLOUT,
        HAS_FACTOR,
        HAS_DENOM,
        ADV_PER_SEQ,
        FACTOR_PER_SEQ,
    )
    if HAS_ENTROPY:
        tl.store(g_entropy_ptr + offs, tl.where(active, g_entropy, 0.0), mask=in_range)
    tl.store(g_logp_ptr + offs, tl.where(active, g_logp, 0.0), mask=in_range)
    tl.store(partial_ptr + pid, pairwise_sum(tl.where(active, loss, 0.0)))


@triton.jit(do_not_specialize=["ignore_index", "seq_len"])
def _token_loss_rows_kernel(
    # outputs
    loss_ptr,
    logp_ptr,
    entropy_ptr,
    dx_ptr,  # contiguous [N, V], the logits' dtype
    # inputs
    x_ptr,
    stride_xb,
    stride_xt,
    stride_xv,
    ids_ptr,
    old_ptr,
    adv_ptr,
    ref_ptr,
    rollout_w_ptr,
    factor_ptr,
    denom_ptr,
    # sizes
    n_inner,
    n_cols,
    seq_len,
    # runtime scalars
    temperature,
    ignore_index,
    norm_mult,
    denom_floor,
    clip_lo,
    clip_hi,
    delta,
    dual_clip,
    tau_pos,
    tau_neg,
    kl_coef,
    entropy_coef,
    # meta
    BLOCK_V: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    LOSS: tl.constexpr,
    KL: tl.constexpr,
    KL_STRAIGHT: tl.constexpr,
    HAS_DUAL: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    HAS_ROLLOUT: tl.constexpr,
    HAS_FACTOR: tl.constexpr,
    HAS_DENOM: tl.constexpr,
    ADV_PER_SEQ: tl.constexpr,
    FACTOR_PER_SEQ: tl.constexpr,
):
    """Gradient in forward, one row per program: pass 1 streams the row for lse (and H) exactly as
    ``logprobs._token_logprobs_fwd_kernel`` does (same tiles, so the same logp bits), the token's
    ℓ, g_logp, g_H come from :func:`token_terms`, pass 2 re-streams the row (mostly from L2 for
    V ≤ 64k) and writes dℓ/dx = [g_logp·(onehot − p) − g_H·p·(log p + H)] / T. Ignored rows write
    zeros and read nothing."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + (row // n_inner) * stride_xb + (row % n_inner) * stride_xt
    y = tl.load(ids_ptr + row).to(tl.int64)
    active = y != ignore_index
    inv_t = 1.0 / tl.cast(temperature, tl.float32)
    logp, lse, h = row_logprob_stats(
        x_row, stride_xv, y, active, n_cols, inv_t, BLOCK_V, NUM_STAGES, HAS_ENTROPY
    )
    if HAS_ENTROPY:
        tl.store(entropy_ptr + row, tl.where(active, h, 0.0))
    loss, g_logp, g_h = token_terms(
        row,
        active,
        row // seq_len,
        logp,
        h,
        old_ptr,
        adv_ptr,
        ref_ptr,
        rollout_w_ptr,
        factor_ptr,
        denom_ptr,
        norm_mult,
        denom_floor,
        clip_lo,
        clip_hi,
        delta,
        dual_clip,
        tau_pos,
        tau_neg,
        kl_coef,
        entropy_coef,
        LOSS,
        KL,
        KL_STRAIGHT,
        HAS_DUAL,
        HAS_ENTROPY,
        HAS_ROLLOUT,
        HAS_FACTOR,
        HAS_DENOM,
        ADV_PER_SEQ,
        FACTOR_PER_SEQ,
    )
    tl.store(logp_ptr + row, tl.where(active, logp, 0.0))
    tl.store(loss_ptr + row, tl.where(active, loss, 0.0))
    dx_row = dx_ptr + row * n_cols
    n_stream = tl.where(active, n_cols, 0)  # ignored rows write zeros and read nothing
    for v0 in range(0, n_cols, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(x_row + cols * stride_xv, mask=cols < n_stream, other=0.0).to(tl.float32)
        log_p = x * inv_t - lse
        p = tl.exp(log_p)
        dz = tl.where(cols == y, g_logp, 0.0) - g_logp * p
        if HAS_ENTROPY:
            dz -= g_h * tl.where(x == float("-inf"), 0.0, p * (log_p + h))
        dx = tl.where(active, dz * inv_t, 0.0)
        tl.store(dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def _scale_kernel(g_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    """g *= *scale in place, reading the scale on the device; no memory traffic when it is 1 (the
    usual ``loss.backward()``), so the backward of the gradient-in-forward path needs no host sync."""
    s = tl.load(scale_ptr).to(tl.float32)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < tl.where(s != 1.0, n, 0)  # scale 1: every lane masked, nothing moves
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(g_ptr + offs, (g * s).to(g_ptr.dtype.element_ty), mask=m)


def n_partials(n_tokens: int) -> int:
    """Number of per-block partial sums for ``n_tokens`` tokens."""
    return triton.cdiv(n_tokens, BLOCK)


def token_loss_fwd(
    partial: torch.Tensor,
    g_logp: torch.Tensor,
    g_entropy: torch.Tensor | None,
    *,
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    ids: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    ref: torch.Tensor | None,
    rollout_w: torch.Tensor | None,
    factor: torch.Tensor | None,
    denom: torch.Tensor | None,
    row0: int,
    seq_len: int,
    adv_per_seq: bool,
    factor_per_seq: bool,
    ignore_index: int,
    norm_mult: float,
    denom_floor: float,
    loss: str,
    clip_lo: float,
    clip_hi: float,
    delta: float,
    dual_clip: float | None,
    tau_pos: float,
    tau_neg: float,
    kl: str | None,
    kl_straight: bool,
    kl_coef: float,
    entropy_coef: float,
) -> None:
    """Out-variant launcher: fills ``partial`` [n_partials(N)], ``g_logp`` [N] and (unless None)
    ``g_entropy`` [N], all fp32 contiguous. Every per-token input is a contiguous [N] tensor
    (``ids`` any integer dtype, the rest fp32), except ``adv``/``factor`` with ``*_per_seq``: fp32
    [S] per sequence of ``seq_len`` tokens, token i of this call in sequence (row0 + i) // seq_len;
    ``denom`` a 0-dim tensor on the same device."""
    n = logp.numel()
    if n == 0:
        return
    assert partial.numel() == n_partials(n) and g_logp.numel() == n
    per_token = (logp, ids, old, entropy, ref, rollout_w, g_logp, g_entropy)
    per_token += (() if adv_per_seq else (adv,)) + (() if factor_per_seq else (factor,))
    for t in per_token:
        assert t is None or (t.is_contiguous() and t.numel() == n), "per-token inputs must be contiguous [N]"
    assert (entropy is None) == (g_entropy is None)
    runtime, meta = _scalar_args(locals())
    with _device_guard(logp):
        _token_loss_kernel[(n_partials(n),)](
            partial,
            g_logp,
            g_entropy if g_entropy is not None else g_logp,
            logp,
            entropy if entropy is not None else logp,
            ids,
            old,
            adv,
            ref if ref is not None else logp,
            rollout_w if rollout_w is not None else logp,
            factor if factor is not None else logp,
            denom if denom is not None else logp,
            n,
            int(row0),
            max(int(seq_len), 1),
            int(ignore_index),
            *runtime,
            BLOCK=BLOCK,
            HAS_ENTROPY=entropy is not None,
            **meta,
            num_warps=NUM_WARPS,
            enable_fp_fusion=FP_FUSION,
        )


def _scalar_args(args: dict) -> tuple[list, dict]:
    """The runtime scalars and constexpr flags shared by both kernels, from launcher kwargs."""
    dual = args["dual_clip"]
    runtime = [
        float(args["norm_mult"]),
        float(args["denom_floor"]),
        float(args["clip_lo"]),
        float(args["clip_hi"]),
        float(args["delta"]),
        float(dual) if dual is not None else 0.0,
        float(args["tau_pos"]),
        float(args["tau_neg"]),
        float(args["kl_coef"]),
        float(args["entropy_coef"]),
    ]
    meta = dict(
        LOSS=LOSS_CODES[args["loss"]],
        KL=KL_CODES[args["kl"]],
        KL_STRAIGHT=bool(args["kl_straight"]),
        HAS_DUAL=dual is not None,
        HAS_ROLLOUT=args["rollout_w"] is not None,
        HAS_FACTOR=args["factor"] is not None,
        HAS_DENOM=args["denom"] is not None,
        ADV_PER_SEQ=bool(args["adv_per_seq"]),
        FACTOR_PER_SEQ=bool(args["factor_per_seq"]) and args["factor"] is not None,
    )
    return runtime, meta


def token_loss_grad_in_fwd(
    logits: torch.Tensor,
    *,
    temperature: float,
    want_entropy: bool,
    **plan_args,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Allocating launcher of the gradient-in-forward row kernel over all N rows of ``logits``
    (kernel layout, see ``logprobs.as_kernel_layout``): ``(loss_rows, logp, entropy, grad)`` with
    fp32 ``[N]`` per-row loss, logp and entropy (empty ``[0]`` unless ``want_entropy``) and
    ``grad`` = dL/dlogits for an upstream gradient of 1 (contiguous, the logits' dtype).
    ``plan_args``: ``TokenLossPlan.slice_args(0, N)``."""
    from rlkernel.kernels import logprobs as lp

    n_inner, stride_b, stride_t, stride_v = lp.row_layout(logits)
    n_cols = logits.shape[-1]
    n = logits.numel() // max(n_cols, 1)
    dev = logits.device
    loss_rows = torch.empty(n, dtype=torch.float32, device=dev)
    logp = torch.empty(n, dtype=torch.float32, device=dev)
    entropy = torch.empty(n if want_entropy else 0, dtype=torch.float32, device=dev)
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=dev)
    if n == 0:
        return loss_rows, logp, entropy, grad
    assert plan_args["row0"] == 0, "the row kernel runs over all rows"
    runtime, meta = _scalar_args(plan_args)
    cfg = lp.fwd_config(n_cols, logits.dtype, with_entropy=want_entropy)
    t = plan_args
    with _device_guard(logits):
        _token_loss_rows_kernel[(n,)](
            loss_rows,
            logp,
            entropy if want_entropy else logp,
            grad,
            logits,
            stride_b,
            stride_t,
            stride_v,
            t["ids"],
            t["old"],
            t["adv"],
            t["ref"] if t["ref"] is not None else logp,
            t["rollout_w"] if t["rollout_w"] is not None else logp,
            t["factor"] if t["factor"] is not None else logp,
            t["denom"] if t["denom"] is not None else logp,
            n_inner,
            n_cols,
            max(int(t["seq_len"]), 1),
            float(temperature),
            int(t["ignore_index"]),
            *runtime,
            BLOCK_V=cfg.block_v,
            NUM_STAGES=cfg.num_stages,
            HAS_ENTROPY=want_entropy,
            num_warps=cfg.num_warps,
            enable_fp_fusion=FP_FUSION,
            **meta,
        )
    return loss_rows, logp, entropy, grad


SCALE_BLOCK = 4096


def scale_(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``grad *= scale`` in place (``scale``: a one-element tensor on grad's device), sync-free;
    reads and writes nothing when the scale is 1. Returns ``grad``."""
    n = grad.numel()
    if n:
        with _device_guard(grad):
            _scale_kernel[(triton.cdiv(n, SCALE_BLOCK),)](
                grad, scale, n, BLOCK=SCALE_BLOCK, num_warps=4, enable_fp_fusion=FP_FUSION
            )
    return grad
