"""Triton kernels for the token-level RL loss: per-token loss, dL/dlogp and dL/dentropy in one launch.

Both kernels compute each token's terms with the one jit helper
:func:`rlkernel.kernels._token_loss_math.token_terms` (the formulas are in that module's docstring)
from a :class:`rlkernel._token_loss_plan.TokenLossPlan`, passed as three named tuples built by the
plan (``inputs``: per-token pointers, ``scalars``: fp32 runtime scalars, ``BRANCH``: the constexpr
branch choices; see that module for why named tuples).

Token-block kernel (``_token_loss_kernel``, :func:`token_loss_fwd`): one block of ``BLOCK`` tokens
of a flat stream of N tokens per program, from log-probs (and entropies) computed beforehand.
Inactive tokens (id == ignore_index, or past N) write exactly 0 and read nothing. Each program also
writes the sum of its tokens' ℓ_t to ``partial[pid]``; the caller sums the partials in a fixed
order (no atomics: deterministic). Memory traffic: reads ≤ 7 fp32/int64 values and writes ≤ 2 fp32
per token: ~50 B/token, 0.4 MB at N = 8192 — a few µs, one launch instead of the ~40 small launches
of the autograd algebra.

Gradient in forward (``_token_loss_rows_kernel``, :func:`token_loss_grad_in_fwd`): with the
upstream gradient of a scalar loss known up to one factor, the gradient can be written during the
forward. One program per row: pass 1 streams the row for lse (and H) with the log-prob forward's
tiles (same logp bits), the token's ℓ, g_logp, g_H come from ``token_terms``, pass 2 streams the
row again writing dℓ/dx into a new ``[N, V]`` buffer. Traffic: 2 reads + 1 write of N·V·b when the
second read hits HBM; when the rows in flight fit in L2 (V ≤ ~64k in bf16 on an H100: 132 SMs ×
64 KiB) the second read is an L2 hit and the loss costs 2 HBM passes instead of 3 (0.36 instead of
0.54 ms at N = 8192, V = 32,768 at 3 TB/s). The backward is ``_scale_kernel``: g *= upstream
gradient, read on the device; when it is 1 every lane is masked and no memory moves (one tiny
launch, no host sync). The dispatch rule (V threshold) is the option
``grad_in_forward_max_vocab``, read by ``rlkernel.rl.fused``.

Caveats:
    * The NaN and denominator rules of ``_token_loss_math`` hold for both kernels.
    * The gradient-in-forward buffer is rounded to the logits' dtype in forward and scaled in
      backward: with an upstream gradient ≠ 1 that is two roundings instead of one.
    * The named-tuple arguments need Triton >= 3.4: 3.3.1 passes runtime named tuples but cannot
      read a field of a constexpr one (``BRANCH.HAS_ENTROPY``: "'constexpr' object has no
      attribute", compiled for sm_90 on 2026-11-24); 3.4.0 and 3.9.0 compile both kernels to the
      same PTX as the flat-argument kernels they replace (``python -m rlkernel._sm90_compile
      --digest``). Hence ``triton>=3.4`` in pyproject.toml.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlkernel._token_loss_plan import TokenLossPlan
from rlkernel.kernels._launch import FP_FUSION, FastLauncher, cdiv, num_sms
from rlkernel.kernels._launch import device_guard as _device_guard
from rlkernel.kernels._reduce import pairwise_sum
from rlkernel.kernels._token_loss_math import token_terms
from rlkernel.kernels.logprobs import row_logprob_stats

BLOCK = 1024
NUM_WARPS = 4
SCALE_BLOCK = 4096


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
    inputs,  # TokenLossKernelInputs: old, adv, ref, rollout_w, factor, denom (0-dim, any numeric dtype)
    # sizes
    n_tokens,
    row0,
    seq_len,
    # runtime scalars
    ignore_index,
    scalars,  # TokenLossKernelScalars (fp32)
    # meta
    BLOCK: tl.constexpr,
    BRANCH: tl.constexpr,  # TokenLossBranches
):
    """One block of tokens per program; see the module docstrings for the formulas.

    Per-sequence inputs (``BRANCH.*_PER_SEQ``) are ``[S]`` values of a padded ``[S, seq_len]``
    batch, read at sequence (row0 + token) // seq_len, so that they need no broadcast copy; row0 is
    the flat index of this call's first token (a chunked caller's row offset)."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < n_tokens
    y = tl.load(ids_ptr + offs, mask=in_range, other=ignore_index).to(tl.int64)
    active = in_range & (y != ignore_index)
    x = tl.load(logp_ptr + offs, mask=active, other=0.0).to(tl.float32)
    h = x
    if BRANCH.HAS_ENTROPY:
        h = tl.load(entropy_ptr + offs, mask=active, other=0.0).to(tl.float32)
    seq = (row0 + offs) // seq_len
    loss, g_logp, g_entropy = token_terms(offs, active, seq, x, h, inputs, scalars, BRANCH)
    if BRANCH.HAS_ENTROPY:
        tl.store(g_entropy_ptr + offs, tl.where(active, g_entropy, 0.0), mask=in_range)
    tl.store(g_logp_ptr + offs, tl.where(active, g_logp, 0.0), mask=in_range)
    tl.store(partial_ptr + pid, pairwise_sum(tl.where(active, loss, 0.0)))


