"""Triton kernel for the sequence-ratio objectives (gspo, gspo_token, gmpo): one program per sequence.

The closed form is :mod:`rlkernel.rl.seq_token_loss` (formulas there; its torch version is this
kernel's reference). Program i owns the tokens of sequence i — ``[i·L, (i+1)·L)`` of a padded batch,
``[cu[i], cu[i+1])`` of a packed one — and makes two passes over them in blocks of ``BLOCK``:

    pass 1   Σ m·lr (gmpo: Σ m·lr'), n_i, Σ m·A_t (per-token advantages), W_i = Σ m·w_t·ρ_t
    between  s_i, the sequence loss W_i·ℓ_i and the sequence coefficient (gspo, gmpo)
    pass 2   each token's dL/dlogp (gspo_token: its own ℓ_t as well), plus the token-local KL and
             entropy terms of the policy-free token-level plan through the shared jit helper
             :func:`rlkernel.kernels._token_loss_math.token_terms`; writes g_logp (and g_entropy)

and writes its sequence's loss to ``partial[i]``; the caller sums the ``[S]`` partials (fixed order:
deterministic). One launch replaces the closed form's ~70 small torch launches (~30 µs of host time
each on the H100 host of 2026-11-24). Traffic: two reads of ≤ 8 per-token values (~60 B/token) and
one write of 4–8 B/token: a few µs at N = 8192.

Caveats:
    * Sums are in block order (a block's lanes pairwise, then the blocks in order), not torch's:
      equal to the torch closed form to fp32 rounding, not bitwise; deterministic run to run.
    * NaN rules as the torch closed form: non-finite active inputs give NaN (the sums carry it to
      the sequence's loss and coefficients; Triton's min/max do not promise to propagate NaN, so
      the clamps are guarded).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel._token_loss_plan import TokenLossPlan
from rlkernel.kernels._launch import FP_FUSION
from rlkernel.kernels._launch import device_guard as _device_guard
from rlkernel.kernels._reduce import is_nonfinite, last_program_sum, pairwise_sum
from rlkernel.kernels._token_loss_math import NO_KL, aggregation_weight, token_terms

BLOCK = 1024
NUM_WARPS = 4
SEQ_KINDS: dict[str, int] = {"gspo": 0, "gspo_token": 1, "gmpo": 2}
GSPO = tl.constexpr(SEQ_KINDS["gspo"])
GSPO_TOKEN = tl.constexpr(SEQ_KINDS["gspo_token"])
GMPO = tl.constexpr(SEQ_KINDS["gmpo"])


@triton.jit
def _nan_if(bad, x):
    return tl.where(bad, float("nan"), x)


@triton.jit
def _surrogate(s, a, clip_lo, clip_hi):
    """(ℓ, dℓ/ds) of max(−A·s, −A·clamp(s, lo, hi)) by torch's rules (clamp: closed interval;
    maximum: halves on ties)."""
    plain = -a * s
    clipped = -a * tl.clamp(s, clip_lo, clip_hi)
    d_clipped = tl.where((s >= clip_lo) & (s <= clip_hi), -a, 0.0)
    slope = tl.where(plain > clipped, -a, tl.where(plain < clipped, d_clipped, 0.5 * (d_clipped - a)))
    probe = s + a  # NaN iff s or A is (s is finite or NaN, A finite or NaN)
    nan = probe != probe  # tl.clamp / tl.maximum do not promise to propagate NaN
    return _nan_if(nan, tl.maximum(plain, clipped)), _nan_if(nan, slope)


@triton.jit
def _block(start, remaining, i, ids_ptr, logp_ptr, old_ptr, adv_ptr, ignore_index, HAS_OLD: tl.constexpr,
           ADV_SEQ: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """The block of ``BLOCK`` tokens from flat index ``start`` (``remaining`` of them left in sequence
    ``i``): ``(offs, inside, active, logp, lr, A)``, lr and A NaN where an input is not finite (so
    that the sums carry it), lr = 0 on-policy (``HAS_OLD`` False), A the sequence's with ``ADV_SEQ``."""
    lanes = tl.arange(0, BLOCK)
    offs = start + lanes
    inside = lanes < remaining
    y = tl.load(ids_ptr + offs, mask=inside, other=ignore_index).to(tl.int64)
    act = inside & (y != ignore_index)
    x = tl.load(logp_ptr + offs, mask=act, other=0.0).to(tl.float32)
    old = x
    if HAS_OLD:
        old = tl.load(old_ptr + offs, mask=act, other=0.0).to(tl.float32)
    lr = _nan_if(is_nonfinite(x) | is_nonfinite(old), x - old)
    if ADV_SEQ:
        a = tl.zeros([BLOCK], dtype=tl.float32) + tl.load(adv_ptr + i).to(tl.float32)
    else:
        a = tl.load(adv_ptr + offs, mask=act, other=0.0).to(tl.float32)
    return offs, inside, act, x, lr, _nan_if(is_nonfinite(a), a)


@triton.jit
def _weight(offs, active, seq, inputs, s, BRANCH: tl.constexpr):
    """w_t·ρ_t of the policy-free plan (0 where not active): ``token_terms``' aggregation weight
    times the rollout weight."""
    w = aggregation_weight(offs, active, seq, inputs, s, BRANCH)
    if BRANCH.HAS_ROLLOUT:
        w = w * tl.load(inputs.rollout_w + offs, mask=active, other=0.0).to(tl.float32)
    return tl.where(active, w, 0.0)


@triton.jit(do_not_specialize=["ignore_index", "seq_len"])
def _seq_token_loss_kernel(
    # outputs
    partial_ptr,  # [S] fp32
    g_logp_ptr,  # [N] fp32
    g_entropy_ptr,  # [N] fp32 (with an entropy term)
    # inputs
    logp_ptr,  # [N] fp32
    entropy_ptr,  # [N] fp32 (with an entropy term)
    ids_ptr,  # [N] int, ignore_index at inactive tokens
    old_ptr,  # [N] fp32 (HAS_OLD)
    adv_ptr,  # [S] (ADV_SEQ) or [N] fp32, the loss's advantages
    cu_ptr,  # [S + 1] int64 (PACKED)
    inputs,  # TokenLossKernelInputs of the policy-free plan (KL, entropy, weights)
    # sizes
    seq_len,
    # runtime scalars
    ignore_index,
    clip_lo,
    clip_hi,
    eps_low,
    eps_high,
    log_ratio_max,
    scalars,  # TokenLossKernelScalars of the policy-free plan
    # FINISH only (the device-built plan, ``kernels.seq_plan``)
    loss_out_ptr,  # fp32 [1]: Σ partial, written by the last program to finish
    counts_ptr,  # int64 [4]: counts[1] finished programs (0 before); counts[2:4] the id check's
    host_ptr,  # int64 [2] pinned host memory (HOST_COPY): counts[2:4]
    # meta
    KIND: tl.constexpr,
    GEO_MEAN: tl.constexpr,
    HAS_OLD: tl.constexpr,
    ADV_SEQ: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK: tl.constexpr,
    BRANCH: tl.constexpr,  # TokenLossBranches of the policy-free plan
    FINISH: tl.constexpr = False,
    HOST_COPY: tl.constexpr = False,
    SUM_BLOCK: tl.constexpr = 1024,
):
    i = tl.program_id(0).to(tl.int64)
    if PACKED:
        start = tl.load(cu_ptr + i).to(tl.int64)
        length = tl.load(cu_ptr + i + 1).to(tl.int64) - start
    else:
        start = i * seq_len
        length = seq_len + 0 * i
    seq = tl.zeros([BLOCK], dtype=tl.int64) + i

    # pass 1: the sequence's sums
    sum_lr = tl.zeros([BLOCK], dtype=tl.float32)
    sum_n = tl.zeros([BLOCK], dtype=tl.float32)
    sum_adv = tl.zeros([BLOCK], dtype=tl.float32)
    sum_w = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, length, BLOCK):
        offs, inside, act, x, lr, a = _block(start + j, length - j, i, ids_ptr, logp_ptr, old_ptr, adv_ptr,
                                             ignore_index, HAS_OLD, ADV_SEQ, BLOCK)  # fmt: skip
        if KIND == GMPO:  # lr' = min(lr, ε_high) if A > 0, max(lr, −ε_low) if A < 0, 0 if A = 0
            capped = tl.where(a > 0, tl.minimum(lr, eps_high), tl.where(a < 0, tl.maximum(lr, -eps_low), 0.0))
            lr = _nan_if(lr != lr, capped)
        sum_lr += tl.where(act, lr, 0.0)
        sum_n += tl.where(act, 1.0, 0.0)
        sum_adv += tl.where(act, a, 0.0)
        sum_w += _weight(offs, act, seq, inputs, scalars, BRANCH)
    n = tl.sum(sum_n, axis=0)
    n1 = tl.maximum(n, 1.0)
    total_lr = pairwise_sum(sum_lr)
    w_seq = pairwise_sum(sum_w)
    if ADV_SEQ:
        a_seq = tl.load(adv_ptr + i).to(tl.float32)
        a_seq = tl.where(n > 0, _nan_if(is_nonfinite(a_seq), a_seq), 0.0)
    else:
        a_seq = pairwise_sum(sum_adv) / n1

    # between: s_i and the sequence's loss and coefficient
    loss_seq = 0.0
    coef_seq = 0.0
    if KIND == GMPO:
        s_val = tl.exp(total_lr / n1)
        loss_seq = w_seq * (-a_seq * s_val)
        coef_seq = w_seq * (-a_seq) * s_val / n1
        gate = n >= 0.0  # gmpo has no log-ratio clamp (the per-token caps gate each token)
    else:
        log_s = total_lr
        if GEO_MEAN:
            log_s = log_s / n1
        gate = log_s <= log_ratio_max
        s_val = _nan_if(log_s != log_s, tl.exp(tl.minimum(log_s, log_ratio_max)))
        if KIND == GSPO:
            value, slope = _surrogate(s_val, a_seq, clip_lo, clip_hi)
            loss_seq = w_seq * value
            coef_seq = tl.where(gate, w_seq * slope * s_val, 0.0)
            if GEO_MEAN:
                coef_seq = coef_seq / n1

    # pass 2: per-token coefficients (and gspo_token's loss), the token-local terms, the stores
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, length, BLOCK):
        # the block's values as pass 1 read them (loads a kind does not use are compiled away)
        offs, inside, act, x, lr, a = _block(start + j, length - j, i, ids_ptr, logp_ptr, old_ptr, adv_ptr,
                                             ignore_index, HAS_OLD, ADV_SEQ, BLOCK)  # fmt: skip
        if KIND == GSPO:
            g = tl.where(act, coef_seq, 0.0)
        else:
            if KIND == GMPO:  # a non-finite lr (NaN) passes no gradient, as pass 1 made it
                passes = ((a > 0) & (lr <= eps_high)) | ((a < 0) & (lr >= -eps_low))
                g = tl.where(act & passes, coef_seq, 0.0)
            else:  # gspo_token: ℓ_t = max(−A_t·s_i, −A_t·clip(s_i)), slope s_i·dℓ/ds
                w = _weight(offs, act, seq, inputs, scalars, BRANCH)
                value, slope = _surrogate(s_val, a, clip_lo, clip_hi)
                acc += tl.where(act, w * value, 0.0)
                g = tl.where(act, tl.where(gate, w * slope * s_val, 0.0), 0.0)
        if (BRANCH.KL != NO_KL) or BRANCH.HAS_ENTROPY:
            h = x
            if BRANCH.HAS_ENTROPY:
                h = tl.load(entropy_ptr + offs, mask=act, other=0.0).to(tl.float32)
            t_loss, t_g, t_h = token_terms(offs, act, seq, x, h, inputs, scalars, BRANCH)
            acc += tl.where(act, t_loss, 0.0)
            g += tl.where(act, t_g, 0.0)
            if BRANCH.HAS_ENTROPY:
                tl.store(g_entropy_ptr + offs, tl.where(act, t_h, 0.0), mask=inside)
        tl.store(g_logp_ptr + offs, g, mask=inside)
    tl.store(partial_ptr + i, loss_seq + pairwise_sum(acc))
    if FINISH:  # the loss without a reduction launch (the last program sums the partials in order)
        n = tl.num_programs(0)
        last_program_sum(counts_ptr, n, partial_ptr, n, loss_out_ptr, host_ptr, SUM_BLOCK, HOST_COPY)