@triton.jit(do_not_specialize=["ignore_index", "seq_len"])
def _token_loss_rows_kernel(
    # outputs
    loss_ptr,
    logp_ptr,
    entropy_ptr,
    dx_ptr,  # [N, V] rows at (row // n_inner)·stride_db + (row % n_inner)·stride_dt, the logits' dtype
    stride_db,
    stride_dt,
    # inputs
    x_ptr,
    stride_xb,
    stride_xt,
    stride_xv,
    ids_ptr,
    inputs,  # TokenLossKernelInputs
    # sizes
    n_inner,
    n_cols,
    seq_len,
    # runtime scalars
    temperature,
    ignore_index,
    scalars,  # TokenLossKernelScalars (fp32)
    # meta
    BLOCK_V: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    BRANCH: tl.constexpr,  # TokenLossBranches
):
    """Gradient in forward, one row per program: pass 1 streams the row for lse (and H) exactly as
    ``logprobs._token_logprobs_fwd_kernel`` does (same tiles, so the same logp bits), the token's
    ℓ, g_logp, g_H come from ``token_terms``, pass 2 re-streams the row (mostly from L2 for
    V ≤ 64k) and writes dℓ/dx = [g_logp·(onehot − p) − g_H·p·(log p + H)] / T. Ignored rows write
    zeros and read nothing."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + (row // n_inner) * stride_xb + (row % n_inner) * stride_xt
    y = tl.load(ids_ptr + row).to(tl.int64)
    active = y != ignore_index
    inv_t = 1.0 / tl.cast(temperature, tl.float32)
    logp, lse, h = row_logprob_stats(
        x_row, stride_xv, y, active, n_cols, inv_t, BLOCK_V, NUM_STAGES, BRANCH.HAS_ENTROPY
    )
    if BRANCH.HAS_ENTROPY:
        tl.store(entropy_ptr + row, tl.where(active, h, 0.0))
    loss, g_logp, g_h = token_terms(row, active, row // seq_len, logp, h, inputs, scalars, BRANCH)
    tl.store(logp_ptr + row, tl.where(active, logp, 0.0))
    tl.store(loss_ptr + row, tl.where(active, loss, 0.0))
    dx_row = dx_ptr + (row // n_inner) * stride_db + (row % n_inner) * stride_dt
    row_grad_pass(dx_row, x_row, stride_xv, y, active, n_cols, inv_t, lse, h, g_logp, g_h, BLOCK_V,
                  BRANCH.HAS_ENTROPY)  # fmt: skip


@triton.jit
def row_grad_pass(
    dx_row, x_row, stride_xv, y, active, n_cols, inv_t, lse, h, g_logp, g_h, BLOCK_V: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
):
    """Pass 2 of a gradient-in-forward row: re-stream the row (mostly from L2 for V <= 64k) and write
    dℓ/dx = [g_logp·(onehot − p) − g_H·p·(log p + H)] / T into ``dx_row`` (contiguous columns, the
    gradient's dtype). Ignored rows write zeros and read nothing. Shared by the host-plan and the
    device-plan row kernels (``kernels.token_loss_rows``): one definition of the written gradient."""
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
        tl.store(dx_row + cols, dx.to(dx_row.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def _scale_kernel(g_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    """g *= *scale in place, reading the scale on the device; no memory traffic when it is 1 (the
    usual ``loss.backward()``), so the backward of the gradient-in-forward path needs no host sync.
    Persistent (a few programs per SM, each striding over the blocks): with a scale of 1 every
    program's loop runs zero times, ~3 µs instead of one empty program per block (50 µs for the
    604 MB gradient of [8, 1152, 32768] bf16 logits on an H100, 2026-11-28)."""
    s = tl.load(scale_ptr).to(tl.float32)
    n_live = tl.where(s != 1.0, n, 0)  # scale 1: nothing moves
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n_live, step):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n_live
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(g_ptr + offs, (g * s).to(g_ptr.dtype.element_ty), mask=m)


_launch_scale = FastLauncher(_scale_kernel)


def n_partials(n_tokens: int) -> int:
    """Number of per-block partial sums for ``n_tokens`` tokens."""
    return cdiv(n_tokens, BLOCK)


def token_loss_fwd(
    partial: torch.Tensor,
    g_logp: torch.Tensor,
    g_entropy: torch.Tensor | None,
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    plan: TokenLossPlan,
) -> None:
    """Out-variant launcher of the token-block kernel over the plan's N tokens (a whole plan, or a
    row range from ``plan.rows(start, stop)``).

    Fills ``partial`` [n_partials(N)], ``g_logp`` [N] and, when ``plan.want_entropy``,
    ``g_entropy`` [N] (else None), all fp32 contiguous, from ``logp`` and ``entropy`` (fp32
    contiguous [N]; ``entropy`` None unless ``plan.want_entropy``). The plan's per-token tensors
    must be contiguous (per-sequence ones are read whole)."""
    n = plan.n_tokens
    if n == 0:
        return
    assert partial.numel() == n_partials(n) and g_logp.numel() == n and logp.numel() == n
    per_token = (logp, plan.ids, plan.old, entropy, plan.ref, plan.rollout_w, g_logp, g_entropy)
    per_token += (() if plan.adv_per_seq else (plan.adv,)) + (() if plan.factor_per_seq else (plan.factor,))
    for t in per_token:
        assert t is None or (t.is_contiguous() and t.numel() == n), "per-token inputs must be contiguous [N]"
    assert (entropy is None) == (g_entropy is None) == (not plan.want_entropy)
    with _device_guard(logp):
        _token_loss_kernel[(n_partials(n),)](
            partial,
            g_logp,
            g_entropy if g_entropy is not None else g_logp,
            logp,
            entropy if entropy is not None else logp,
            plan.ids,
            plan.kernel_inputs(absent=logp),
            n,
            int(plan.row0),
            int(plan.seq_len),
            int(plan.ignore_index),
            plan.scalars.kernel_args(),
            BLOCK=BLOCK,
            BRANCH=plan.kernel_branches(),
            num_warps=NUM_WARPS,
            enable_fp_fusion=FP_FUSION,
        )


def token_loss_grad_in_fwd(
    logits: torch.Tensor, plan: TokenLossPlan, *, temperature: float, grad: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launcher of the gradient-in-forward row kernel over all N rows of ``logits`` (kernel layout,
    see ``logprobs.as_kernel_layout``) for a whole ``plan`` of the same N tokens:
    ``(loss_rows, logp, entropy, grad)`` with fp32 ``[N]`` per-row loss, logp and entropy (empty
    ``[0]`` unless ``plan.want_entropy``) and ``grad`` = dL/dlogits for an upstream gradient of 1 in
    the logits' dtype: a new contiguous tensor, or written into ``grad`` when given (the logits'
    shape and strides, e.g. the same window of a base-shaped buffer)."""
    from rlkernel.kernels import logprobs as lp

    n_inner, stride_b, stride_t, stride_v = lp.row_layout(logits)
    n_cols = logits.shape[-1]
    n = logits.numel() // max(n_cols, 1)
    dev = logits.device
    want_entropy = plan.want_entropy
    loss_rows = torch.empty(n, dtype=torch.float32, device=dev)
    logp = torch.empty(n, dtype=torch.float32, device=dev)
    entropy = torch.empty(n if want_entropy else 0, dtype=torch.float32, device=dev)
    if grad is None:
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=dev)
        stride_db, stride_dt = n_inner * n_cols, n_cols
    else:
        assert grad.shape == logits.shape and grad.stride() == logits.stride() and grad.dtype == logits.dtype
        stride_db, stride_dt = stride_b, stride_t
    if n == 0:
        return loss_rows, logp, entropy, grad
    assert plan.row0 == 0 and plan.n_tokens == n, "the row kernel runs over all rows of a whole plan"
    cfg = lp.fwd_config(n_cols, logits.dtype, with_entropy=want_entropy)
    with _device_guard(logits):
        _token_loss_rows_kernel[(n,)](
            loss_rows,
            logp,
            entropy if want_entropy else logp,
            grad,
            stride_db,
            stride_dt,
            logits,
            stride_b,
            stride_t,
            stride_v,
            plan.ids,
            plan.kernel_inputs(absent=logp),
            n_inner,
            n_cols,
            int(plan.seq_len),
            float(temperature),
            int(plan.ignore_index),
            plan.scalars.kernel_args(),
            BLOCK_V=cfg.block_v,
            NUM_STAGES=cfg.num_stages,
            BRANCH=plan.kernel_branches(),
            num_warps=cfg.num_warps,
            enable_fp_fusion=FP_FUSION,
        )
    return loss_rows, logp, entropy, grad


def scale_(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``grad *= scale`` in place (``scale``: a one-element tensor on grad's device), sync-free;
    reads and writes nothing when the scale is 1. Returns ``grad``."""
    n = grad.numel()
    if n:
        programs = min(cdiv(n, SCALE_BLOCK), 4 * num_sms(grad.device, interpreter=2))
        with _device_guard(grad):
            _launch_scale(
                (programs,), (grad, scale, n), {"BLOCK": SCALE_BLOCK},
                {"num_warps": 4, "enable_fp_fusion": FP_FUSION},
            )  # fmt: skip
    return grad