def seq_token_loss_fwd(
    plan: TokenLossPlan,
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    *,
    kind: str,
    geo_mean: bool,
    old: torch.Tensor | None,
    adv: torch.Tensor,
    adv_per_seq: bool,
    cu_seqlens: torch.Tensor | None,
    n_seqs: int,
    clip_lo: float,
    clip_hi: float,
    eps_low: float,
    eps_high: float,
    log_ratio_max: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(partial [S], g_logp [N], g_entropy [N] or None)`` of sequence-ratio loss ``kind`` over a
    whole policy-free plan (``rl.token_loss.plan_from_batch(..., policy_term=False)``), fp32.

    ``logp``/``entropy``/``old``/per-token ``adv``: fp32 contiguous ``[N]`` (``old`` None: on-policy);
    per-sequence ``adv`` ``[S]``; ``cu_seqlens`` int64 ``[S + 1]`` on the device for packed input
    (None: padded, sequences of ``plan.seq_len``); ``clip_lo``/``clip_hi`` the ratio clip interval,
    ``eps_low``/``eps_high`` gmpo's log-ratio caps, ``log_ratio_max`` gspo's clamp of log s."""
    n = plan.n_tokens
    dev = logp.device
    partial = torch.zeros(n_seqs, dtype=torch.float32, device=dev)
    g_logp = torch.empty(n, dtype=torch.float32, device=dev)
    g_entropy = torch.empty(n, dtype=torch.float32, device=dev) if plan.want_entropy else None
    if n == 0 or n_seqs == 0:
        return partial, g_logp, g_entropy
    assert plan.row0 == 0 and logp.numel() == n and logp.is_contiguous()
    with _device_guard(logp):
        _seq_token_loss_kernel[(n_seqs,)](
            partial,
            g_logp,
            g_entropy if g_entropy is not None else g_logp,
            logp,
            entropy if entropy is not None else logp,
            plan.ids,
            old if old is not None else logp,
            adv,
            cu_seqlens if cu_seqlens is not None else plan.ids,
            plan.kernel_inputs(absent=logp),
            int(plan.seq_len),
            int(plan.ignore_index),
            float(clip_lo),
            float(clip_hi),
            float(eps_low),
            float(eps_high),
            float(log_ratio_max),
            plan.scalars.kernel_args(),
            partial,  # loss_out, counts, host: not read without FINISH
            partial,
            partial,
            KIND=SEQ_KINDS[kind],
            GEO_MEAN=bool(geo_mean),
            HAS_OLD=old is not None,
            ADV_SEQ=bool(adv_per_seq),
            PACKED=cu_seqlens is not None,
            BLOCK=BLOCK,
            BRANCH=plan.kernel_branches(),
            num_warps=NUM_WARPS,
            enable_fp_fusion=FP_FUSION,
        )
    return partial, g_logp, g_entropy
